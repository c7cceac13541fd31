"""The cross-check matrix's gaps per cell family: analytic vs traced live-tensor bytes at the peak, for
the cells tests/measure/test_matrix.py holds within 3% (the cells are imported from
tests/measure/matrix_cells.py, not restated), then traced vs live for the cells that test measures on
2 real gloo CPU ranks (hybrid/measure/measured.py: the tracker on real tensors, the layout applied by
the same parallelize, fp32, 2 x 64 tokens; tp 2, cp 2 and ep 2 among them).

    .venv/bin/python benchmarks/matrix_accuracy.py      # writes benchmarks/results/matrix_accuracy.txt

Every cell: 1 x 2 h100-80gb, one rank's peak, bf16-mixed, AdamW; tiny-llama at 2 x 256 tokens (pp 2:
1f1b, 2 micro-batches, one block a stage), the tiny MoE decoders at 2 x 64 (fsdp, ep 2).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.model.sources import resolve_model  # noqa: E402
from tests.measure.matrix_cells import (DENSE, EXPERT, LIVE, PIPELINE, dense_family, dense_pair,  # noqa: E402
                                        expert_pair, live_label, live_pairs, pipeline_pair)

OUT = Path(__file__).parent / "results" / "matrix_accuracy.txt"
FAMILIES = ("dense tp1", "tp2", "cp2", "pp2", "ep2", "transformers decoders")


def cells():
    """(family, label, pair function, its arguments) for every cell of the matrix."""
    tiny = resolve_model("tiny-llama")
    for c in DENSE:
        s, tp, cp, ac, hf = c
        yield dense_family(c), f"{s} tp {tp} cp {cp} ac {ac} {'transformers' if hf else 'hybrid'}", dense_pair, (
            tiny, *c)
    for c in PIPELINE:
        yield "pp2", "{} 1f1b ac {} pp rank {}".format(*c), pipeline_pair, (tiny, *c)
    for c in EXPERT:
        yield "ep2", "fsdp {} ac {}".format(*c), expert_pair, c


def main() -> int:
    rows: dict[str, list[tuple[str, int, int, float]]] = {f: [] for f in FAMILIES}
    for family, label, pair, args in cells():
        start = time.perf_counter()
        a, t = pair(*args)
        rows[family].append((label, a, t, time.perf_counter() - start))
    lines = ["analytic vs traced: live-tensor bytes at one rank's peak "
             "(`.venv/bin/python benchmarks/matrix_accuracy.py`)"]
    for family in FAMILIES:
        worst = max(abs(a / t - 1) for _, a, t, _ in rows[family])
        lines += ["", f"{family}: {len(rows[family])} cells, max |gap| {worst:.2%}",
                  f"  {'cell':<44} {'analytic B':>12} {'traced B':>12} {'gap':>8} {'s':>5}"]
        lines += [f"  {label:<44} {a:>12,} {t:>12,} {a / t - 1:>+8.2%} {secs:>5.1f}"
                  for label, a, t, secs in rows[family]]
    lines += ["", "traced vs live: 2 gloo CPU ranks, fp32, 2 x 64 tokens (tiny-llama; the MoE decoders at ep 2, "
              "the trace's dispatch balanced)", f"  {'cell':<44} {'traced B':>12} {'live B':>12} {'gap':>8}"]
    for cell, (t, m) in zip(LIVE, live_pairs()):
        lines.append(f"  {live_label(cell):<44} {t:>12,} {m:>12,} {t / m - 1:>+8.2%} ({t - m:+,} B)")
    text = "\n".join(lines) + "\n"
    print(text, end="")
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
