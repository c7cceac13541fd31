"""Least squares of a cost model's figures against measured step times (pure): what a calibration
(hybrid/estimation/calibration.py) fits. Step times are linear in each figure's cost per unit of work, so
each figure's regressor is the step time's slope in it (the cost model's counts of FLOPs, bytes,
collective calls, tensors)."""
from __future__ import annotations

import itertools
import math
from dataclasses import replace

ADDITIVE = ("intra_node_latency", "inter_node_latency", "collective_overhead", "tensor_overhead")
"""Figures that are seconds per event (the others are rates)."""
BOUND = 1000.0
"""A fitted rate stays within this factor of the catalogue's: one the trials barely constrain
(a term too small to matter in every trial) would otherwise drift without bound. Host times stay
between 0 and the longest measured step."""


def _unit(key: str, v: float) -> float:
    """The figure as a cost per unit of work, which step times are (nearly) linear in: seconds
    per call, tensor or log2(n) step for the additive figures, 1 / rate for the others."""
    return v if key in ADDITIVE else 1.0 / v


def _value(key: str, u: float) -> float:
    return u if key in ADDITIVE else 1.0 / u


def fit(predict, cluster, measured: list[float], names: tuple[str, ...],
        iterations: int = 8) -> tuple[dict, list[float]]:
    """The GPU figures among `names` that best explain the measured step times, where
    predict(cluster) returns the predicted ones. Step times are linear in each figure's cost per
    unit of work (_unit: 1 / efficiency per FLOP, 1 / bandwidth per byte, seconds per collective
    call or tensor), with the counts the cost model prices as regressors (its derivatives; exact
    where no overlap is modelled, as on CPU ranks, else refined by Gauss-Newton steps). Least
    squares of the relative errors, each figure kept in range (rates within BOUND x the
    catalogue's, efficiency <= 1 on GPUs, host times >= 0). Which figures: efficiency always (the
    compute is most of every step; no other figure may stand in for it), and with it the subset
    with the lowest small-sample Akaike criterion (AICc, Hurvich & Tsai 1989) of at most n - 2
    figures for n trials (one for n <= 2), so a figure is fitted only when it explains more than
    it costs.
    Returns ({figure: value}, the re-predicted times); the other figures keep their value."""
    n = len(measured)
    u = {k: _unit(k, getattr(cluster.gpu, k)) for k in names}
    top = max(measured)
    lo = {k: 0.0 if k in ADDITIVE else u[k] / BOUND for k in names}
    hi = {k: top if k in ADDITIVE else u[k] * BOUND for k in names}
    if "efficiency" in names and cluster.gpu.is_cuda:
        lo["efficiency"] = max(lo["efficiency"], 1.0)            # at most the peak

    def at(units: dict) -> list[float]:
        gpu = replace(cluster.gpu, **{k: _value(k, v) for k, v in units.items()})
        return predict(replace(cluster, gpu=gpu))

    def linearise(units: dict):
        base = at(units)
        cols = {}
        for k in names:
            du = 1e-3 * units[k] if units[k] > 0 else 1e-6 * top
            moved = at({**units, k: units[k] + du})
            cols[k] = [(a - b) / du for a, b in zip(moved, base)]
        return base, cols

    base, cols = linearise(u)
    # a figure the predictions do not depend on is not fitted
    cand = [k for k in names if any(abs(c) * max(u[k], 1e-6 * top) > 1e-9 * m for c, m in zip(cols[k], measured))]
    kmax = 1 if n <= 2 else n - 2
    first = cand[:1] if cand and cand[0] == "efficiency" else []     # compute is most of every step
    rest = cand[len(first):]
    best = None
    for size in range(1, min(kmax, len(cand)) + 1):
        for more in itertools.combinations(rest, size - len(first)):
            keys = (*first, *more)
            x, sse = _bounded_lsq(keys, u, base, cols, measured, lo, hi)
            if x is None:
                continue
            score = _aicc(sse, n, size)
            if best is None or score < best[0] - 1e-9:
                best = (score, keys, x)
    if best is None:
        return {}, base
    keys = best[1]
    for _ in range(iterations):         # Gauss-Newton: re-linearise where overlap makes it bend
        new = {**u, **dict(zip(keys, best[2]))}
        if all(abs(new[k] - u[k]) <= 1e-9 * max(abs(u[k]), 1e-12) for k in keys):
            break
        u = new
        base, cols = linearise(u)
        x, _ = _bounded_lsq(keys, u, base, cols, measured, lo, hi)
        if x is None:
            break
        best = (best[0], keys, x)
    u = {**u, **dict(zip(keys, best[2]))}
    return {k: _value(k, u[k]) for k in keys}, at(u)


def _aicc(sse: float, n: int, k: int) -> float:
    """Small-sample Akaike criterion of a least-squares fit (Hurvich & Tsai 1989); a relative error
    below 1e-6 counts as none, so exact fits compare by their number of figures."""
    rss = max(sse, n * 1e-12)
    dof = n - k - 1
    return n * math.log(rss / n) + 2 * k + (2 * k * (k + 1) / dof if dof > 0 else 0.0)


def _bounded_lsq(keys, u, base, cols, measured, lo, hi):
    """min sum(((t + X (x - u)) - m) / m)^2 over the figures `keys` with lo <= x <= hi: the
    unconstrained solution if it is in range, else the best of those with some figures at a bound
    (every combination: a few figures). Returns (x, sum of squares) or (None, inf)."""
    rows = []
    for i, (t, m) in enumerate(zip(base, measured)):
        a = [cols[k][i] / m for k in keys]
        rows.append((a, (m - t) / m + sum(aj * u[k] for aj, k in zip(a, keys))))

    def solve(free, fixed):
        A = [[sum(r[0][i] * r[0][j] for r in rows) for j in free] for i in free]
        b = [sum(r[0][i] * (r[1] - sum(r[0][f] * v for f, v in fixed.items())) for r in rows) for i in free]
        if free and min(abs(A[i][i]) for i in range(len(free))) == 0:
            return None
        sol = _solve(A, b) if free else []
        x = dict(fixed)
        x.update(zip(free, sol))
        return [x[i] for i in range(len(keys))]

    def sse(x):
        return sum((r[1] - sum(a * v for a, v in zip(r[0], x))) ** 2 for r in rows)

    def inside(x):
        return x is not None and all(lo[k] * (1 - 1e-9) <= v <= hi[k] * (1 + 1e-9) for k, v in zip(keys, x))

    idx = list(range(len(keys)))
    x = solve(idx, {})
    if inside(x):
        return x, sse(x)
    best = (None, math.inf)
    for states in itertools.product((0, 1, 2), repeat=len(keys)):
        if not any(states):
            continue
        fixed = {i: (lo if s == 1 else hi)[keys[i]] for i, s in enumerate(states) if s}
        x = solve([i for i in idx if not states[i]], fixed)
        if inside(x) and sse(x) < best[1]:
            best = (x, sse(x))
    return best


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
