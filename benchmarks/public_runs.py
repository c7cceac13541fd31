"""Replay public GPU training runs (benchmarks/public_runs.yaml) through hybrid's estimator and
cost model, and print predicted vs published with the error.

    .venv/bin/python benchmarks/public_runs.py              # table -> benchmarks/results/public_runs.md (~5 s)
    .venv/bin/python benchmarks/public_runs.py --calibrate  # also fit the per-GPU efficiency and the
                                                            # expandable-segments headroom, and say
                                                            # what hybrid/config/cluster.py and
                                                            # hybrid/estimation/memory/breakdown.py hold

Memory: allocated (torch.cuda.max_memory_allocated) is the estimate's live tensors; reserved
(max_memory_reserved) adds the allocator headroom for the run's allocator setting. A run `fits`
when its predicted total (reserved + CUDA context) is within the GPU; it is `tight` when only
what must fit does (allocated + context + the fragmentation floor: the allocator frees its cache
and retries before it raises OOM); `OOM` otherwise.
Speed: tokens/s per GPU from the cost model at the GPU's catalogue efficiency. The efficiency is
fitted on these same points, so the table's speed errors are in-sample; the leave-one-out column
refits each GPU's figure without the point itself, which is the error to expect on a new run.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import yaml  # noqa: E402

from hybrid.families.catalogue import load_catalogue  # noqa: E402
from hybrid.config.cluster import GB, Cluster, get_gpu  # noqa: E402
from hybrid.estimation.cost.step import model_flops_per_token, step_cost  # noqa: E402
from hybrid.layout.layout import Layout  # noqa: E402
from hybrid.planning.planner import judge  # noqa: E402
from hybrid.model.presets import DecoderConfig, from_hf_config, get_preset  # noqa: E402
from hybrid.model.profile import profile_decoder  # noqa: E402
from hybrid.config.spec import TrainSpec  # noqa: E402
from hybrid.units import GiB  # noqa: E402

HERE = Path(__file__).parent
CORPUS = HERE / "public_runs.yaml"
OUT = HERE / "results" / "public_runs.md"


def model_of(m) -> tuple[str, DecoderConfig]:
    """A preset name, or a transformers config.json as a dict (read as `--model config.json` is)."""
    if isinstance(m, str):
        return m, get_preset(m)
    cfg = from_hf_config(m)
    return f"{cfg.style} h{cfg.hidden} L{cfg.layers}", cfg


class Point:
    """One corpus entry, resolved into hybrid's objects."""

    REQUIRED = ("source", "quote", "model", "gpu", "nodes", "gpus_per_node", "strategy", "micro_batch", "seq_len",
                "activation_checkpointing", "precision", "optimizer", "compile", "expandable_segments", "measured")
    """The full configuration every point states (what the source does not say is under `assumed`)."""

    def __init__(self, raw: dict):
        missing = [k for k in self.REQUIRED if k not in raw]
        if missing:
            raise ValueError(f"corpus point {raw.get('id')!r} lacks {', '.join(missing)}")
        self.raw = raw
        self.id = raw["id"]
        self.measured = raw["measured"]
        self.assumed = raw.get("assumed", {})
        self.model_name, cfg = model_of(raw["model"])
        self.profile = profile_decoder(cfg, self.model_name)
        gpu = get_gpu(raw["gpu"])
        if "network_gbps_per_gpu" in raw:
            gpu = replace(gpu, inter_node_bw=raw["network_gbps_per_gpu"] * GB / 8)
        self.cluster = Cluster(nodes=raw["nodes"], gpus_per_node=raw["gpus_per_node"], gpu=gpu,
                               expandable_segments=raw["expandable_segments"])
        self.spec = TrainSpec(micro_batch=raw["micro_batch"], seq_len=raw["seq_len"],
                              precision=raw["precision"], optimizer=raw["optimizer"],
                              activation_checkpointing=raw["activation_checkpointing"],
                              gradient_accumulation=raw.get("gradient_accumulation", 1), compile=raw["compile"],
                              float8=raw.get("float8", False))
        # a framework that reduce-scatters every micro-batch holds one micro-batch's gradients
        self.memory_spec = (replace(self.spec, gradient_accumulation=1)
                            if raw.get("grad_sync") == "every_micro_batch" else self.spec)
        self.strategy = load_catalogue()[raw["strategy"]]
        self.tp, self.pp = raw.get("tp", 1), raw.get("pp", 1)
        self.schedule = raw.get("schedule")
        self.shard = raw.get("shard_size")

    @property
    def published_tps(self) -> float | None:
        m = self.measured
        if "tokens_per_s_per_gpu" in m:
            return m["tokens_per_s_per_gpu"]
        if "tflops_per_gpu" in m:
            return m["tflops_per_gpu"] * 1e12 / model_flops_per_token(self.profile, self.spec.seq_len)
        if "megatron_tflops_per_gpu" in m:       # the Megatron-LM paper's Eq. 3, per token
            d, s = self.profile.decoder, self.spec.seq_len
            per_token = 96 * d.layers * d.hidden ** 2 * (1 + s / (6 * d.hidden) + d.vocab / (16 * d.layers * d.hidden))
            return m["megatron_tflops_per_gpu"] * 1e12 / per_token
        return None

    def candidate(self, efficiency=None):
        """The estimate (at memory_spec) with the cost of the published step (at spec)."""
        layout = Layout.of(self.strategy, self.cluster, self.memory_spec, shard_size=self.shard, tp=self.tp,
                           pp=self.pp, schedule=self.schedule)
        c = judge(layout, self.profile, self.memory_spec, self.cluster, None, efficiency)
        if self.memory_spec is self.spec or c.memory is None:
            return c
        return replace(c, cost=step_cost(replace(c.layout, ac=self.spec.activation_checkpointing,
                                                 compile=self.spec.compile, float8=self.spec.float8),
                                         self.profile, self.spec, self.cluster, efficiency))

    def tokens_per_s(self, efficiency: float, cand) -> float:
        layout = replace(cand.layout, ac=self.spec.activation_checkpointing, compile=self.spec.compile,
                         float8=self.spec.float8)
        return step_cost(layout, self.profile, self.spec, self.cluster, efficiency).tokens_per_s_per_gpu

    def efficiency_to_match(self, cand) -> float:
        """The efficiency at which the cost model gives the published tokens/s (bisection: tokens/s
        rises with efficiency)."""
        lo, hi, want = 0.01, 1.0, self.published_tps
        for _ in range(50):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if self.tokens_per_s(mid, cand) < want else (lo, mid)
        return (lo + hi) / 2


def load(path=CORPUS) -> tuple[dict, list[Point]]:
    data = yaml.safe_load(Path(path).read_text())
    return data["sources"], [Point(p) for p in data["points"]]


def fit(points: list[Point]):
    """The candidate of each point, the efficiency that reproduces each point's tokens/s, the
    point ids per GPU type, and loo(point): its tokens/s at the median efficiency of the other
    points of its GPU type (None where it has none)."""
    cands = {p.id: p.candidate() for p in points}
    need = {p.id: p.efficiency_to_match(cands[p.id]) for p in points
            if p.published_tps and p.raw.get("calibrate", True)}
    by_gpu: dict[str, list[str]] = {}
    for p in points:
        if p.id in need:
            by_gpu.setdefault(p.cluster.gpu.name, []).append(p.id)

    def loo(p: Point) -> float | None:
        others = [need[i] for i in by_gpu[p.cluster.gpu.name] if i != p.id]
        return p.tokens_per_s(statistics.median(others), cands[p.id]) if others else None
    return cands, need, by_gpu, loo


def leave_one_out_errors(points: list[Point] | None = None) -> list[float]:
    """Relative tokens/s errors (predicted - published) / published of every point with a
    leave-one-out figure: what the speed model misses on a run it was not fitted on."""
    points = load()[1] if points is None else points
    cands, need, by_gpu, loo = fit(points)
    out = []
    for p in points:
        lv = loo(p) if p.id in need else None
        if lv is not None:
            out.append((lv - p.published_tps) / p.published_tps)
    return out


def model_error(points: list[Point] | None = None) -> float:
    """The median |leave-one-out error| of tokens/s: hybrid/estimation/calibration.py's MODEL_ERROR."""
    return statistics.median(abs(e) for e in leave_one_out_errors(points))


def pct(pred: float, pub: float) -> str:
    return f"{100 * (pred - pub) / pub:+.1f}%"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", action="store_true", help="fit and print the per-GPU efficiency and headroom")
    ap.add_argument("--corpus", default=str(CORPUS))
    args = ap.parse_args(argv)
    sources, points = load(args.corpus)
    cands, need, by_gpu, loo = fit(points)

    rows = ["| point | model | GPUs | layout | allocated pred / pub | reserved pred / pub | fits pred / pub "
            "| tokens/s pred / pub | leave-one-out |",
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    mem_err, res_err, tps_err, loo_err, verdicts, tight, margins = [], [], [], [], [], 0, []
    for p in points:
        c, m = cands[p.id], cands[p.id].memory
        meas = p.measured
        cl = p.cluster
        alloc = res = fits = tps = lo = ""
        if "allocated_gib" in meas:
            mem_err.append((m.allocated / GiB - meas["allocated_gib"]) / meas["allocated_gib"])
            alloc = (f"{m.allocated / GiB:.1f} / {meas['allocated_gib']:.1f} "
                     f"({pct(m.allocated / GiB, meas['allocated_gib'])})")
        if "reserved_gib" in meas:
            res_err.append((m.reserved / GiB - meas["reserved_gib"]) / meas["reserved_gib"])
            res = f"{m.reserved / GiB:.1f} / {meas['reserved_gib']:.1f} ({pct(m.reserved / GiB, meas['reserved_gib'])})"
        if "fits" in meas:
            judged = "activation_checkpointing" not in p.assumed or "fits verdict" not in str(p.assumed)
            mark = "" if judged else " (not judged)"
            if judged:
                verdicts.append(c.fits == meas["fits"])
                tight += c.tight
                if meas["fits"]:       # room a run that trained had for the floor, as predicted
                    margins.append((p.id, cl.capacity_bytes - m.allocated - m.context, m.floor))
            fits = (f"{c.verdict} ({m.total / GiB:.1f}; needs {m.needed / GiB:.1f}; alloc {m.allocated / GiB:.1f}) / "
                    f"{'fits' if meas['fits'] else 'OOM'}{mark}")
        if p.published_tps:
            pred = c.cost.tokens_per_s_per_gpu
            tps_err.append((pred - p.published_tps) / p.published_tps)
            tps = f"{pred:,.0f} / {p.published_tps:,.0f} ({pct(pred, p.published_tps)})"
            lv = loo(p) if p.id in need else None
            if lv is not None:
                loo_err.append((lv - p.published_tps) / p.published_tps)
                lo = pct(lv, p.published_tps)
        layout = (c.label if hasattr(c, "label") else c.name) + ("+compile" if p.spec.compile else "") + (
            "+float8" if p.spec.float8 else "")
        rows.append(f"| {p.id} | {p.model_name} | {cl.world_size} x {cl.gpu.name} | {layout} | {alloc} | {res} "
                    f"| {fits} | {tps} | {lo} |")

    def summary(name, errs):
        if not errs:
            return f"- {name}: no points"
        a = sorted(abs(e) for e in errs)
        return (f"- {name}: {len(errs)} points, median |error| {100 * statistics.median(a):.1f}%, "
                f"max {100 * a[-1]:.1f}%, within 10%: {sum(x <= 0.10 for x in a)}, within 15%: "
                f"{sum(x <= 0.15 for x in a)}")

    lines = ["# Public GPU runs replayed through hybrid", "",
             f"`.venv/bin/python benchmarks/public_runs.py`: {len(points)} points from {len(sources)} sources "
             "(benchmarks/public_runs.yaml, each with its URL and the words it quotes).", "",
             "Memory in GiB. The fits column gives the verdict (fits / tight / OOM), the predicted total "
             "(reserved + CUDA context), what must fit (allocated + context + fragmentation floor) and the "
             "allocated part. Speed in tokens/s per GPU at the GPU's "
             "catalogue efficiency, which is fitted on these points (in-sample); the leave-one-out column "
             "refits it without the point.", "",
             *rows, "",
             "## Summary", "",
             summary("allocated", mem_err), summary("reserved", res_err),
             f"- fits/OOM verdicts: {sum(verdicts)} of {len(verdicts)} reproduced (a run that trained as fits or "
             f"tight, a published OOM as OOM); {tight} of them tight (they fit only when the allocator frees its "
             f"cache)",
             summary("tokens/s (in-sample)", tps_err), summary("tokens/s (leave-one-out)", loo_err), "",
             "## Sources", "",
             *[f"- **{k}**: [{v['title']}]({v['url']}). {v.get('hardware', '')} {v.get('allocator', '')}".rstrip()
               for k, v in sources.items()]]
    if args.calibrate:
        lines += ["", "## Calibration", "",
                  "Efficiency that reproduces each point's tokens/s, and the median per GPU type (what "
                  "hybrid/config/cluster.py holds):", ""]
        for gpu, ids in by_gpu.items():
            vals = [need[i] for i in ids]
            lines.append(f"- {gpu}: median {statistics.median(vals):.3f} "
                         f"(catalogue {get_gpu(gpu).efficiency}); points " +
                         ", ".join(f"{i} {need[i]:.3f}" for i in ids))
        pairs = [(p.measured["allocated_gib"], p.measured["reserved_gib"]) for p in points
                 if {"allocated_gib", "reserved_gib"} <= set(p.measured) and not p.cluster.expandable_segments]
        if pairs:
            lines.append("- headroom without expandable segments (published reserved / allocated - 1): "
                         + ", ".join(f"{r / a - 1:.3f}" for a, r in pairs)
                         + f"; mean {statistics.mean(r / a - 1 for a, r in pairs):.3f}")
        lines.append("- fragmentation floor against the room each run that trained had beside its predicted "
                     "allocated memory and context (capacity - allocated - context; the floor must not exceed it): "
                     + ", ".join(f"{i} {r / GiB:.2f} / {f / GiB:.2f} GiB" for i, r, f in
                                 sorted(margins, key=lambda t: t[1])[:4]) + " (the tightest four)")
        es = [p.measured["reserved_gib"] * GiB / cands[p.id].memory.allocated - 1 for p in points
              if "reserved_gib" in p.measured and p.cluster.expandable_segments]
        if es:
            lines.append("- headroom with expandable segments (published reserved / our allocated - 1): "
                         + ", ".join(f"{x:.3f}" for x in es) + f"; median {statistics.median(es):.3f}")
    text = "\n".join(lines) + "\n"
    print(text)
    OUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
