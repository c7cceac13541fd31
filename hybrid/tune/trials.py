"""Measure, don't only predict: run the plan's best layouts for a few steps on this cluster's ranks,
choose the measured fastest, and fit a calibration of the cost model to what was measured.

Every trial trains the plan's one global batch (given, or implied as `hybrid plan` holds it:
planner.implied_batch), each layout at its own micro-batch and accumulation (its candidate's spec).
Every rank plans the same plan; rank 0 picks the trials and the winner and broadcasts them (on a
gloo side group with the job's collective timeout, so no decision waits unbounded). A trial is
`warmup` steps (the optimizer state appears in the first; the second is steady) and then `steps`
timed ones through Wrapped.train_step, the loop users run; a trial's step time is the median of
its timed steps on its slowest rank. Memory: CUDA's max_memory_allocated and
max_memory_reserved of the trial; on CPU ranks the live tensor bytes of the warm-up steps
(hybrid/measure/tracker.py), which the timed steps run without (the tracker slows dispatch). A
trial whose peak exceeds the GPU's capacity (--gpu-memory) or that raises an out-of-memory error
is OOM; any other error fails that trial only. Each trial's model, engine and optimizer are freed
before the next.
"""
from __future__ import annotations

import contextlib
import datetime
import gc
import statistics
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from ..errors import HybridError
from ..log import get_logger
from ..units import fmt_bytes

log = get_logger(__name__)


@dataclass(frozen=True)
class Trial:
    """One layout's measurement (the same on every rank)."""

    index: int
    """Position of the candidate in plan.candidates."""
    status: str
    """ok | oom | failed"""
    seconds: float | None = None
    """Median step time of the timed steps on the slowest rank."""
    allocated: int | None = None
    """Peak allocated bytes of the largest rank (tracked live tensors on CPU)."""
    reserved: int | None = None
    """Peak reserved bytes of the largest rank (CUDA only)."""
    detail: str = ""


@dataclass
class TuneResult:
    plan: object
    trials: list[Trial]
    chosen: object | None
    """The measured fastest candidate (None when no trial ran)."""
    calibration: object | None = None
    steps: int = 0
    warmup: int = 0


def select(plan, top: int) -> list[int]:
    """The trials: each strategy's best variant among those predicted to fit, fastest first, the
    first `top` of them, plus the plan's choice (the simplest within the model's error of the
    fastest); when fewer than `top` fit, the best of the rest (predicted OOM) are measured too."""
    from ..planning.report import best_per_strategy
    cands = list(plan.candidates)
    best = [c for c in best_per_strategy(plan) if c.memory is not None]
    fitting = [c for c in best if c.fits]
    picked = fitting[:top]
    if plan.chosen is not None and plan.chosen not in picked:
        picked.append(plan.chosen)
    picked += [c for c in best if not c.fits][:max(0, top - len(fitting))]
    return [cands.index(c) for c in picked]


def check_runnable(plan) -> None:
    """HybridError, one line, where no candidate of the plan can run the job at all (each row not
    applicable): the rows' reason, or each distinct one after the first layout that has it."""
    if plan.chosen is not None or any(c.memory is not None for c in plan.candidates):
        return
    why = {}
    for c in plan.candidates:
        why.setdefault(c.reason.removeprefix("not applicable: "), c.label)
    if len(why) == 1:
        raise HybridError(f"no layout can run this job: {next(iter(why))}")
    # a reason that names its layout already is not prefixed with it again
    raise HybridError("no layout can run this job: " + "; ".join(
        reason if reason.startswith(label) else f"{label}: {reason}" for reason, label in why.items()))


def tokens_per_s_per_gpu(cand, seconds: float) -> float:
    """Measured tokens/s per GPU as the cost model counts them (a tp group and a pipeline share
    their micro-batches)."""
    s = cand.spec
    return s.gradient_accumulation * s.micro_batch * s.seq_len / cand.tp / cand.pp / cand.cp / seconds


def _side_group():
    from ..runtime.mesh import _STATE, default_timeout
    timeout = _STATE["timeout"] or default_timeout(torch.cuda.is_available())
    return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def _run_one(cand, plan, make_model, optimizer, runtime, cluster, ids, steps: int, warmup: int,
             max_grad_norm, agree) -> dict:
    """One trial on this rank: {"status", "seconds", "allocated", "reserved", "detail"}. After
    the model is built (no collective yet) the ranks agree through `agree(local error or None)`
    whether every rank built it, so a rank that fails there fails the trial on every rank
    instead of leaving its peers waiting in the first collective."""
    from ..runtime.backends.base import LoopOptions
    from ..runtime.parallelize import apply_layout
    from ..measure.tracker import MemoryTracker
    from ..runtime.mesh import build_mesh
    from ..runtime.wrapped import Wrapped

    cuda = runtime.device.type == "cuda"
    tracker = None if cuda else MemoryTracker()
    w = engine = model = None
    stack = contextlib.ExitStack()
    try:
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        if tracker is not None:
            stack.enter_context(tracker)
        built = None
        try:
            model = make_model()
        except Exception as e:  # noqa: BLE001 - told to every rank below
            built = {"status": "oom" if isinstance(e, torch.OutOfMemoryError) else "failed",
                     "detail": _first_line(e)}
        peer = agree(built)
        if peer is not None:
            return peer
        mesh = build_mesh(cand.parallel, runtime, cluster.gpus_per_node, cluster.domain)
        options = LoopOptions(cand.spec.gradient_accumulation, max_grad_norm, False)
        engine = apply_layout(model, cand.layout, optimizer, mesh, cand.spec, runtime, options)
        if tracker is not None:         # the whole model built before sharding is set-up, not the job
            tracker.reset_peak()
        w = Wrapped(engine, plan, cand, mesh, runtime, cand.spec.gradient_accumulation, max_grad_norm)
        batch = ids.to(runtime.device)
        for _ in range(warmup):
            w.train_step(batch)
        stack.close()                   # the timed steps run untracked (the tracker slows dispatch)
        times = []
        for _ in range(steps):
            if cuda:
                torch.cuda.synchronize()
            start = time.perf_counter()
            w.train_step(batch)       # ends in an all-reduce of the loss: the ranks step together
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        seconds = statistics.median(times)      # robust to a step slowed by other work on the machine
        if cuda:
            return {"status": "ok", "seconds": seconds, "allocated": int(torch.cuda.max_memory_allocated()),
                    "reserved": int(torch.cuda.max_memory_reserved()), "detail": ""}
        return {"status": "ok", "seconds": seconds, "allocated": int(tracker.peak), "reserved": None, "detail": ""}
    except torch.OutOfMemoryError as e:
        return {"status": "oom", "detail": _first_line(e)}
    except Exception as e:  # noqa: BLE001 - a failed trial is reported and the others still run
        return {"status": "failed", "detail": _first_line(e)}
    finally:
        stack.close()
        del w, engine, model, tracker
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


def _agree(err: dict | None, runtime, side) -> dict | None:
    """Every rank's set-up error (None where it had none): the first one, told as that rank's."""
    if side is None:
        return err
    everyone = [None] * runtime.world_size
    dist.all_gather_object(everyone, err, group=side)
    for r, e in enumerate(everyone):
        if e is not None:
            return {"status": e["status"], "detail": e["detail"] if r == runtime.rank else
                    f"rank {r} could not build the model: {e['detail']}"}
    return None


def _merge(index: int, results: list[dict], cluster) -> Trial:
    """The ranks' results of one trial as one verdict."""
    bad = [(r, x) for r, x in enumerate(results) if x["status"] != "ok"]
    if bad:
        own = [(r, x) for r, x in bad if not x["detail"].startswith("rank ")] or bad   # the cause, not the echo
        oom = [(r, x) for r, x in own if x["status"] == "oom"]
        r, x = (oom or own)[0]
        return Trial(index, "oom" if oom else "failed", detail=f"rank {r}: {x['detail']}")
    seconds = max(x["seconds"] for x in results)
    alloc = max(x["allocated"] for x in results)
    reserved = max(x["reserved"] for x in results) if results[0]["reserved"] is not None else None
    need = (reserved if reserved is not None else alloc) + cluster.gpu.cuda_context_bytes
    if need > cluster.capacity_bytes:
        return Trial(index, "oom", seconds, alloc, reserved,
                     f"measured peak {fmt_bytes(need)} > {fmt_bytes(cluster.capacity_bytes)} per GPU")
    return Trial(index, "ok", seconds, alloc, reserved)


def synthetic_ids(profile, spec, vocab: int | None = None) -> torch.Tensor:
    """One optimizer step's token ids for a data-parallel rank (gradient_accumulation x
    micro_batch sequences), the same on every rank (ranks of a tp group must read the same)."""
    vocab = vocab or (profile.decoder.vocab if profile.decoder is not None else None)
    if vocab is None:
        raise HybridError(f"tune runs {profile.name} on synthetic token ids and needs its vocabulary: give a "
                          "decoder (preset, config.json, or a transformers model with config.vocab_size)")
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab, (spec.gradient_accumulation * spec.micro_batch, spec.seq_len), generator=g)


def tune(plan, make_model, optimizer, runtime, cluster, top: int = 3, steps: int = 5, warmup: int = 2,
         max_grad_norm=None, progress=None, fit: bool = True, job: dict | None = None) -> TuneResult:
    """Run the trials (every rank calls this with the same plan) and choose the measured fastest.
    make_model() builds a fresh model for each trial; optimizer is a factory of params."""
    check_runnable(plan)
    side = _side_group() if runtime.world_size > 1 else None
    picked = [select(plan, top) if runtime.rank == 0 else None]
    if side is not None:
        dist.broadcast_object_list(picked, src=0, group=side)
    picked = picked[0]
    if progress is not None and runtime.rank == 0:
        progress.expect(len(picked))
    trials = []
    for i in picked:
        cand = plan.candidates[i]
        if progress is not None and runtime.rank == 0:
            progress.begin(f"{cand.label} (shard {cand.shard_size})")
        ids = synthetic_ids(plan.model, cand.spec)       # this layout's micro-batch x accumulation (global batch)
        mine = _run_one(cand, plan, make_model, optimizer, runtime, cluster, ids, steps, warmup, max_grad_norm,
                        lambda err: _agree(err, runtime, side))
        everyone = [None] * runtime.world_size
        if side is not None:
            dist.all_gather_object(everyone, mine, group=side)
        else:
            everyone = [mine]
        t = _merge(i, everyone, cluster)
        trials.append(t)
        if progress is not None and runtime.rank == 0:
            progress.end(f"{t.seconds:.3f} s/step" if t.status == "ok" else f"{t.status.upper()} ({t.detail})")
    ok = [t for t in trials if t.status == "ok"]
    best = [max(ok, key=lambda t: tokens_per_s_per_gpu(plan.candidates[t.index], t.seconds)).index
            if ok and runtime.rank == 0 else None]
    if side is not None:
        dist.broadcast_object_list(best, src=0, group=side)
        dist.destroy_process_group(side)
    chosen = plan.candidates[best[0]] if best[0] is not None else None
    cal = None
    if fit and ok:
        from ..estimation.calibration import calibrate
        cands = [plan.candidates[t.index] for t in ok]
        cal = calibrate(cands, plan.model, plan.cluster, [t.seconds for t in ok], [t.allocated for t in ok], job)
    return TuneResult(plan, trials, chosen, cal, steps, warmup)


def format_tune(r: TuneResult) -> str:
    """Predicted vs measured per trial, the measured choice, and the calibration."""
    from ..estimation.calibration import _fmt
    p = r.plan
    cal = r.calibration
    again = {}
    if cal is not None:
        again = {(t.layout, t.shard_size): t.repredicted_s for t in cal.trials}
    w = max([24] + [len(p.candidates[t.index].label) + 1 for t in r.trials])
    shapes = {(p.candidates[t.index].spec.micro_batch, p.candidates[t.index].spec.gradient_accumulation)
              for t in r.trials}
    own = len(shapes) > 1           # the held global batch, each layout at its own micro-batch x accumulation
    head = (f" {'layout':<{w}}{'shard':>6}" + (f"{'batch':>9}" if own else "") + f"{'pred s':>9}{'meas s':>9}"
            f"{'error':>8}{'refit s':>9}{'pred tok/s':>12}{'meas tok/s':>12}{'pred alloc':>12}{'meas peak':>11}"
            "  result")
    mb, ga = next(iter(shapes)) if shapes else (p.spec.micro_batch, p.spec.gradient_accumulation)
    shape = (f"global batch {p.global_batch} x seq {p.spec.seq_len}, {p.spec.precision}, each layout at its own "
             "micro-batch x accumulation (batch)" if own else
             f"micro-batch {mb} x seq {p.spec.seq_len}, {p.spec.precision}, accumulation {ga}")
    lines = [f"tune {p.model.name} on {p.cluster.describe()}: {r.steps} timed steps after {r.warmup} warm-up "
             f"steps per layout; {shape}", "", head, "-" * len(head)]
    for t in r.trials:
        c = p.candidates[t.index]
        mark = "*" if r.chosen is c else " "
        pred_s, pred_tps = c.cost.seconds, c.cost.tokens_per_s_per_gpu
        alloc = fmt_bytes(c.memory.allocated) if c.memory else "-"
        row = f"{mark}{c.label:<{w}}{c.shard_size:>6}"
        if own:
            row += f"{f'{c.spec.micro_batch} x {c.spec.gradient_accumulation}':>9}"
        row += f"{pred_s:>9.4f}"
        if t.status == "ok":
            refit = again.get((c.label, c.shard_size))
            row += (f"{t.seconds:>9.4f}{pred_s / t.seconds - 1:>+8.0%}"
                    + (f"{refit:>9.4f}" if refit else f"{'':>9}")
                    + f"{pred_tps:>12,.0f}{tokens_per_s_per_gpu(c, t.seconds):>12,.0f}{alloc:>12}"
                    f"{fmt_bytes(t.reserved or t.allocated):>11}  ok")
        else:
            row += (f"{'-':>9}{'':>8}{'':>9}{pred_tps:>12,.0f}{'-':>12}{alloc:>12}{'-':>11}  "
                    f"{t.status.upper()}: {t.detail}")
        if not c.fits:
            row += " (predicted not to fit)"
        lines.append(row)
    lines.append("")
    c = r.chosen
    if c is None:
        lines.append("no trial ran to the end: nothing measured to choose from")
    else:
        t = next(t for t in r.trials if t.index == p.candidates.index(c))
        line = (f"measured choice: {c.label} ({c.parallel.describe()}): {t.seconds:.4f} s/step, "
                f"{tokens_per_s_per_gpu(c, t.seconds):,.0f} tokens/s per GPU")
        pc = p.chosen
        if pc is not None and pc is not c:
            pt = next((t for t in r.trials if t.index == p.candidates.index(pc)), None)
            line += f"; the analytic plan chose {pc.label}"
            if pt is not None and pt.status == "ok":
                line += f" (measured {pt.seconds / t.seconds - 1:.0%} slower)"
        elif pc is c:
            line += "; the analytic plan chose it too"
        lines.append(line)
    if cal is not None:
        g = p.cluster.gpu
        fitted = ", ".join(f"{k} {_fmt(k, getattr(cal, k))} (was {_fmt(k, getattr(g, k))}"
                           + ("; at the fit's bound: the trials do not constrain it" if _at_bound(cal, g, k) else "")
                           + ")" for k in cal.fitted)
        lines.append(f"calibration: {fitted or 'nothing to fit'}; measured memory {cal.memory_ratio:.2f}x the "
                     f"predicted allocated; re-predicted step times within {cal.error:.1%} of measured")
    return "\n".join(lines)



def tune_for_wrap(plan, model, optimizer, runtime, cluster, top, max_grad_norm, steps: int = 5, warmup: int = 2):
    """auto_wrap(tune=...): the trials on deep copies of `model`; the plan with the measured
    fastest as its choice (the model itself is left untouched for the wrap that follows)."""
    import copy
    import dataclasses

    if isinstance(top, bool):
        top = 3
    if not isinstance(top, int) or top < 1:
        raise HybridError(f"tune must be True, False or a positive number of layouts to measure, got {top!r}")
    r = tune(plan, lambda: copy.deepcopy(model), optimizer, runtime, cluster, top, steps, warmup, max_grad_norm,
             fit=False)
    if r.chosen is None:
        why = "; ".join(f"{plan.candidates[t.index].label}: {t.status} ({t.detail})" for t in r.trials)
        raise HybridError(f"auto_wrap(tune=...): no layout ran its trial steps: {why}")
    if runtime.rank == 0:
        log.info("%s", format_tune(r))
    return dataclasses.replace(plan, chosen=r.chosen)


def _at_bound(cal, gpu, key: str) -> bool:
    from ..estimation.fitting import ADDITIVE, BOUND
    if key in ADDITIVE:             # host times and latencies: bounded by 0 and the longest step
        return False
    ratio = getattr(cal, key) / getattr(gpu, key)
    return ratio > 0.99 * BOUND or ratio < 1.01 / BOUND
