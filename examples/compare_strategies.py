"""Per-GPU memory of every strategy, stacked by category, against the GPU's capacity, with the
predicted throughput beside it (the plot `hybrid compare --plot` draws).

    .venv/bin/python examples/compare_strategies.py llama2-7b --nodes 8 --gpus-per-node 8 --seq-len 4096 \
        --out memory.png
"""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from hybrid.config.cluster import Cluster  # noqa: E402
from hybrid.planning.planner import plan  # noqa: E402
from hybrid.model.sources import resolve_model
from hybrid.planning.report import format_compare, plot_compare  # noqa: E402
from hybrid.config.spec import TrainSpec  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default="llama2-7b")
    ap.add_argument("--nodes", type=int, default=8)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h100-80gb")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--checkpointing", default="none", help="none | selective | full")
    ap.add_argument("--strategies", default="ddp,zero1,zero2,hsdp,fsdp,zero3,zero3-hpz,zero3-offload")
    ap.add_argument("--out", default="memory.png")
    args = ap.parse_args(argv)
    src = resolve_model(args.model)
    p = plan(src.profile, TrainSpec(args.micro_batch, args.seq_len, activation_checkpointing=args.checkpointing),
             Cluster.build(args.nodes, args.gpus_per_node, args.gpu), strategies=args.strategies.split(","),
             search_shards=False, tp=1, pp=1)          # one bar per strategy, as `hybrid compare` draws
    print(format_compare(p))
    plot_compare(p, args.out)
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
