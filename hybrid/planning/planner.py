"""Candidates from the catalogue, the memory filter, the cost model, and the choice with reasons.

A candidate is a preset at one shard size and one activation-checkpointing setting. Its verdict:
`fits` when its estimated per-GPU total (live tensors, the allocator's roomy-GPU reserve and the
CUDA context) is within the GPU's capacity; `tight` when only what must fit does (live tensors,
context and the fragmentation floor the allocator cannot reclaim: it runs because the allocator
frees its cache and retries, paying a synchronising cudaFree/cudaMalloc where it does); `OOM`
otherwise; `states` where only the model states are known (a bare parameter count), never chosen.
Among the candidates that fit the fastest (in useful tokens after failures, planning/goodput.py) wins,
and those predicted within the model's error of it (calibration.MODEL_ERROR, or a calibration file's)
are a tie that goes to the simpler one; a tight candidate is chosen only when none fits, and the plan
names a faster tight one beside a fitting choice. When nothing fits, `suggest` finds the smallest
change that would make something fit.
"""
from __future__ import annotations

from dataclasses import replace

from . import batch as batch_search
from .candidate import TIE, Candidate, Plan, fastest_fitting
from .goodput import Reliability, goodput as goodput_of
from ..families.catalogue import Strategy, load_catalogue
from ..layout.layout import AC_ORDER, Layout, as_layout
from .reach import method_degrees
from ..layout.dims import ParallelDims, divisors, valid_shard_sizes
from ..config.cluster import GPUS, Cluster
from ..estimation.cost.step import step_cost
from ..model.lora import with_lora
from ..errors import HybridError
from ..estimation.memory.analytic import NotApplicable, check_job
from ..estimation.memory.moe import check_ep, check_ep_layouts, ep_degrees
from ..estimation.memory.breakdown import MemoryBreakdown, fragmentation_floor, overhead_bytes
from ..estimation.memory.stages import rank_estimates
from .stages import staged
from ..layout.pipeline import (StageSplit, batch_schedules, check_stages_with_cp, pp_degrees, schedules_for,
                       splits_sequences, stage_cluster, stage_degrees)
from ..model.profile import ModelProfile, tp_degrees, tp_problem
from ..config.spec import TrainSpec
from ..units import GiB, fmt_bytes

MAX_PP = 64
"""The deepest pipeline the planner tries unpinned (Llama 3 405B trained with 16 stages)."""
MAX_CP_TRIES = 8
"""Context-parallel degrees a failed plan's suggestions try (the smallest divisors of the world)."""
SAME_MEMORY = GiB
"""GPUs whose memory differs by less than this are one memory class (a10g-24gb 23,028 MiB and l4-24gb
23,034 MiB): a suggestion of one for the other buys no room worth the name, so it is not made."""


def judge(layout: Layout | Strategy, profile: ModelProfile, spec: TrainSpec, cluster: Cluster, estimator=None,
          efficiency: float | None = None) -> Candidate:
    """Estimate one layout and say whether and why it fits. Its stages are split (planning/stages.
    staged) and every pipeline rank is estimated (rank_estimates: one rank without stages); the
    busiest is the candidate's memory. `estimator(layout, spec, rank)` (measure/method.RunEstimator:
    traced, measured) replaces the analytic estimate of that rank; the analytic one still rules out
    layouts that cannot run the job at all, before anything expensive runs. A bare Strategy stands
    for its layout on the cluster (Layout.of)."""
    layout = as_layout(layout, cluster, spec)
    spec = layout.train_spec(spec)
    try:
        layout.dp.family_obj.check(layout)
        if spec.fault_tolerant:
            from ..estimation.cost.step import fault_tolerance_problem
            problem = fault_tolerance_problem(layout)
            if problem is not None:
                raise problem
        layout = staged(layout, profile, spec, cluster)       # a rejected candidate keeps its stage split
        stages, busiest = rank_estimates(layout, profile, spec, cluster)
        m = stages[busiest]
        floor = m.floor            # the model's shape and the allocator's, whatever the estimator
        if estimator is not None:
            m = estimator(layout, spec, busiest)
        if m.floor != floor:
            m = replace(m, floor=floor, overhead=max(m.overhead, m.context + floor))
    except NotApplicable as e:
        return Candidate(layout, spec, None, False, f"not applicable: {e}")
    cost = step_cost(layout, profile, spec, cluster, efficiency)
    cap, host = cluster.capacity_bytes, cluster.host_bytes_per_rank
    tight = m.total > cap and m.needed <= cap and m.cpu <= host
    fits = m.needed <= cap and m.cpu <= host
    if m.needed > cap:
        why = f"needs {fmt_bytes(m.total)} > {fmt_bytes(cap)}: {m.describe_largest()}"
        if m.total > m.needed:
            why += f" ({fmt_bytes(m.needed)} with the allocator's cache given back)"
    elif m.cpu > host:
        why = (f"needs {fmt_bytes(m.cpu)} of host memory per rank > {fmt_bytes(host)} "
               f"({fmt_bytes(cluster.gpu.host_memory_bytes)} per node / {cluster.gpus_per_node} ranks)")
    elif tight:
        what = "live tensors" if m.activations is not None else "model states"
        why = (f"tight: {what} {fmt_bytes(m.allocated)} + context {fmt_bytes(m.context)} + fragmentation floor "
               f"{fmt_bytes(m.floor)} = {fmt_bytes(m.needed)} of {fmt_bytes(cap)} fit only when the allocator frees "
               f"its cache and retries (reserved on a roomy GPU {fmt_bytes(m.reserved)}); {room(m, cluster)}")
    else:
        # a bare parameter count: only the model states are known to fit, never the job
        verdict = "fits" if m.activations is not None else "model states fit"
        why = f"{verdict}: {fmt_bytes(m.total)} of {fmt_bytes(cap)}, largest {m.describe_largest()}"
        if m.cpu:
            why += f"; host {fmt_bytes(m.cpu)} of {fmt_bytes(host)} per rank"
    if m.activations is None:
        why += "; activations unknown"
    why += layout.pipeline_note()
    return Candidate(layout, spec, m, fits, why, cost, stages, tight=tight)


def room(m: MemoryBreakdown, cluster: Cluster) -> str:
    """What buys room for a tight candidate."""
    out = "room: more activation checkpointing or a smaller micro-batch"
    if not cluster.expandable_segments and cluster.headroom is None:
        # with expandable segments the floor is their part-used pages, whatever the transients
        es = m.allocated + overhead_bytes(replace(cluster, expandable_segments=True), m.tensors)
        floor = fragmentation_floor(replace(cluster, expandable_segments=True), 0)
        fit = ("fits" if es <= cluster.capacity_bytes else
               "still tight" if m.allocated + m.context + floor <= cluster.capacity_bytes else "still OOM")
        out = (f"room: PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True ({fmt_bytes(es)} with it: {fit}), "
               "more activation checkpointing or a smaller micro-batch")
    return out


def enumerate_candidates(catalogue: dict[str, Strategy], profile: ModelProfile, spec: TrainSpec,
                         cluster: Cluster, names: list[str], shard_size: int | None,
                         search_checkpointing: bool, search_shards: bool = True,
                         tp: int | None = 1, pp: int | None = 1, schedule: str | None = None,
                         cp: int = 1, cp_pinned: bool = False, ep: int | None = 1) -> list[Layout]:
    """Every preset x tensor-parallel degree (tp None: every valid one for families that run
    over tp groups; an int pins it) x pipeline degree and schedule (pp None: 1, and for
    families that run stages every pp the cluster allows, pipeline.pp_degrees; an int pins it)
    x its shard sizes (a free-shard preset: every valid size, or with pp > 1 its default one;
    --shard-size pins it) x checkpointing {none, selective, full} when it can apply, at one
    context-parallel degree `cp` (families without cp are left out unless it is pinned) x its
    expert-parallel degrees (ep_degrees; ep None tries them, an int pins it)."""
    can_ckpt = profile.num_blocks > 0 and (profile.decoder is not None or profile.activation_bytes_per_sample)
    ckpts = list(AC_ORDER) if search_checkpointing and can_ckpt else [spec.activation_checkpointing]
    stages = stage_degrees(cluster, profile.num_blocks if profile.decoder is not None else 0, pp, cp, MAX_PP)
    pinned = {"tp": tp is not None, "pp": pp is not None, "cp": cp_pinned}
    out = []
    for name in names:
        s = catalogue[name]
        for p in stages:
            cl = stage_cluster(cluster, p)
            if spec.global_batch is not None:        # the micro-batch count is searched per layout
                scheds = batch_schedules(p, profile.num_blocks // p, schedule)
            else:
                scheds = [schedule] if schedule else schedules_for(p, spec.gradient_accumulation,
                                                                   profile.num_blocks // p)
            for t in (tp_degrees(profile, cl.domain) if tp is None else [tp]):
                # a family that cannot run an unpinned degree leaves it out; a pinned one is shown, with the reason
                dims = Layout(ParallelDims(cp=cp, tp=t, pp=p), s, schedule="1f1b" if p > 1 else None)
                if any(not pinned.get(x.dim, False) for x in s.family_obj.problems(dims)):
                    continue
                if cl.domain % t or (cl.gpus_per_node % t and t % cl.gpus_per_node):
                    continue                      # a pinned tp wider than a stage's domain, or part of a node
                g = t * cp
                if cl.world_size % g or not (cl.domain % g == 0 or g % cl.domain == 0):
                    continue                      # cp x tp inside a domain or on whole ones (ParallelDims)
                groups = cl.world_size // g
                if s.shard_is_free and shard_size is None and search_shards and p == 1:
                    default = s.shard_size(cl, None, t, cp)
                    sizes = sorted({default, *(n for n in valid_shard_sizes(cl.world_size, cl.domain, g)
                                               if 1 < n < groups)})
                else:
                    sizes = [s.shard_size(cl, shard_size, t, cp)]
                for n, e in ((n, e) for n in sizes for e in ep_degrees(profile, s, n, cp, t, p, cl, ep)):
                    for ac in ckpts:
                        for sched in scheds:
                            out.append(Layout.of(s, cluster, replace(spec, activation_checkpointing=ac),
                                                 shard_size=n, tp=t, cp=cp, pp=p, schedule=sched, ep=e))
    return out


def choose(cands, tie: float = TIE, known: bool = True, goodput: bool = True) -> Candidate | None:
    """The fastest candidate that fits (by useful tokens, Candidate.rank_time; goodput False: by the
    step alone); those predicted within `tie` of it (the model's error) are a tie that goes to the
    simpler one. Tight candidates (they run only by the allocator's retries) are chosen only when
    none fits with room."""
    rate = (lambda c: c.rank_time) if goodput else (lambda c: c.cost.time_per_token)
    fastest = fastest_fitting(cands, known, rate)
    if fastest is None:
        return None
    best = rate(fastest)
    close = [c for c in cands if (c.known_to_fit or not known and c.fits) and c.tight == fastest.tight
             and rate(c) <= best * (1 + tie)]
    return min(close, key=lambda c: (c.layout.simplicity, rate(c)))


def plan(profile: ModelProfile, spec: TrainSpec, cluster: Cluster,
         catalogue: dict[str, Strategy] | None = None, shard_size: int | None = None,
         strategies: list[str] | None = None, estimator=None, method: str = "analytic",
         search_checkpointing: bool = False, efficiency: float | None = None,
         suggest_fixes: bool = True, search_shards: bool = True, tp: int | None = None,
         pp: int | None = None, schedule: str | None = None, calibration=None,
         cp: int | None = None, micro_batch: int | None = None, ep: int | None = 1,
         reliability: Reliability | None = None, hold_batch: bool = False) -> Plan:
    """Judge every candidate and choose. A calibration (calibration.Calibration) replaces the
    GPU's speed figures with the fitted ones and its error becomes the tie band (Calibration.tie).
    With search_checkpointing the planner also tries each activation-checkpointing setting (the
    spec's own is otherwise kept); tp None tries every valid tensor-parallel degree, an int pins
    it; pp None tries every pipeline degree the cluster allows (and the schedules that fit the
    micro-batch count), an int pins it, as `schedule` pins the schedule. cp None tries every
    context-parallel degree (cp_degrees) when the sequence is long (estimation/memory/cp.LONG_SEQ), an int
    pins it. With spec.global_batch each layout's micro-batch and accumulation are searched
    (hybrid/planning/batch.py) unless `micro_batch` pins the micro-batch. ep None tries every expert-parallel
    degree of an MoE model (ep_degrees), an int pins it (1: none). `estimator` (measure/method.
    RunEstimator) replaces the analytic memory of each layout its method runs (layout.METHOD_REACH:
    unpinned degrees it cannot run are 1, pinned ones raise). `reliability` (planning/goodput.py: the
    failure rate, storage bandwidth, relaunch time; default Reliability()) prices each layout's
    checkpoints and restarts, and the choice is by useful tokens after them. `hold_batch` (`hybrid plan`):
    without spec.global_batch every row still trains one global batch, implied_batch's, each layout at its
    own micro-batch and accumulation (micro_batch pins the micro-batch), so that rows compare the same work."""
    implied = hold_batch and spec.global_batch is None
    spec = implied_batch(spec, cluster) if implied else spec
    profile = with_lora(profile, spec.lora)          # a whole model gains its adapters (model/lora.py)
    check_job(profile, spec)
    rel = reliability if reliability is not None else Reliability()
    method = estimator.method if estimator is not None else method     # RunEstimator: traced or measured
    reach = method_degrees(method, {"tp": tp, "pp": pp, "cp": cp, "ep": ep})    # the degrees that method runs
    tp, pp, cp, ep = reach["tp"], reach["pp"], reach["cp"], reach["ep"]
    tie = TIE
    if calibration is not None:
        cluster, tie = calibration.apply(cluster), calibration.tie
    cat = catalogue if catalogue is not None else load_catalogue()
    names = strategies or list(cat)
    for n in names:
        if n not in cat:
            raise HybridError(f"unknown strategy {n!r}. Available: {', '.join(cat)}")
    if shard_size is not None and not any(cat[n].shard_is_free for n in names):
        raise HybridError("--shard-size applies to strategies with a free shard size (hsdp); "
                          f"none of {', '.join(names)} has one")
    # an expensive estimator (traced, measured) runs once per preset, not per shard size
    if tp is not None:
        problem = tp_problem(profile, tp)
        if problem is not None:         # the runtime cannot split this model so: its reason, one line
            raise HybridError(f"--tp {tp}: {problem}")
        per = cluster.gpus_per_node
        valid = [t for t in tp_degrees(profile, cluster.domain) if per % t == 0 or t % per == 0]
        if tp not in valid:
            word = cluster.domain_word
            nodes = "" if word == "node" else f", divide the {per} GPUs per node or take whole nodes,"
            raise HybridError(f"--tp {tp} is not a valid tensor-parallel degree for {profile.name} on "
                              f"{cluster.domain} GPUs per {word} (it must divide the GPUs per {word}{nodes} and the "
                              f"attention and key/value heads of a llama-style decoder); valid: "
                              f"{', '.join(map(str, valid))}")
    if pp is not None:
        valid = [p for p in pp_degrees(cluster) if p <= max(profile.num_blocks, 1)]
        if pp not in valid:
            raise HybridError(f"--pp {pp} is not a valid pipeline degree for {profile.name} on {cluster.describe()} "
                              f"(it must divide the nodes, or the GPUs of a single node, and be at most the "
                              f"{profile.num_blocks} blocks); valid: {', '.join(map(str, valid))}")
    if schedule is not None:
        StageSplit(2, schedule, 1, (1, 1))             # the name check, one line
    check_ep(profile, ep, cat, names)
    check_stages_with_cp(pp, cp)
    todo = [item for c in cp_degrees(profile, spec, cluster, cp)
            for item in enumerate_candidates(cat, profile, spec, cluster, names, shard_size, search_checkpointing,
                                             search_shards=search_shards and estimator is None, tp=tp, pp=pp,
                                             schedule=schedule, cp=c, cp_pinned=cp is not None, ep=ep)]
    check_ep_layouts(ep, todo, cluster)
    if estimator is not None:               # the layouts it runs, and how many it will see (its progress)
        todo = [t for t in todo if estimator.runs(t)]
        estimator.expect(len(todo))
    cands = judge_all(todo, profile, spec, cluster, estimator, efficiency, micro_batch, schedule is not None)
    cands = [with_goodput(c, profile, cluster, rel) for c in cands]
    chosen = choose(cands, tie)
    by_speed = choose(cands, tie, goodput=False)
    order = sorted(cands, key=lambda c: (not c.fits, c.tight, c.memory is None,
                                         c.rank_time if c.fits else (c.memory.total if c.memory else 0)))
    fixes = ()
    unknown = any(c.fits and c.memory.activations is None for c in cands)    # nothing to suggest: see Plan.missing
    if chosen is None and suggest_fixes and estimator is None and not unknown:
        fixes = tuple(suggest(profile, spec, cluster, cat, names, search_checkpointing, efficiency, tp, pp,
                              micro_batch, cp, ep, implied))
    return Plan(profile, cluster, spec, tuple(order), chosen, method, fixes, tie, calibration, rel,
                by_speed if by_speed is not chosen else None, implied)


def implied_batch(spec: TrainSpec, cluster: Cluster) -> TrainSpec:
    """The job at the global batch its micro-batch and accumulation give when every GPU is a
    data-parallel rank (micro-batch x accumulation x world size): what `hybrid plan` holds for every
    row when --global-batch is not given."""
    return replace(spec, global_batch=spec.micro_batch * spec.gradient_accumulation * cluster.world_size)


def with_goodput(c: Candidate, profile: ModelProfile, cluster: Cluster, rel: Reliability) -> Candidate:
    """The candidate with its checkpoint, restart and goodput figures (planning/goodput.py), where it
    has a step time."""
    if c.cost is None or c.memory is None:
        return c
    return replace(c, goodput=goodput_of(c.layout, profile, c.spec, cluster, c.cost, rel))


def judge_all(todo: list[Layout], profile: ModelProfile, spec: TrainSpec, cluster: Cluster, estimator=None,
              efficiency: float | None = None, micro_batch: int | None = None,
              pinned_schedule: bool = False) -> list[Candidate]:
    """Judge enumerated layouts; at a global batch each one's batch shape is searched first."""
    if spec.global_batch is None:
        return [judge(lay, profile, spec, cluster, estimator, efficiency) for lay in todo]

    def one(lay, sp, est):
        return judge(lay, profile, sp, cluster, est, efficiency)
    return [batch_search.search(one, lay, spec, estimator, micro_batch, pinned_schedule) for lay in todo]


def _fits_with(profile, spec, cluster, cat, names, search_checkpointing, efficiency, tp=None,
               pp=None, cp=1, micro_batch=None, ep=1, implied=False) -> Candidate | None:
    """The choice of the job changed as a suggestion changes it; `implied`: its global batch is implied
    by the micro-batch, accumulation and world (implied_batch), so it follows the change."""
    if implied:
        spec = implied_batch(spec, cluster)
    try:
        check_job(profile, spec)
    except HybridError:
        return None
    todo = enumerate_candidates(cat, profile, spec, cluster, names, None, search_checkpointing, tp=tp, pp=pp, cp=cp,
                                ep=ep)
    return choose(judge_all(todo, profile, spec, cluster, None, efficiency, micro_batch))


def cp_degrees(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, cp: int | None) -> list[int]:
    """Context-parallel degrees to try: the pinned one (checked: it divides the world and cuts
    the sequence into 2cp equal chunks), else 1, and when the sequence is at least LONG_SEQ every
    divisor of the world that cuts it so (hybrid/runtime/backends/cp.py's layout)."""
    from ..estimation.memory.cp import LONG_SEQ
    from ..layout.dims import divisors
    world, s = cluster.world_size, spec.seq_len
    # cp 1 splits nothing; a cp > 1 needs 2cp equal chunks
    valid = [1] + ([c for c in divisors(world)[1:] if s % (2 * c) == 0] if profile.decoder is not None else [])
    if cp is None:
        return valid if s >= LONG_SEQ else [1]
    if cp not in valid:
        why = ("the model has no known decoder shape" if profile.decoder is None else
               f"it must divide the {world} GPUs and cut the sequence of {s} into {2 * cp} equal chunks")
        raise HybridError(f"--cp {cp} is not a valid context-parallel degree for {profile.name} ({why}); valid: "
                          f"{', '.join(map(str, valid))}")
    return [cp]


def _size(c: Candidate) -> str:
    """A suggestion's memory: its total, or for a tight one what must fit and that it is tight."""
    return f"{fmt_bytes(c.memory.needed)}, tight" if c.tight else fmt_bytes(c.memory.total)


def _larger_ep(profile, spec, cluster, cat, names, efficiency, tp, pp, cp, micro_batch, ep,
               implied=False) -> list[str]:
    """An MoE plan at a pinned ep: the smallest larger ep that makes some candidate fit."""
    d = profile.decoder
    if ep is None or d is None or not d.moe:
        return []
    for e in [x for x in divisors(d.experts) if x > ep]:
        c = _fits_with(profile, spec, cluster, cat, names, True, efficiency, tp, pp, cp, micro_batch, e, implied)
        if c:
            return [f"--ep {e} ({c.label}: {_size(c)})"]
    return []


def suggest(profile: ModelProfile, spec: TrainSpec, cluster: Cluster, cat: dict[str, Strategy],
            names: list[str], search_checkpointing: bool, efficiency: float | None = None,
            tp: int | None = None, pp: int | None = None, micro_batch: int | None = None,
            cp: int | None = None, ep: int | None = 1, implied: bool = False) -> list[str]:
    """The smallest change along each axis that makes some candidate fit (at a pinned cp, and the
    plan's ep: a pinned one, or every ep_degrees choice); `implied`: the global batch is implied_batch's,
    so a change of nodes or micro-batch changes it as a new plan would. A suggested GPU has at least
    SAME_MEMORY more memory."""
    def fits(*a, **kw):
        return _fits_with(*a, **kw, implied=implied)
    pinned_cp = cp or 1
    out = _larger_ep(profile, spec, cluster, cat, names, efficiency, tp, pp, pinned_cp, micro_batch, ep, implied)
    if pp is not None:      # pp was pinned: would another degree fit?
        for p in pp_degrees(cluster):
            c = p > pp and p <= profile.num_blocks and fits(profile, spec, cluster, cat, names, True,
                                                                  efficiency, tp, p, micro_batch=micro_batch)
            if c:
                out.append(f"--pp {p} ({c.label}: {_size(c)})")
                break
    if tp is not None:      # tp was pinned: would another degree fit?
        for t in tp_degrees(profile, cluster.domain):
            c = t > tp and fits(profile, spec, cluster, cat, names, True, efficiency, t,
                                micro_batch=micro_batch, cp=pinned_cp)
            if c:
                out.append(f"--tp {t} ({c.label}: {_size(c)})")
                break
    if splits_sequences(pp) and profile.decoder is not None:   # would splitting the sequence fit?
        for k in [d for d in divisors(cluster.world_size) if d > pinned_cp][:MAX_CP_TRIES - 1]:
            c = spec.seq_len % (2 * k) == 0 and fits(profile, spec, cluster, cat, names, True, efficiency,
                                                           tp, 1, k, micro_batch=micro_batch, ep=ep)
            if c:
                out.append(f"--cp {k} ({c.label}: {_size(c)})")
                break
    args = (cat, names, True, efficiency)
    at = {"micro_batch": micro_batch, "cp": pinned_cp, "ep": ep, "tp": tp, "pp": pp}   # the degrees the user pinned
    if not search_checkpointing and spec.activation_checkpointing != "full":
        for ac in ("selective", "full"):
            c = fits(profile, replace(spec, activation_checkpointing=ac), cluster, *args, **at)
            if c:
                out.append(f"--activation-checkpointing {ac} ({c.label}: {_size(c)})")
                break
    nodes = cluster.nodes
    while nodes < 4096:
        nodes *= 2
        c = fits(profile, spec, replace(cluster, nodes=nodes), *args, **at)
        if c:
            out.append(f"--nodes {nodes} ({c.label} x{c.shard_size}: {_size(c)} per GPU)")
            break
    if profile.decoder is not None:
        seq = spec.seq_len
        while seq > 128:
            seq //= 2
            c = fits(profile, replace(spec, seq_len=seq), cluster, *args, **at)
            if c:
                out.append(f"--seq-len {seq} ({c.label}: {_size(c)})")
                break
    if spec.micro_batch > 1 and (spec.global_batch is None or implied):
        c = fits(profile, replace(spec, micro_batch=1), cluster, *args,
                 **{**at, "micro_batch": 1 if micro_batch is not None else None})
        if c:
            out.append(f"--micro-batch 1 ({c.label}: {_size(c)})")
    return out + _larger_gpu(lambda cl: fits(profile, spec, cl, *args, **at), cluster)


def _larger_gpu(fits, cluster: Cluster) -> list[str]:
    """The smallest catalogue GPU with at least SAME_MEMORY more memory on which `fits(cluster)` chooses
    a layout that fits by the estimate."""
    for gpu in sorted(GPUS.values(), key=lambda g: g.memory_bytes):
        if gpu.memory_bytes >= cluster.gpu.memory_bytes + SAME_MEMORY:
            c = fits(replace(cluster, gpu=gpu))
            if c:
                return [f"--gpu {gpu.name} ({c.label}: {_size(c)})"]
    return []
