"""The recipe for Llama-2-7B on an H100 cluster: the Hugging Face model built on the meta device,
bf16 mixed precision, per-decoder-layer sharding, activation checkpointing chosen by the planner.

    # 8 nodes x 8 H100 (see slurm/train.sbatch for the srun wrapper)
    .venv/bin/torchrun --nnodes 8 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint $HEAD:29500 \\
        examples/llama_7b.py --seq-len 4096 --steps 1000 --ckpt-dir /shared/ckpt

On a machine without GPUs it prints the plan for the cluster it would run on (--nodes,
--gpus-per-node, --gpu) and exits. --tiny runs the same code path on a 2-layer Llama here
(CPU ranks are fine): .venv/bin/torchrun --standalone --nproc-per-node 2 examples/llama_7b.py --tiny
"""
from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid.config.cluster import Cluster  # noqa: E402
from hybrid.model.presets import DecoderConfig, get_preset  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama2-7b", help="any llama-style preset (llama2-7b, llama3-8b, ...)")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer model of the same family, runs anywhere")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--ckpt-dir", default=None)
    ap.add_argument("--save-every", type=int, default=500)
    return ap.parse_args(argv)


def shape(args) -> DecoderConfig:
    cfg = get_preset(args.preset)
    if args.tiny:
        return DecoderConfig("llama", 1024, 128, 2, 4, 352, 256, kv_heads=2, hf_model_type="llama")
    return cfg


def print_plan_and_exit(args, cfg) -> None:
    from hybrid.planning.planner import plan
    from hybrid.model.profile import profile_decoder
    from hybrid.planning.report import format_plan
    from hybrid.config.spec import TrainSpec
    p = plan(profile_decoder(cfg, args.preset), TrainSpec(args.micro_batch, args.seq_len),
             Cluster.build(args.nodes, args.gpus_per_node, args.gpu), search_checkpointing=True)
    print(format_plan(p, summary=True))
    print("\nno GPU here: this is the plan auto_wrap would apply on that cluster; launch under torchrun "
          "on it to train (or pass --tiny to run the code path here)")


def main(argv=None):
    args = parse_args(argv)
    cfg = shape(args)
    if not torch.cuda.is_available() and not args.tiny:
        print_plan_and_exit(args, cfg)
        return
    import torch.distributed as dist
    from torch.utils.data import DataLoader, DistributedSampler
    from transformers import AutoConfig, AutoModelForCausalLM

    from hybrid import auto_wrap
    from hybrid.runtime.data import synthetic_corpus
    from hybrid.runtime.mesh import shutdown

    hf = dict(cfg.hf_config())
    with torch.device("meta"):                       # nothing allocated: FSDP materialises shards only
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(hf.pop("model_type"), **hf),
                                                 attn_implementation="sdpa")
    seq = min(args.seq_len, cfg.max_positions)
    cluster = None if torch.cuda.is_available() else Cluster.build(1, int(os.environ.get("WORLD_SIZE", 1)), "h100-80gb")
    w = auto_wrap(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1),
                  micro_batch=args.micro_batch, seq_len=seq, cluster=cluster,
                  pp=1)      # this loop is w(batch) / backward / step; a pipeline runs whole steps (w.train_step)
    rank, world = dist.get_rank(), dist.get_world_size()
    data = synthetic_corpus(max(args.steps, 1) * world * args.micro_batch, seq, cfg.vocab)
    sampler = DistributedSampler(data, num_replicas=w.dp_size, rank=w.dp_rank, shuffle=True, seed=0)
    loader = DataLoader(data, batch_size=args.micro_batch, sampler=sampler, drop_last=True)
    if args.ckpt_dir and os.path.exists(os.path.join(args.ckpt_dir, "meta.json")):
        w.load(args.ckpt_dir)
    epoch = 0
    while w.step_count < args.steps:
        sampler.set_epoch(epoch)
        for (ids,) in loader:
            ids = ids.to(w.runtime.device)
            out = w({"input_ids": ids, "labels": ids})
            w.backward(out.loss)
            w.step()
            w.zero_grad()
            if rank == 0 and (w.step_count % 10 == 0 or w.step_count == args.steps):
                print(f"step {w.step_count}  loss {out.loss.item():.4f}", flush=True)
            if args.ckpt_dir and w.step_count % args.save_every == 0:
                w.save(args.ckpt_dir)
            if w.step_count >= args.steps:
                break
        epoch += 1
    shutdown()


if __name__ == "__main__":
    main()
