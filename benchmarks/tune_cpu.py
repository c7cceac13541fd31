"""`hybrid tune` over ddp, zero1, zero2, zero3, fsdp and hsdp on 4 CPU ranks (gloo) for a small
decoder (benchmarks/tune_decoder/config.json: GPT-2 style, 4.3M parameters), at two micro-batch
sizes; then the calibration each run wrote is checked on the other run's trials (held out: the
compute halves between them while the per-step host work does not), and the plan of the job
before and after the calibration.

    .venv/bin/python benchmarks/tune_cpu.py     # a few minutes -> benchmarks/results/tune_cpu.md, tune_cpu*.yaml
    .venv/bin/python benchmarks/tune_cpu.py --refit FILE   # seconds: today's fit on a calibration file's trials

--refit fits the trials kept in a calibration file (an earlier run's, version 1 or 2) again with
today's cost model and fit, on all of them and leaving each out in turn (fitted on the others,
checked on it): the same measurements before and after a change to the model.

What it checks: every layout is measured (predicted vs measured side by side), the measured choice
is the measured fastest, and the re-predicted step times after calibration against the measured
ones, on the trials the calibration was fitted to and on the held-out ones.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from hybrid.cli.main import main  # noqa: E402

HERE = Path(__file__).parent
OUT = HERE / "results" / "tune_cpu.md"
CAL = HERE / "results" / "tune_cpu.yaml"
CAL_B = HERE / "results" / "tune_cpu_mb2.yaml"
BASE = ["benchmarks/tune_decoder", "--gpu", "cpu", "--gpus-per-node", "4", "--gpu-memory", "1GiB", "--seq-len", "256",
        "--precision", "fp32", "--activation-checkpointing", "none", "--tp", "1"]
JOB = [*BASE[:5], "--micro-batch", "4", *BASE[5:]]
JOB_B = [*BASE[:5], "--micro-batch", "2", *BASE[5:]]
STRATEGIES = ["--strategies", "ddp,zero1,zero2,zero3,fsdp,hsdp", "--top", "6", "--steps", "8",
              "--implementation", "hybrid"]
TUNE = ["tune", *JOB, *STRATEGIES]
TUNE_B = ["tune", *JOB_B, *STRATEGIES]
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


def held_out(cal_path: Path, job: list[str], trials: list[dict]) -> list[tuple[str, float]]:
    """Each trial's step time as the plan of `job` predicts it with the calibration at `cal_path`
    (fitted on other trials), against its measured time: (layout, error)."""
    p = json.loads(run(["plan", *job, "--pp", "1", "--json",
                        "--calibration", str(cal_path)]))
    pred = {(s["name"], s["shard_size"]): s["step_time_s"] for s in p["strategies"] if s.get("step_time_s")}
    return [(t["layout"], pred[(t["layout"], t["shard_size"])] / t["measured_s"] - 1) for t in trials]


def fmt(gaps) -> str:
    return ", ".join(f"{k} {v:+.1%}" for k, v in gaps) + f"; largest {max(abs(v) for _, v in gaps):.1%}"


def twins(trials: list[dict]) -> str:
    """The gap between layouts that do the same work at accumulation 1 (zero2 reduce-scatters in
    every micro-batch, zero1 at the window's end; hsdp with one replica is fsdp): the noise."""
    m = {t["layout"]: t["measured_s"] for t in trials}
    return ", ".join(f"{a} vs {b} {m[a] / m[b] - 1:+.1%}" for a, b in (("zero2", "zero1"), ("hsdp", "fsdp"))
                     if a in m and b in m)


def refit(path: str) -> str:
    """Today's calibration of the trials in the calibration file at `path`: each trial re-predicted
    with the fit on all of them, and with the fit on the others (leave one out)."""
    from dataclasses import replace

    from hybrid.estimation.calibration import calibrate, load, predict
    from hybrid.config.cluster import Cluster, cpu_spec
    from hybrid.planning.planner import plan
    from hybrid.model.sources import resolve_model
    from hybrid.config.spec import TrainSpec

    cal = load(path)
    job = cal.job
    cl = Cluster(job["nodes"], job["gpus_per_node"], replace(cpu_spec(job["gpus_per_node"]), memory_bytes=2**30))
    prof = resolve_model(job["model"]).profile
    p = plan(prof, TrainSpec(job["micro_batch"], job["seq_len"], precision=job["precision"],
                             activation_checkpointing="none", gradient_accumulation=job["gradient_accumulation"]),
             cl, strategies=sorted({t.layout for t in cal.trials}), tp=1, pp=1)
    cands = [next(c for c in p.candidates if (c.label, c.shard_size) == (t.layout, t.shard_size)) for t in cal.trials]
    m = [t.measured_s for t in cal.trials]
    whole = calibrate(cands, prof, cl, m, [t.measured_bytes for t in cal.trials])
    runs = ", ".join(f"{t.layout} {t.measured_s:.3f} s" for t in cal.trials)
    out = [f"refit of the {len(m)} trials in {path} (measured {runs}):",
           f"- fitted on all: {', '.join(f'{k} {getattr(whole, k):.4g}' for k in whole.fitted)}: " +
           fmt([(t.layout, t.residual) for t in whole.trials])]
    loo = []
    for i in range(len(m)):
        rest = [k for k in range(len(m)) if k != i]
        c = calibrate([cands[k] for k in rest], prof, cl, [m[k] for k in rest], [1] * len(rest))
        loo.append((f"{cands[i].label} ({'+'.join(c.fitted)})", predict([cands[i]], prof, c.apply(cl))[0] / m[i] - 1))
    out.append("- each left out, fitted on the others: " + fmt(loo))
    return "\n".join(out)


def main_() -> int:
    import yaml

    if sys.argv[1:2] == ["--refit"] and len(sys.argv) == 3:
        print(refit(sys.argv[2]))
        return 0

    start, load0 = time.perf_counter(), os.getloadavg()[0]
    tuned = run([*TUNE, "--save-calibration", str(CAL)])
    minutes, load1 = (time.perf_counter() - start) / 60, os.getloadavg()[0]
    tuned_b = run([*TUNE_B, "--save-calibration", str(CAL_B)])
    load2 = os.getloadavg()[0]
    cal, cal_b = yaml.safe_load(CAL.read_text()), yaml.safe_load(CAL_B.read_text())
    fastest = min(cal["trials"], key=lambda t: t["measured_s"])["layout"]
    choice = next(line for line in tuned.splitlines() if line.startswith("measured choice:"))
    fitted = [(t["layout"], t["repredicted_s"] / t["measured_s"] - 1) for t in cal["trials"]]
    fitted_b = [(t["layout"], t["repredicted_s"] / t["measured_s"] - 1) for t in cal_b["trials"]]
    a_on_b, b_on_a = held_out(CAL, JOB_B, cal_b["trials"]), held_out(CAL_B, JOB, cal["trials"])
    before, after = run(PLAN), run([*PLAN, "--calibration", str(CAL)])
    lines = ["# hybrid tune on 4 CPU ranks", "",
             f"`.venv/bin/python benchmarks/tune_cpu.py` ran `hybrid {' '.join(TUNE)} --save-calibration "
             f"{CAL.relative_to(HERE.parent)}` in {minutes:.1f} min:", "",
             *("    " + x for x in tuned.splitlines()), "",
             f"and the same at micro-batch 2, `hybrid {' '.join(TUNE_B)} --save-calibration "
             f"{CAL_B.relative_to(HERE.parent)}`:", "",
             *("    " + x for x in tuned_b.splitlines()), "",
             f"- machine: {os.cpu_count()} cores, load average {load0:.1f} at the start, {load1:.1f} after the first "
             f"run and {load2:.1f} after the second (other work shares these cores: it slows some trials more "
             "than others)",
             f"- the measured choice is the measured fastest: {choice.split(':')[1].split('(')[0].strip() == fastest} "
             f"({fastest})",
             f"- the same work measured twice (noise): micro-batch 4 {twins(cal['trials'])}; micro-batch 2 "
             f"{twins(cal_b['trials'])}",
             "- re-predicted vs measured, micro-batch 4, fitted on these trials: " + fmt(fitted),
             "- re-predicted vs measured, micro-batch 2, fitted on these trials: " + fmt(fitted_b),
             "- held out: micro-batch 2 trials predicted with the micro-batch 4 calibration: " + fmt(a_on_b),
             "- held out: micro-batch 4 trials predicted with the micro-batch 2 calibration: " + fmt(b_on_a), "",
             "## The plan before and after the calibration", "",
             f"`hybrid {' '.join(PLAN)}`:", "", "    " + chosen(before), "",
             f"with `--calibration {CAL.relative_to(HERE.parent)}`:", "", "    " + chosen(after), ""]
    text = "\n".join(lines)
    print(text)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main_())
