"""Train a small GPT with any strategy, with checkpoints and resume. Launch with torchrun, from
the repo root after ./setup.sh (or `source .venv/bin/activate` and drop the `.venv/bin/`):

    .venv/bin/torchrun --standalone --nproc-per-node 2 examples/train_gpt.py --strategy auto --steps 40
    .venv/bin/torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --strategy zero3 \
        --ckpt-dir ckpt --save-every 10 --async-save
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \
    .venv/bin/torchrun --standalone --nproc-per-node 2 --max-restarts 1 examples/train_gpt.py \
        --ckpt-dir ckpt --resume ...

(With --max-restarts, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 gives each restart a fresh rendezvous
store; the shared one can hand restarted workers their dead peers' addresses, pytorch#135712.)

The data is synthetic (a fixed random bigram language, so the loss has somewhere to go) and the
same on every run. The basics every DDP user expects are here: a DistributedSampler order
(hybrid.runtime.data.ResumableSampler, with set_epoch(epoch)), only rank 0 logs and writes files, a
barrier before exit; a restarted job (torchrun --max-restarts) resumes from the last checkpoint
(auto_wrap(resume=)), mid-epoch, on the same batches, at any world size: the sampler's epoch and
position in global samples are in the checkpoint (w.track) and re-split over the new ranks, and the
global batch (saved too) is kept by adjusting gradient accumulation.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid import auto_wrap  # noqa: E402
from hybrid.ckpt.folder import read_meta  # noqa: E402
from hybrid.runtime.data import ResumableSampler, synthetic_corpus  # noqa: E402
from hybrid.runtime.mesh import shutdown  # noqa: E402
from hybrid.model.decoder import build_decoder  # noqa: E402
from hybrid.model.presets import DecoderConfig  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strategy", default="auto", help="auto or a catalogue name (ddp, fsdp, hsdp, zero3, ...)")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--global-batch", type=int, default=None,
                    help="sequences per optimizer step (default: micro-batch x ranks; on resume: the checkpoint's)")
    ap.add_argument("--steps", type=int, default=40, help="optimizer steps in total")
    ap.add_argument("--samples", type=int, default=512, help="sequences in the synthetic corpus")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--precision", default=None, help="fp32 | bf16-mixed | bf16 (default: by device)")
    ap.add_argument("--gpu-memory", default=None, help="plan against this per-GPU capacity, e.g. 8GiB")
    ap.add_argument("--ckpt-dir", default=None, help="checkpoint directory (written atomically)")
    ap.add_argument("--save-every", type=int, default=0, help="save every N steps (0: only at the end)")
    ap.add_argument("--resume", action="store_true", help="continue from --ckpt-dir if it holds a checkpoint")
    ap.add_argument("--async-save", action="store_true",
                    help="save in the background (returns after the copy into host memory)")
    ap.add_argument("--out", default=None, help="rank 0 writes the final full state dict here (torch.save)")
    ap.add_argument("--crash-at-step", type=int, default=0,
                    help="testing: SIGKILL --crash-rank at this step on the first attempt only")
    ap.add_argument("--crash-rank", type=int, default=1)
    ap.add_argument("--sample-log", default=None, help="testing: rank 0 appends each step's sample ids (JSON lines)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    cfg = DecoderConfig("llama", args.vocab, args.hidden, args.layers, 4, int(2.75 * args.hidden),
                        args.seq_len, kv_heads=2, tied=True)
    model = build_decoder(cfg, seed=0)
    resume = args.resume and args.ckpt_dir and os.path.exists(os.path.join(args.ckpt_dir, "meta.json"))
    global_batch = args.global_batch
    if global_batch is None:     # the run's own (a resumed job keeps it whatever its world size)
        saved = read_meta(args.ckpt_dir)["extra"].get("global_batch") if resume else None
        global_batch = saved or args.micro_batch * int(os.environ.get("WORLD_SIZE", "1"))
    # resume=: continue from the directory's last committed version (none yet: start fresh)
    w = auto_wrap(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr), strategy=args.strategy,
                  micro_batch=args.micro_batch, seq_len=args.seq_len, precision=args.precision,
                  gpu_memory=args.gpu_memory, global_batch=global_batch, verbose=True,
                  resume=args.ckpt_dir if args.resume else None)
    rank = dist.get_rank()
    device = w.runtime.device
    data = synthetic_corpus(args.samples, args.seq_len, args.vocab)
    indexed = torch.utils.data.TensorDataset(torch.arange(len(data)), data.tensors[0])
    # every checkpoint carries the sampler's epoch and position; a resumed job's continues from them
    sampler = w.track(ResumableSampler(len(data), w.dp_size, w.dp_rank, shuffle=True, seed=0, drop_last=True))
    loader = DataLoader(indexed, batch_size=w.micro_batch, sampler=sampler, drop_last=True)

    if w.resumed_from:
        if rank == 0:
            print(f"resumed from {args.ckpt_dir} at step {w.step_count} (epoch {sampler.epoch}, sample "
                  f"{sampler.position}; {w.dp_size} ranks x {w.micro_batch} x {w.gradient_accumulation} "
                  f"accumulation = global batch {w.global_batch})", flush=True)
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    window = []
    while w.step_count < args.steps:
        sampler.set_epoch(sampler.epoch)
        for idx, ids in loader:
            ids = ids.to(device)
            end = w.sync_gradients                         # this micro-batch ends the window
            loss = w(ids, labels=ids).loss
            w.backward(loss)
            w.step()
            w.zero_grad()
            sampler.advance(len(ids))
            window += idx.tolist()
            if not end:
                continue
            step = w.step_count
            if args.sample_log:
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, window)
                if rank == 0:
                    with open(args.sample_log, "a") as f:
                        f.write(json.dumps({"step": step, "epoch": sampler.epoch, "world": dist.get_world_size(),
                                            "ids": sorted(i for part in everyone for i in part)}) + "\n")
            window = []
            if rank == 0 and (step % 10 == 0 or step == args.steps):
                print(f"step {step:4d}  epoch {sampler.epoch}  loss {loss.item():.4f}", flush=True)
            if args.ckpt_dir and args.save_every and step % args.save_every == 0:
                w.save(args.ckpt_dir, extra={"global_batch": w.global_batch}, async_=args.async_save)
            if step == args.crash_at_step and restarts == 0 and rank == args.crash_rank:
                os.kill(os.getpid(), signal.SIGKILL)       # a hard failure, mid-epoch
            if step >= args.steps:
                break
        else:
            sampler.set_epoch(sampler.epoch + 1)
    if args.ckpt_dir and not args.save_every:
        w.save(args.ckpt_dir, extra={"global_batch": w.global_batch})
    w.close()                                              # waits for an async save still being written
    state = w.state_dict()                                 # collective: every rank
    if rank == 0 and args.out:
        torch.save(state, args.out)
    shutdown()                                             # barrier, then every rank leaves cleanly


if __name__ == "__main__":
    main()
