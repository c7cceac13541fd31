"""Per-optimizer-step time of auto_wrap(model) against the same backend wired by hand, alternating
step by step in one run (2 CPU ranks, gloo), with gradient accumulation over GA micro-batches
(each library's own no-sync). Target: ratio <= 1.02.

    .venv/bin/python benchmarks/wrap_overhead.py [--steps 30]
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.presets import DecoderConfig

OUT = Path(__file__).parent / "results" / "wrap_overhead.md"
CFG = DecoderConfig("llama", 2048, 256, 4, 8, 688, 256, kv_heads=4, tied=True)
MB, SEQ, GA = 4, 128, 4


def by_hand(family, model):
    """The backend wired the way its own documentation shows."""
    import torch.distributed as dist
    if family == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP
        ddp = DDP(model)
        opt = torch.optim.AdamW(ddp.parameters(), lr=3e-4)

        def forward(k, *a, **kw):          # DDP's no_sync must cover the forward too
            ddp.require_backward_grad_sync = k == GA - 1
            return ddp(*a, **kw)
        return forward, lambda loss, k: (loss / GA).backward(), \
            lambda k: (opt.step(), opt.zero_grad(set_to_none=True)) if k == GA - 1 else None
    if family == "fsdp":
        from torch.distributed.fsdp import fully_shard
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

        def backward(loss, k):
            model.set_requires_gradient_sync(k == GA - 1)
            (loss / GA).backward()
        return lambda k, *a, **kw: model(*a, **kw), backward, \
            lambda k: (opt.step(), opt.zero_grad(set_to_none=True)) if k == GA - 1 else None
    import deepspeed

    from hybrid.families.deepspeed import ds_config
    from hybrid.families.catalogue import get_strategy
    from hybrid.config.spec import TrainSpec
    # the same ZeRO-3 settings auto_wrap generates, so only the wrapper itself is compared
    cfg = ds_config(get_strategy("zero3"), TrainSpec(MB, SEQ, precision="fp32"), CFG.hidden,
                    dist.get_world_size(), dist.get_world_size(), cuda=False, gradient_accumulation=GA)
    eng, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                                   config=cfg, dist_init_required=not dist.is_initialized())
    return lambda k, *a, **kw: eng(*a, **kw), lambda loss, k: eng.backward(loss), lambda k: eng.step()


def bench(steps: int):
    import torch.distributed as dist

    from hybrid import auto_wrap
    from hybrid.model.decoder import build_decoder
    rows = []
    for family, strategy in (("ddp", "ddp"), ("fsdp", "fsdp"), ("deepspeed", "zero3")):
        w = auto_wrap(build_decoder(CFG, seed=0), strategy=strategy, precision="fp32", micro_batch=MB,
                      seq_len=SEQ, gradient_accumulation=GA, verbose=False)
        hand, backward, step = by_hand(family, build_decoder(CFG, seed=0))
        ids = torch.randint(0, CFG.vocab, (MB, SEQ), generator=torch.Generator().manual_seed(dist.get_rank()))

        def ours_step():
            for _ in range(GA):
                loss = w(ids, labels=ids).loss
                w.backward(loss)
                w.step()
                w.zero_grad()

        def hand_step():
            for k in range(GA):
                loss = hand(k, ids, labels=ids).loss
                backward(loss, k)
                step(k)

        ours, theirs = [], []
        for i in range(steps + 3):
            # alternate which goes first so neither always pays for the other's cache misses
            order = ((ours_step, ours), (hand_step, theirs)) if i % 2 else ((hand_step, theirs), (ours_step, ours))
            for fn, times in order:
                dist.barrier()
                t0 = time.perf_counter()
                fn()
                if i >= 3:                   # warm-up steps are not counted
                    times.append(time.perf_counter() - t0)
        times = torch.tensor([statistics.median(ours), statistics.median(theirs)])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        rows.append((strategy, times[0].item(), times[1].item()))
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    rows = run_ranks(2, bench, args.steps)[0]
    lines = ["# auto_wrap overhead", "", f"`.venv/bin/python benchmarks/wrap_overhead.py --steps {args.steps}`: "
             f"2 CPU ranks (gloo), {CFG.params:,}-param decoder, fp32, micro-batch {MB} x {SEQ}, gradient "
             f"accumulation {GA} (each library's no-sync); median optimizer-step time, the two alternating step by "
             "step. Target: ratio <= 1.02.", "",
             "| strategy | auto_wrap s/step | by hand s/step | ratio |", "|---|---|---|---|"]
    for name, ours, theirs in rows:
        lines.append(f"| {name} | {ours:.4f} | {theirs:.4f} | {ours / theirs:.3f} |")
    OUT.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
