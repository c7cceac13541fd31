"""The cross-check matrix's gaps, every cell: the analytic estimate against the trace of the same program (the
real parallelize on fake tensors) for every row of the planner's plans in tests/measure/matrix_cells.py (its
SLICES, not restated here), the refused rows and the rows the trace cannot run counted with their reason;
then the trace against the live tensors of the same job on 2 gloo CPU ranks (LIVE: one launch).

    .venv/bin/python benchmarks/matrix_accuracy.py      # writes benchmarks/results/matrix_accuracy.txt (~3 min)

Every cell: 1 x 2 or 1 x 4 h100-80gb, one rank's live tensors at its peak, bf16-mixed, AdamW; tiny-llama
(2 blocks; 4 for interleaved) at 2 x 256 tokens, the tiny MoE decoders at 2 x 64; the live cells fp32, 2 x 64.
"""
from __future__ import annotations

import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.measure.traced import TraceCache  # noqa: E402
from tests.measure.matrix_cells import LIVE, OUTSIDE, SLICES, cells, live_pairs, traced_bytes  # noqa: E402

OUT = Path(__file__).parent / "results" / "matrix_accuracy.txt"


def slice_rows(sl) -> tuple[list[str], dict]:
    """The slice's cell lines and its summary (cells, traced, refused, untraced, worst gap, seconds)."""
    cache, lines, worst, n = TraceCache(size=4096), [], defaultdict(float), defaultdict(int)
    start = time.process_time()
    all_cells = cells(sl)
    for cell in all_cells:
        if cell.refused is not None:
            n["refused"] += 1
            lines.append(f"  {cell.label:<52} refused: {cell.refused}")
        elif sl.untraced is not None:
            n["untraced"] += 1
            lines.append(f"  {cell.label:<52} analytic {cell.analytic:>11,}  not traced")
        else:
            a, t = cell.analytic, traced_bytes(cell, cache)
            n["traced"] += 1
            worst[cell.family] = max(worst[cell.family], abs(a / t - 1))
            lines.append(f"  {cell.label:<52} analytic {a:>11,}  traced {t:>11,}  {a / t - 1:>+7.2%}")
    summary = {"cells": len(all_cells), **n, "worst": dict(worst), "seconds": time.process_time() - start}
    return lines, summary


def main() -> int:
    out, table = [], []
    for sl in SLICES:
        lines, s = slice_rows(sl)
        worst = max(s["worst"].values(), default=None)
        head = (f"{sl.name}: {s['cells']} cells, {s.get('traced', 0)} traced"
                + (f" (max |gap| {worst:.2%})" if worst is not None else "")
                + (f", {s['refused']} refused alike" if s.get("refused") else "")
                + (f", {s['untraced']} not traced: {sl.untraced}" if s.get("untraced") else "")
                + f"; {s['seconds']:.0f} s of CPU")
        out += ["", head, *lines]
        for family, gap in sorted(s["worst"].items()):
            table.append(f"  {family:<44} {gap:>7.2%}")
    out += ["", "traced vs live: 2 gloo CPU ranks, fp32, 2 x 64 tokens (per pipeline rank with stages)"]
    worst_live = defaultdict(float)
    for cell, (ref, got) in zip(LIVE + OUTSIDE, live_pairs(LIVE + OUTSIDE)):
        gaps = [r / g - 1 for r, g in zip(ref, got)]
        outside = cell in OUTSIDE
        if not outside:
            worst_live[cell.family] = max(worst_live[cell.family], *map(abs, gaps))
        pairs = "  ".join(f"{r:>10,} vs {g:>10,} {x:+.2%}" for r, g, x in zip(ref, got, gaps))
        out.append(f"  {cell.label:<60} {pairs}" + ("  (outside the bound: matrix_cells.OUTSIDE)" if outside else ""))
    out += ["", "worst |analytic - traced| per cell family:", *table,
            "", "worst |traced - live| per family of the live cells:",
            *(f"  {f:<44} {g:>7.2%}" for f, g in sorted(worst_live.items()))]
    text = "analytic vs traced vs live: live-tensor bytes at one rank's peak " \
           "(`.venv/bin/python benchmarks/matrix_accuracy.py`)\n" + "\n".join(out) + "\n"
    print(text, end="")
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
