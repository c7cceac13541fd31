"""The traced plan's wall time against the analytic plan's, each as the CLI runs it.

    .venv/bin/python benchmarks/traced_plan_speed.py            # writes benchmarks/results/traced_plan_speed.md
    .venv/bin/python benchmarks/traced_plan_speed.py llama2-7b  # one job again (the other rows kept)

Each job is `hybrid plan MODEL --nodes 8 --gpus-per-node 8 --gpu h100-80gb --seq-len 4096` in a fresh
process (imports included, as a user pays them), once with the default analytic memory and once with
`--method traced`; the traced candidates share the traces of ranks that run the same program
(hybrid/measure/traced.TraceCache; tests/measure/test_trace_cache.py holds that each candidate's bytes
are the ones it has traced alone). The machine is shared: the load average is written beside each row.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = Path(__file__).parent / "results" / "traced_plan_speed.md"
JOBS = ("llama2-7b", "llama3-70b", "mixtral-8x7b")
CLUSTER = ("--nodes", "8", "--gpus-per-node", "8", "--gpu", "h100-80gb", "--seq-len", "4096")
TIMEOUT = 3600


WITHOUT = {"mixtral-8x7b": ("ddp",)}
"""Presets left out of a job's plans: the traced ddp candidate of an MoE model ends in a traceback today
(transformers' grouped_mm experts under fake tensors: `Expected inputs of BF16 type but got
mat_a.dtype=torch.float32`), so that job plans every other preset, analytic and traced alike, through
the CLI's own `_plan` (what `hybrid plan` runs before printing)."""

PLAN_WITHOUT = """
import sys
from hybrid.cli.main import _parse, _plan
from hybrid.families.catalogue import load_catalogue
from hybrid.planning.report import format_plan
args = _parse(sys.argv[2:])
skip = sys.argv[1].split(",")
plan, _ = _plan(args, [n for n in load_catalogue() if n not in skip], search=True)
print(format_plan(plan))
"""


def timed_plan(model: str, *extra: str) -> tuple[float, str, str]:
    """(wall seconds, stdout, stderr) of one `hybrid plan` in a fresh process."""
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    argv = ["plan", model, *CLUSTER, *extra]
    if model in WITHOUT:
        cmd = [sys.executable, "-c", PLAN_WITHOUT, ",".join(WITHOUT[model]), *argv]
    else:
        cmd = [sys.executable, "-m", "hybrid.cli", *argv]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    seconds = time.perf_counter() - start
    if done.returncode != 0:
        last = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else ""
        raise SystemExit(f"hybrid plan {model} {' '.join(extra)} failed (rc {done.returncode}): {last}")
    return seconds, done.stdout, done.stderr


def row(model: str) -> str:
    analytic, _, _ = timed_plan(model)
    traced, out, err = timed_plan(model, "--method", "traced")
    traces = re.findall(r"(\d+)/(\d+) tracing", err)
    candidates = traces[-1][1] if traces else "?"
    cpu = os.getloadavg()[0]
    without = f" (without {', '.join(WITHOUT[model])})" if model in WITHOUT else ""
    return f"| {model}{without} | {analytic:.1f} | {traced:.1f} | {traced / analytic:.1f}x | {candidates} | {cpu:.1f} |"


HEADER = ["# Traced vs analytic plan time", "",
          "`.venv/bin/python benchmarks/traced_plan_speed.py`: `hybrid plan MODEL --nodes 8 --gpus-per-node 8 --gpu "
          "h100-80gb --seq-len 4096` with the analytic memory and with `--method traced`, each in a fresh process "
          "(wall seconds, imports included). Traced candidates whose ranks run the same program share one trace "
          "(hybrid/measure/traced.TraceCache: zero1, zero2 and the zero2/zero3 offload presets run FSDP2 without or "
          "with resharding under the trace, as fsdp-offload runs fsdp's); the bytes are each candidate's own "
          "(tests/measure/test_trace_cache.py).", "",
          "| model | analytic s | traced s | traced / analytic | traced candidates | load average |",
          "|---|---|---|---|---|---|"]


NOTES = ["", "The machine is shared (2 cores, other jobs running: the load average beside each row), so the seconds "
         "are noisy; the ratio is the figure to compare. Before the traces were shared (commit 2d66a01), the traced "
         "plan of llama2-7b here took 441 s wall at a load average near 8 (`time hybrid plan llama2-7b --nodes 8 "
         "--gpus-per-node 8 --gpu h100-80gb --seq-len 4096 --method traced`), eight of its twelve candidates traced "
         "whole; its output is "
         "byte-identical after (diffed).",
         "", "mixtral-8x7b plans every preset but ddp, analytic and traced alike (through the CLI's own `_plan`): "
         "the traced ddp candidate of an MoE model ends in a traceback today (transformers' grouped_mm experts under "
         "fake tensors: `Expected inputs of BF16 type but got mat_a.dtype=torch.float32`). The traced side pays "
         "torch's and transformers' imports (the analytic planner is torch-free), a fixed few seconds that weigh "
         "most where the analytic plan is quickest.",
         "", "What the rest of the time is: the DeepSpeed and offload presets still trace whole (two traces, one per "
         "program), since their state layout replaces the traced one along the timeline "
         "(hybrid/measure/traced._account), which the 3-/4-block extrapolation does not reproduce to the byte."]


def main(argv: list[str]) -> None:
    """Rerun the given jobs (all without arguments) and write the table, keeping the rows of the others."""
    jobs = argv or list(JOBS)
    old = OUT.read_text().splitlines() if OUT.exists() else []
    rows = {line.split(" | ")[0][2:].split(" (")[0]: line for line in old if line.startswith("| ")}
    rows = {m: line for m, line in rows.items() if m in JOBS}
    for model in jobs:
        rows[model] = row(model)
        print(rows[model], flush=True)
    OUT.write_text("\n".join(HEADER + [rows[m] for m in JOBS if m in rows] + NOTES) + "\n")
    print(OUT.read_text())

if __name__ == "__main__":
    main(sys.argv[1:])
