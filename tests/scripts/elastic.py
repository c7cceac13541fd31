"""An elastic job for tests/runtime/test_elastic.py: launched by torchrun (any --nproc-per-node,
--max-restarts), it resumes with auto_wrap(resume=), carries its sampler with w.track, saves
asynchronously every --save-every steps and at the end, and (with --kill-at) SIGKILLs one rank at
that step on torchrun's first attempt only. Rank 0 appends one JSON line per optimizer step:
step, global mean loss, the sample ids every rank trained on, epoch, world size, attempt.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from hybrid import auto_wrap  # noqa: E402
from hybrid.model.decoder import build_decoder  # noqa: E402
from hybrid.model.presets import DecoderConfig  # noqa: E402
from hybrid.runtime.data import ResumableSampler, synthetic_corpus  # noqa: E402
from hybrid.runtime.mesh import shutdown  # noqa: E402

SEQ, VOCAB, GLOBAL, MICRO = 16, 128, 8, 2


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--step-log", required=True)
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--save-every", type=int, default=3)
    ap.add_argument("--kill-at", type=int, default=0)
    ap.add_argument("--kill-rank", type=int, default=1)
    ap.add_argument("--samples", type=int, default=48)
    args = ap.parse_args()
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    cfg = DecoderConfig("llama", VOCAB, 32, 1, 4, 88, SEQ, kv_heads=2, tied=True)
    w = auto_wrap(build_decoder(cfg, seed=0), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                  strategy="fsdp", precision="fp32", micro_batch=MICRO, seq_len=SEQ, global_batch=GLOBAL,
                  activation_checkpointing="none", verbose=False, resume=args.ckpt)
    rank = dist.get_rank()
    tokens = synthetic_corpus(args.samples, SEQ, VOCAB).tensors[0]
    sampler = w.track(ResumableSampler(args.samples, w.dp_size, w.dp_rank, seed=0))
    loader = DataLoader(TensorDataset(torch.arange(args.samples), tokens),
                        batch_size=w.micro_batch * w.gradient_accumulation, sampler=sampler, drop_last=True)
    while w.step_count < args.steps:
        for idx, ids in loader:
            loss = w.train_step(ids)
            sampler.advance(len(idx))
            everyone = [None] * dist.get_world_size()
            dist.all_gather_object(everyone, idx.tolist())
            step = w.step_count
            if rank == 0:
                with open(args.step_log, "a") as f:
                    f.write(json.dumps({"step": step, "loss": loss, "ids": sorted(i for p in everyone for i in p),
                                        "epoch": sampler.epoch, "world": dist.get_world_size(), "attempt": attempt,
                                        "resumed": w.resumed_from}) + "\n")
            if step % args.save_every == 0 or step == args.steps:
                w.save(args.ckpt, async_=True)
            if step == args.kill_at and attempt == 0 and rank == args.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)
            if step >= args.steps:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    w.close()
    shutdown()


if __name__ == "__main__":
    main()
