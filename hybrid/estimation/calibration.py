"""The model's own error, and calibration files: the speed figures of a user's cluster fitted from
measured trials (`hybrid tune --save-calibration cal.yaml`), read back by `hybrid plan|estimate
--calibration`, HYBRID_CALIBRATION and auto_wrap (pure: no torch).

What is fitted: the cost model (hybrid/estimation/cost/step.py) prices a step as compute at `efficiency` x the
GPU's peak, collectives at the link bandwidths and per-collective latencies (intra_node_*;
inter_node_* when the trials span nodes), buffer copies and the optimizer step at the device
memory bandwidth (mem_bw), and the host work the frameworks do per collective call and per
parameter tensor (collective_overhead, tensor_overhead; hybrid/families/host.py counts both). Step
times are linear in each figure's cost per unit of work, so the figures are a least-squares fit of
the relative errors over the trials with the cost model's counts as regressors (`fit`); which
figures are fitted is chosen by the small-sample Akaike criterion, a figure none of the trials'
predictions depends on is not fitted, and the others keep their catalogue value.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

import yaml

from ..config.files import read_yaml
from ..errors import HybridError, short
from .fitting import ADDITIVE, fit

MODEL_ERROR = 0.066
"""Median |leave-one-out error| of predicted tokens/s per GPU on the public-runs corpus, as
`.venv/bin/python benchmarks/public_runs.py` prints it ("tokens/s (leave-one-out): ... median
|error| 7.1%"); tests/estimation/test_calibration.py recomputes it. Layouts predicted closer than this are
a tie the planner breaks by simplicity."""
ENV = "HYBRID_CALIBRATION"
"""The variable naming a calibration file when no --calibration / calibration= is given."""
FIGURES = ("efficiency", "intra_node_bw", "intra_node_latency", "inter_node_bw", "inter_node_latency", "mem_bw",
           "collective_overhead", "tensor_overhead")
"""The GPUSpec speed figures a calibration may fit (hybrid/config/cluster.py documents each); of fits
that explain the trials equally well, the one with the earlier figures wins."""
FITTED = ("efficiency", "intra_node_bw", "inter_node_bw", "mem_bw", "collective_overhead", "tensor_overhead")
"""What `calibrate` fits. Not the link latencies: the comm model counts one per unit where the
libraries launch one per bucket or tensor, and collective_overhead is the per-call time with the
calls counted as launched (hybrid/families/host.py); they keep the nccl-tests figures
(hybrid/estimation/cost/links.py)."""
HOST = ("collective_overhead", "tensor_overhead")
"""Added in version 2; a version 1 file has neither (0: no host term), nor the trials' counts."""
VERSION = 2
RANGES = {"efficiency": (1e-3, 1e3), "intra_node_bw": (1e6, 1e15), "inter_node_bw": (1e6, 1e15), "mem_bw": (1e6, 1e15),
          "intra_node_latency": (0.0, 1.0), "inter_node_latency": (0.0, 1.0), "collective_overhead": (0.0, 1.0),
          "tensor_overhead": (0.0, 1.0), "memory_ratio": (0.0, 1e6), "error": (0.0, 1e3),
          "shard_size": (1, 10**9), "predicted_s": (1e-9, 1e6), "measured_s": (1e-9, 1e6), "repredicted_s": (1e-9, 1e6),
          "predicted_bytes": (1, 2**60), "measured_bytes": (1, 2**60), "calls": (0.0, 1e12), "tensors": (0.0, 1e12)}
"""Inclusive range of each number a calibration file holds (bytes/s, seconds, ratios; efficiency
above 1 only on CPU ranks), far around anything measured, so no figure can overflow or divide by
zero in the cost model (mem_bw 5e-324, collective_overhead 1e308)."""
@dataclass(frozen=True)
class Trial:
    """One measured layout of the trials a calibration came from."""

    layout: str
    shard_size: int
    predicted_s: float
    """Step time the catalogue figures predicted, seconds."""
    measured_s: float
    """Measured step time (slowest rank, mean over the timed steps), seconds."""
    repredicted_s: float
    """Step time predicted with the fitted figures, seconds."""
    predicted_bytes: int
    """Analytic allocated peak per rank, bytes."""
    measured_bytes: int
    """Measured allocated peak (CUDA max_memory_allocated, or tracked live tensors on CPU), bytes."""
    calls: float | None = None
    """Collective calls per step the cost model counts for it (hybrid/families/host.py); None in a
    version 1 file."""
    tensors: float | None = None
    """Per-parameter-tensor host operations per step it counts; None in a version 1 file."""

    @property
    def residual(self) -> float:
        """Re-predicted / measured - 1."""
        return self.repredicted_s / self.measured_s - 1


@dataclass(frozen=True)
class Calibration:
    """A cluster's measured speed figures and memory ratio, with the trials they came from."""

    gpu: str
    """The accelerator the trials ran on (GPUSpec.name); plans for another are refused."""
    efficiency: float
    """Fraction of the dense peak FLOP/s reached (replaces GPUSpec.efficiency); on CPU ranks
    relative to cluster.cpu_spec's assumed peak, so it may exceed 1."""
    intra_node_bw: float
    """Bytes/s per GPU per direction inside a node."""
    intra_node_latency: float
    """Seconds per log2(n) step of a collective inside a node (gloo on CPU ranks: also the Python
    around each collective, which the cost model has no other term for)."""
    inter_node_bw: float
    """Bytes/s per GPU per direction across nodes."""
    inter_node_latency: float
    """Seconds per log2(n) step of a collective across nodes."""
    mem_bw: float
    """Device memory bytes/s (buffer copies, the optimizer step)."""
    collective_overhead: float
    """Host seconds per collective call (0 where not fitted: the catalogue's)."""
    tensor_overhead: float
    """Host seconds per per-parameter-tensor operation (0 where not fitted)."""
    memory_ratio: float
    """Measured / predicted allocated peak, median over the trials (reported; not applied)."""
    error: float
    """Largest |re-predicted - measured| / measured over the trials: the tie band of plans made with it."""
    fitted: tuple[str, ...]
    """Which of FIGURES were fitted; the others are the catalogue's."""
    trials: tuple[Trial, ...]
    job: dict = field(default_factory=dict)
    """What was run: model, nodes, gpus_per_node, micro_batch, seq_len, precision, steps."""
    path: str = ""
    """The file it was read from (not written)."""

    @property
    def tie(self) -> float:
        """The tie band of plans made with it: its error where the trials outnumber the fitted
        figures (the residuals say something), else the corpus's MODEL_ERROR."""
        return self.error if len(self.trials) > len(self.fitted) else MODEL_ERROR

    def apply(self, cluster):
        """The cluster with the fitted figures in place of the catalogue's."""
        if cluster.gpu.name != self.gpu:
            raise HybridError(f"calibration {self.path or ''} was measured on {self.gpu!r} but this plan is for "
                              f"{cluster.gpu.name!r}: plan for {self.gpu}, or calibrate on this GPU with hybrid tune")
        return replace(cluster, gpu=replace(cluster.gpu, **{k: getattr(self, k) for k in FIGURES}))

    def describe(self) -> str:
        fit = ", ".join(f"{k} {_fmt(k, getattr(self, k))}" for k in self.fitted) or "nothing fitted"
        return (f"calibrated by {self.path or 'hybrid tune'} on {len(self.trials)} trials ({fit}; measured memory "
                f"{self.memory_ratio:.2f}x predicted, not applied); ties within {self.tie:.1%}")

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("path")
        d["fitted"] = list(self.fitted)
        d["trials"] = [{**asdict(t), "residual": t.residual} for t in self.trials]
        return {"version": VERSION, **d}


def _fmt(key: str, v: float) -> str:
    if key == "efficiency":
        return f"{v:.3g}"
    if key in HOST:
        return f"{v * 1e3:.3g} ms per {'call' if key == 'collective_overhead' else 'tensor'}"
    return f"{v * 1e6:.3g} us" if key.endswith("latency") else f"{v / 1e9:.3g} GB/s"


def save(cal: Calibration, path: str) -> None:
    try:
        with open(path, "w", encoding="utf-8") as f:
            f.write("# hybrid calibration (hybrid tune --save-calibration); read by hybrid plan|estimate "
                    "--calibration FILE, HYBRID_CALIBRATION=FILE and auto_wrap(calibration=FILE)\n")
            yaml.safe_dump(cal.to_dict(), f, sort_keys=False)
    except OSError as e:
        raise HybridError(f"cannot write --save-calibration {path!r}: {e.strerror or e}") from None


_TRIAL_TYPES = {"layout": str, "shard_size": int, "predicted_s": float, "measured_s": float,
                "repredicted_s": float, "predicted_bytes": int, "measured_bytes": int}
_TRIAL_V2 = {"calls": float, "tensors": float, "residual": float}


def load(path: str) -> Calibration:
    """Read and check a calibration file; every problem is one line naming the file and the key."""
    if not os.path.lexists(path):
        raise HybridError(f"calibration file {str(path)[:200]!r} does not exist (write one with hybrid tune "
                          "--save-calibration)")
    data, _ = read_yaml(path, "calibration file", "hybrid tune writes a few KB")
    if not isinstance(data, dict):
        raise HybridError(f"{path}: a calibration file is a mapping (hybrid tune --save-calibration writes one), "
                          f"got {type(data).__name__}")
    version = data.get("version")
    if version not in (1, VERSION):
        raise HybridError(f"{path}: version {version!r} is not {VERSION} (or 1); re-run hybrid tune --save-calibration")
    figures = FIGURES if version == VERSION else tuple(k for k in FIGURES if k not in HOST)
    want = {"version", "gpu", *figures, "memory_ratio", "error", "fitted", "trials", "job"}
    unknown = sorted(set(map(str, data)) - want)
    if unknown:
        raise HybridError(f"{path}: unknown key {unknown[0]!r} in a version {version} file. Allowed: "
                          f"{', '.join(sorted(want))}")
    missing = sorted(want - set(data))
    if missing:
        raise HybridError(f"{path}: missing key {missing[0]!r} (hybrid tune --save-calibration writes every key)")
    data = {**{k: 0.0 for k in HOST}, **data}            # version 1: no host term
    if not isinstance(data["gpu"], str) or not data["gpu"]:
        raise HybridError(f"{path}: gpu must be a GPU name, got {short(data['gpu'])}")
    for key in (*FIGURES, "memory_ratio"):
        _number(path, key, data[key], positive=key not in ADDITIVE)
    if data["efficiency"] > 1 and data["gpu"] != "cpu":     # CPU ranks: relative to cpu_spec's assumed peak
        raise HybridError(f"{path}: efficiency must be in (0, 1], got {short(data['efficiency'])}")
    _number(path, "error", data["error"])
    fitted = data["fitted"]
    if not isinstance(fitted, list) or any(f not in figures for f in fitted):
        raise HybridError(f"{path}: fitted must be a list of {', '.join(figures)}, got {short(fitted)}")
    if not isinstance(data["job"], dict):
        raise HybridError(f"{path}: job must be a mapping, got {short(data['job'])}")
    trials = data["trials"]
    if not isinstance(trials, list) or not trials:
        raise HybridError(f"{path}: trials must be a non-empty list of the measured layouts, got {short(trials)}")
    out = []
    types = {**_TRIAL_TYPES, **(_TRIAL_V2 if version == VERSION else {})}
    for i, t in enumerate(trials):
        if not isinstance(t, dict) or set(t) != set(types):
            raise HybridError(f"{path}: trials[{i}] must have exactly the keys {', '.join(types)}")
        for k, typ in types.items():
            if typ is str:
                if not isinstance(t[k], str):
                    raise HybridError(f"{path}: trials[{i}].{k} must be a string, got {short(t[k])}")
            elif k == "residual":
                if isinstance(t[k], bool) or not isinstance(t[k], (int, float)) or not math.isfinite(t[k]):
                    raise HybridError(f"{path}: trials[{i}].residual must be a number, got {short(t[k])}")
            else:
                _number(f"{path}: trials[{i}]", k, t[k], positive=k not in _TRIAL_V2)
                if typ is int and not isinstance(t[k], int):
                    raise HybridError(f"{path}: trials[{i}].{k} must be a whole number, got {short(t[k])}")
        out.append(Trial(**{k: t[k] if typ is str else typ(t[k]) for k, typ in types.items() if k != "residual"}))
    return Calibration(data["gpu"], *(float(data[k]) for k in FIGURES), float(data["memory_ratio"]),
                       float(data["error"]), tuple(fitted), tuple(out), data["job"], path)


def _number(where: str, key: str, v, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
            or (positive and v <= 0):
        rule = "a positive number" if positive else "a number >= 0"
        raise HybridError(f"{where}: {key} must be {rule}, got {short(v)}")
    lo, hi = RANGES[key]
    if not lo <= v <= hi:
        raise HybridError(f"{where}: {key} must be in [{lo:g}, {hi:g}], got {short(v)}; no cluster measures that: "
                          "re-run hybrid tune --save-calibration")


def resolve(path: str | None, environ=os.environ) -> Calibration | None:
    """The calibration named by `path`, else by HYBRID_CALIBRATION, else None."""
    path = path or environ.get(ENV) or None
    return load(path) if path else None


def predict(cands, profile, cluster) -> list[float]:
    """The cost model's step time of each candidate on `cluster` (its GPU's figures)."""
    from .cost.step import step_cost
    return [step_cost(c.layout, profile, c.spec, cluster).seconds
            for c in cands]


def host_counts(cands, profile, cluster, key: str) -> list[float]:
    """What the cost model counts per step for each candidate (collective calls for
    collective_overhead, per-tensor operations for tensor_overhead): the step time's slope in that
    figure, which is exact (the host term is added, hybrid/estimation/cost/step.py)."""
    at = getattr(cluster.gpu, key)
    up = predict(cands, profile, replace(cluster, gpu=replace(cluster.gpu, **{key: at + 1e-3})))
    return [round((a - b) / 1e-3, 6) for a, b in zip(up, predict(cands, profile, cluster))]


def calibrate(cands, profile, cluster, measured_s: list[float], measured_bytes: list[int],
              job: dict | None = None) -> Calibration:
    """Fit the cluster's speed figures to the measured step times of `cands` (planner
    Candidates, all run on `cluster`) and keep the memory ratio, with the trials."""
    if not cands or len(cands) != len(measured_s) or len(cands) != len(measured_bytes):
        raise HybridError("a calibration needs at least one measured trial (none of the trials ran)")
    before = predict(cands, profile, cluster)
    values, after = fit(lambda cl: predict(cands, profile, cl), cluster, measured_s, FITTED)
    g = replace(cluster.gpu, **values)
    ratios = sorted(m / c.memory.allocated for c, m in zip(cands, measured_bytes) if c.memory and c.memory.allocated)
    calls, tensors = (host_counts(cands, profile, replace(cluster, gpu=g), k) for k in HOST)
    trials = tuple(Trial(c.label, c.shard_size, p, m, a, int(c.memory.allocated if c.memory else 0), int(b), n, t)
                   for c, p, m, a, b, n, t in zip(cands, before, measured_s, after, measured_bytes, calls, tensors))
    error = max(abs(a - m) / m for a, m in zip(after, measured_s))
    return Calibration(cluster.gpu.name, *(getattr(g, k) for k in FIGURES),
                       ratios[len(ratios) // 2] if ratios else 1.0, error, tuple(values), trials, job or {})
