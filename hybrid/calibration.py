"""The model's own error, and calibration files: the speed figures of a user's cluster fitted from
measured trials (`hybrid tune --save-calibration cal.yaml`), read back by `hybrid plan|estimate
--calibration`, HYBRID_CALIBRATION and auto_wrap (pure: no torch).

What is fitted: the cost model (hybrid/cost.py) prices a step as compute at `efficiency` x the
GPU's peak, collectives at the link bandwidths and per-collective latencies (intra_node_*;
inter_node_* when the trials span nodes) and buffer copies and the optimizer step at the device
memory bandwidth (mem_bw). Each figure is scaled by a factor, and the factors minimise the squared
log-ratio of re-predicted to measured step times over the trials (Levenberg-Marquardt on a
finite-difference Jacobian). A figure none of the trials' predictions depends on is not fitted
and keeps its catalogue value; n trials fit at most n - 1 figures, in the order of FIGURES.
"""
from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass, field, replace

import yaml

from .errors import HybridError

MODEL_ERROR = 0.071
"""Median |leave-one-out error| of predicted tokens/s per GPU on the public-runs corpus, as
`.venv/bin/python benchmarks/public_runs.py` prints it ("tokens/s (leave-one-out): ... median
|error| 7.1%"); tests/test_calibration.py recomputes it. Layouts predicted closer than this are
a tie the planner breaks by simplicity."""
ENV = "HYBRID_CALIBRATION"
"""The variable naming a calibration file when no --calibration / calibration= is given."""
FIGURES = ("efficiency", "intra_node_bw", "intra_node_latency", "inter_node_bw", "inter_node_latency", "mem_bw")
"""The GPUSpec speed figures a calibration may fit (hybrid/cluster.py documents each), in the
order they are fitted when the trials are too few for all of them."""
VERSION = 1
BOUND = 1000.0
"""A fitted figure stays within this factor of the catalogue's: one the trials barely constrain
(a term too small to matter in every trial) would otherwise drift without bound."""


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
        d["trials"] = [asdict(t) for t in self.trials]
        return {"version": VERSION, **d}


def _fmt(key: str, v: float) -> str:
    if key == "efficiency":
        return f"{v:.3g}"
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


def load(path: str) -> Calibration:
    """Read and check a calibration file; every problem is one line naming the file and the key."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise HybridError(f"calibration file {path!r} does not exist (write one with hybrid tune "
                          "--save-calibration)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HybridError(f"cannot read calibration file {path!r}: {e}") from None
    except yaml.YAMLError as e:
        raise HybridError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise HybridError(f"{path}: a calibration file is a mapping (hybrid tune --save-calibration writes one), "
                          f"got {type(data).__name__}")
    want = {"version", "gpu", *FIGURES, "memory_ratio", "error", "fitted", "trials", "job"}
    unknown = sorted(set(map(str, data)) - want)
    if unknown:
        raise HybridError(f"{path}: unknown key {unknown[0]!r}. Allowed: {', '.join(sorted(want))}")
    missing = sorted(want - set(data))
    if missing:
        raise HybridError(f"{path}: missing key {missing[0]!r} (hybrid tune --save-calibration writes every key)")
    if data["version"] != VERSION:
        raise HybridError(f"{path}: version {data['version']!r} is not {VERSION}; re-run hybrid tune")
    if not isinstance(data["gpu"], str) or not data["gpu"]:
        raise HybridError(f"{path}: gpu must be a GPU name, got {data['gpu']!r}")
    for key in (*FIGURES, "memory_ratio"):
        _number(path, key, data[key], positive=True)
    if data["efficiency"] > 1 and data["gpu"] != "cpu":     # CPU ranks: relative to cpu_spec's assumed peak
        raise HybridError(f"{path}: efficiency must be in (0, 1], got {data['efficiency']!r}")
    _number(path, "error", data["error"])
    fitted = data["fitted"]
    if not isinstance(fitted, list) or any(f not in FIGURES for f in fitted):
        raise HybridError(f"{path}: fitted must be a list of {', '.join(FIGURES)}, got {fitted!r}")
    if not isinstance(data["job"], dict):
        raise HybridError(f"{path}: job must be a mapping, got {data['job']!r}")
    trials = data["trials"]
    if not isinstance(trials, list) or not trials:
        raise HybridError(f"{path}: trials must be a non-empty list of the measured layouts, got {trials!r}")
    out = []
    for i, t in enumerate(trials):
        if not isinstance(t, dict) or set(t) != set(_TRIAL_TYPES):
            raise HybridError(f"{path}: trials[{i}] must have exactly the keys {', '.join(_TRIAL_TYPES)}")
        for k, typ in _TRIAL_TYPES.items():
            if typ is str:
                if not isinstance(t[k], str):
                    raise HybridError(f"{path}: trials[{i}].{k} must be a string, got {t[k]!r}")
            else:
                _number(f"{path}: trials[{i}]", k, t[k], positive=True)
                if typ is int and not isinstance(t[k], int):
                    raise HybridError(f"{path}: trials[{i}].{k} must be a whole number, got {t[k]!r}")
        out.append(Trial(**{k: t[k] if typ is str else typ(t[k]) for k, typ in _TRIAL_TYPES.items()}))
    return Calibration(data["gpu"], *(float(data[k]) for k in FIGURES), float(data["memory_ratio"]),
                       float(data["error"]), tuple(fitted), tuple(out), data["job"], path)


def _number(where: str, key: str, v, positive: bool = False) -> None:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
            or (positive and v <= 0):
        rule = "a positive number" if positive else "a number >= 0"
        raise HybridError(f"{where}: {key} must be {rule}, got {v!r}")


def resolve(path: str | None, environ=os.environ) -> Calibration | None:
    """The calibration named by `path`, else by HYBRID_CALIBRATION, else None."""
    path = path or environ.get(ENV) or None
    return load(path) if path else None


def fit(predict, cluster, measured: list[float], names=FIGURES, iterations: int = 60) -> tuple[dict, list[float]]:
    """Scale factors for the GPU figures `names` minimising sum(log(predict(c) / measured)^2),
    where predict(cluster) returns the predicted step times. Returns ({figure: value}, the
    re-predicted times); figures the predictions do not depend on keep their value, and with n
    trials at most n - 1 figures are fitted (the first of `names` that matter)."""
    base = {k: getattr(cluster.gpu, k) for k in names}

    def at(logs: list[float], keys) -> list[float]:
        gpu = replace(cluster.gpu, **{k: base[k] * math.exp(x) for k, x in zip(keys, logs)})
        if gpu.efficiency > 1 and gpu.is_cuda:
            gpu = replace(gpu, efficiency=1.0)
        return predict(replace(cluster, gpu=gpu))

    def residuals(logs, keys):
        return [math.log(p / m) for p, m in zip(at(logs, keys), measured)]

    h = 1e-3
    zero = residuals([0.0] * len(names), names)
    keys = []
    for i, k in enumerate(names):          # a figure moves the predictions, or it is not fitted
        step = [h if j == i else 0.0 for j in range(len(names))]
        if max(abs(a - b) for a, b in zip(residuals(step, names), zero)) > 1e-6:
            keys.append(k)
    keys = keys[:max(1, len(measured) - 1)]  # one degree of freedom left, so the error means something
    x, lam = [0.0] * len(keys), 1e-3
    r = residuals(x, keys) if keys else zero
    cost = sum(v * v for v in r)
    for _ in range(iterations if keys else 0):
        J = []
        for i in range(len(keys)):
            xi = list(x)
            xi[i] += h
            J.append([(a - b) / h for a, b in zip(residuals(xi, keys), r)])
        n = len(keys)
        A = [[sum(J[i][t] * J[j][t] for t in range(len(r))) + (lam if i == j else 0.0) for j in range(n)]
             for i in range(n)]
        g = [-sum(J[i][t] * r[t] for t in range(len(r))) for i in range(n)]
        dx = _solve(A, g)
        trial = [max(-math.log(BOUND), min(math.log(BOUND), a + b)) for a, b in zip(x, dx)]
        rt = residuals(trial, keys)
        ct = sum(v * v for v in rt)
        if ct < cost:
            x, r, lam = trial, rt, lam / 3
            if cost - ct < 1e-12:
                cost = ct
                break
            cost = ct
        else:
            lam *= 10
    values = {k: base[k] * math.exp(v) for k, v in zip(keys, x)}
    if values.get("efficiency", 0) > 1 and cluster.gpu.is_cuda:
        values["efficiency"] = 1.0
    return values, at(x, keys) if keys else predict(cluster)


def _solve(A: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (the few-by-few normal equations)."""
    n = len(b)
    M = [row[:] + [b[i]] for i, row in enumerate(A)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        M[c], M[p] = M[p], M[c]
        if abs(M[c][c]) < 1e-300:
            continue
        for r in range(c + 1, n):
            f = M[r][c] / M[c][c]
            M[r] = [a - f * bb for a, bb in zip(M[r], M[c])]
    x = [0.0] * n
    for c in reversed(range(n)):
        s = M[c][n] - sum(M[c][j] * x[j] for j in range(c + 1, n))
        x[c] = s / M[c][c] if abs(M[c][c]) > 1e-300 else 0.0
    return x


def predict(cands, profile, cluster) -> list[float]:
    """The cost model's step time of each candidate on `cluster` (its GPU's figures)."""
    from .cost import step_cost
    return [step_cost(c.layout, profile, c.spec, cluster).seconds
            for c in cands]


def calibrate(cands, profile, cluster, measured_s: list[float], measured_bytes: list[int],
              job: dict | None = None) -> Calibration:
    """Fit the cluster's speed figures to the measured step times of `cands` (planner
    Candidates, all run on `cluster`) and keep the memory ratio, with the trials."""
    if not cands or len(cands) != len(measured_s) or len(cands) != len(measured_bytes):
        raise HybridError("a calibration needs at least one measured trial (none of the trials ran)")
    before = predict(cands, profile, cluster)
    values, after = fit(lambda cl: predict(cands, profile, cl), cluster, measured_s)
    g = replace(cluster.gpu, **values)
    ratios = sorted(m / c.memory.allocated for c, m in zip(cands, measured_bytes) if c.memory and c.memory.allocated)
    trials = tuple(Trial(c.label, c.shard_size, p, m, a, int(c.memory.allocated if c.memory else 0), int(b))
                   for c, p, m, a, b in zip(cands, before, measured_s, after, measured_bytes))
    error = max(abs(a - m) / m for a, m in zip(after, measured_s))
    return Calibration(cluster.gpu.name, *(getattr(g, k) for k in FIGURES),
                       ratios[len(ratios) // 2] if ratios else 1.0, error, tuple(values), trials, job or {})
