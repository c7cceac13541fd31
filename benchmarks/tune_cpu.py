"""`hybrid tune` over ddp, zero1, zero2, zero3, fsdp and hsdp on 4 CPU ranks (gloo) for a small
decoder (benchmarks/tune_decoder/config.json: GPT-2 style, 4.2M parameters), then the plan of the same
job before and after the calibration it wrote.

    .venv/bin/python benchmarks/tune_cpu.py     # a few minutes -> benchmarks/results/tune_cpu.md, tune_cpu.yaml

What it checks: every layout is measured (predicted vs measured side by side), the measured choice
is the measured fastest, and after calibration the re-predicted step times are compared with the
measured ones (the largest gap is printed; the cost model has no term for per-step framework
work, so what it cannot fit shows up there).
"""
from __future__ import annotations

import contextlib
import io
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.cli import main  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / "results" / "tune_cpu.md"
CAL = HERE / "results" / "tune_cpu.yaml"
JOB = ["benchmarks/tune_decoder", "--gpu", "cpu", "--gpus-per-node", "4", "--gpu-memory", "1GiB",
       "--micro-batch", "4", "--seq-len", "256", "--precision", "fp32", "--activation-checkpointing", "none",
       "--tp", "1"]
TUNE = ["tune", *JOB, "--strategies", "ddp,zero1,zero2,zero3,fsdp,hsdp", "--top", "6", "--steps", "8",
        "--implementation", "hybrid"]
PLAN = ["plan", *JOB, "--pp", "1"]


def run(argv: list[str]) -> str:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main(argv)
    if code:
        raise SystemExit(f"{' '.join(argv)} exited {code}")
    return buf.getvalue().rstrip()


def chosen(text: str) -> str:
    return next(line for line in text.splitlines() if line.startswith("chosen:"))


def main_() -> int:
    import yaml

    import os

    start, load0 = time.perf_counter(), os.getloadavg()[0]
    tuned = run([*TUNE, "--save-calibration", str(CAL)])
    minutes, load1 = (time.perf_counter() - start) / 60, os.getloadavg()[0]
    cal = yaml.safe_load(CAL.read_text())
    fastest = min(cal["trials"], key=lambda t: t["measured_s"])["layout"]
    choice = next(line for line in tuned.splitlines() if line.startswith("measured choice:"))
    gaps = [(t["layout"], t["repredicted_s"] / t["measured_s"] - 1) for t in cal["trials"]]
    before, after = run(PLAN), run([*PLAN, "--calibration", str(CAL)])
    lines = ["# hybrid tune on 4 CPU ranks", "",
             f"`.venv/bin/python benchmarks/tune_cpu.py` ran `hybrid {' '.join(TUNE)} --save-calibration "
             f"{CAL.relative_to(HERE.parent)}` in {minutes:.1f} min:", "",
             *("    " + x for x in tuned.splitlines()), "",
             f"- machine: {os.cpu_count()} cores, load average {load0:.1f} at the start and {load1:.1f} at the end "
             "(other work shares these cores: it slows some trials more than others)",
             f"- the measured choice is the measured fastest: {choice.split(':')[1].split('(')[0].strip() == fastest} "
             f"({fastest})",
             "- re-predicted vs measured after calibration: " +
             ", ".join(f"{k} {v:+.1%}" for k, v in gaps) + f"; largest {max(abs(v) for _, v in gaps):.1%}", "",
             "## The plan before and after the calibration", "",
             f"`hybrid {' '.join(PLAN)}`:", "", "    " + chosen(before), "",
             f"with `--calibration {CAL.relative_to(HERE.parent)}`:", "", "    " + chosen(after), ""]
    text = "\n".join(lines)
    print(text)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main_())
