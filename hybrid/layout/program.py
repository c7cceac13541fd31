"""A pipeline rank's step as torch.distributed.pipelining runs it (pure, no torch): every forward and
backward of its local stages in the schedule's order, how long the schedule's send ops keep what they
send, and, under interleaved, when FSDP stages are gathered, resharded and reduced. The trace runs it
(measure/stages.py) and the closed-form estimate counts its moments (estimation/memory/analytic.py), so
both read one description of torch's runtime.

What torch holds, read from its source (torch/distributed/pipelining/schedules.py, 2.13):
  gpipe        ScheduleGPipe keeps every forward's send work in `fwd_sends_to_wait` and every backward's
               in `bwd_sends_to_wait` until the step returns;
  1f1b         Schedule1F1B rebinds its variables: a forward's send ops (`fwd_sends`) live until the next
               forward, its warm-up send works (`send_work`) until the next warm-up send, the one before
               the last warm-up forward until the steady phase ends, and a backward's (`bwd_sends`,
               `send_work`) until the next backward;
  interleaved  _PipelineScheduleRuntime keeps every send work in `send_ops` until the step returns; its
               lowering (_add_unshard_reshard, max_active_stages 3) unshards each FSDP stage before the
               stage's first action and reshards it before the first action after its last one, and
               _add_reduce_grad reduces a stage's gradients right after its last backward.
A send work holds the tensor it sends (gloo's SendWork keeps it until the work is destroyed; NCCL's
work keeps its tensors until it is waited on): a stage's output or input gradient outlives its own
micro-batch while the schedule holds the work.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .pipeline import StageSplit, rank_actions

MAX_ACTIVE_STAGES = 3
"""Stages torch's runtime keeps unsharded at once under FSDP (_add_unshard_reshard's default)."""


@dataclass(frozen=True)
class Step:
    """One action of a rank's step: a forward or backward of a (stage, micro-batch) ("F", "B"), or
    an FSDP stage's unshard, reshard or gradient reduction ("unshard", "reshard", "reduce")."""

    kind: str
    stage: int
    mb: int = -1
    """The micro-batch of a forward or backward; -1 otherwise."""
    sends: bool = False
    """A forward whose output, or a backward whose input gradient, goes to another rank."""
    released: int = -1
    """The index of the step after which the schedule drops that send (len(program): when the
    schedule's step returns); -1 without a send."""


def rank_program(split: StageSplit, rank: int, fsdp: bool = False) -> tuple[Step, ...]:
    """Pipeline rank `rank`'s step under `split`: its forwards and backwards in torch's order
    (pipeline.rank_actions), each send with the step after which torch drops it, and, where the
    schedule is torch's runtime one (interleaved), the unshards and reshards of its FSDP stages
    (`fsdp`: the stages are FSDP modules) and each stage's reduction after its last backward;
    the single-stage schedules reduce after the last backward."""
    acts = rank_actions(split.schedule, split.pp, split.micro_batches, rank, split.virtual)
    last = split.stages - 1
    compute = [Step(k, s, mb, (s != last) if k == "F" else (s != 0)) for k, s, mb in acts]
    if split.schedule == "interleaved":
        steps = _lowered(compute, split.micro_batches, fsdp)
        held = {i: len(steps) for i, s in enumerate(steps) if s.sends}
    else:                                   # the reduction follows the last backward
        steps = compute + [Step("reduce", acts[-1][1])]
        held = _single_releases(split, rank, acts, len(steps))
    return tuple(replace(s, released=held[i]) if s.sends else s for i, s in enumerate(steps))


def _lowered(compute: list[Step], m: int, fsdp: bool) -> list[Step]:
    """torch's lowering of a runtime schedule's compute actions: FSDP unshards and reshards
    (_add_unshard_reshard: before each action, the next MAX_ACTIVE_STAGES distinct stages are
    gathered and the others released; the rest at the end) and each stage's reduction right after
    its m-th backward (_add_reduce_grad)."""
    out: list[Step] = []
    active: list[int] = []
    done: dict[int, int] = {}
    # the next MAX_ACTIVE_STAGES distinct stages from each action on, built from the end (linear in the step)
    ahead: list[list[int]] = [[] for _ in compute]
    nxt: list[int] = []
    for i in range(len(compute) - 1, -1, -1):
        nxt = ([compute[i].stage] + [t for t in nxt if t != compute[i].stage])[:MAX_ACTIVE_STAGES]
        ahead[i] = nxt
    for i, s in enumerate(compute):
        if fsdp:
            upcoming = ahead[i]
            for stage in [a for a in active if a not in upcoming]:
                active.remove(stage)
                out.append(Step("reshard", stage))
            for stage in [u for u in upcoming if u not in active]:
                active.append(stage)
                out.append(Step("unshard", stage))
        out.append(s)
        if s.kind == "B":
            done[s.stage] = done.get(s.stage, 0) + 1
            if done[s.stage] == m:
                out.append(Step("reduce", s.stage))
    out += [Step("reshard", stage) for stage in active]
    return out


def _single_releases(split: StageSplit, rank: int, acts: list, end: int) -> dict[int, int]:
    """For each sending action of a single-stage schedule (by its index in `acts`), the index of the
    action after which torch drops its send (`end`: when the step returns). GPipe holds every send to
    the end; Schedule1F1B as the module docstring says (w warm-up forwards, w = min(m, pp - rank))."""
    m = split.micro_batches
    last = split.stages - 1
    at = {(k, mb): i for i, (k, _, mb) in enumerate(acts)}
    out = {}
    if split.schedule == "gpipe":
        return {i: end for i, (k, s, _) in enumerate(acts) if (s != last if k == "F" else s != 0)}
    w = min(m, split.pp - rank)
    for i, (k, s, mb) in enumerate(acts):
        if k == "F" and s != last:
            if mb == w - 2:                 # `send_work` keeps it until the steady phase's last backward
                out[i] = at[("B", m - w)]
            else:                           # `fwd_sends` (and a warm-up `send_work`) until the next forward
                out[i] = at.get(("F", mb + 1), end)
        elif k == "B" and s != 0:           # `bwd_sends` / `send_work` until the next backward
            out[i] = at.get(("B", mb + 1), end)
    return out


@dataclass(frozen=True)
class Backward:
    """What a rank holds while one of its backwards runs, read from its program: the closed-form
    estimate prices each such moment (estimation/memory/analytic.py)."""

    stage: int
    """The stage whose backward runs."""
    live: int
    """(Stage, micro-batch) forwards whose activations are held, this backward's own included."""
    done: frozenset
    """The local stages a backward of which ran earlier in the step: their gradients exist."""
    sends: int
    """Tensors held only by the schedule's send works: input gradients of earlier backwards, and
    outputs of forwards whose own backward has ended."""
    reduced: frozenset = frozenset()
    """Of `done`, the stages whose gradients the schedule has reduced (their last backward ran)."""
    received: int = 0
    """Of `live`, those of a stage that receives its input (all but the first stage): their input
    is the stage's receive buffer (torch's PipelineStage._retrieve_recv_activations hands the
    forward the buffer itself)."""


def backward_moments(split: StageSplit, rank: int) -> tuple[Backward, ...]:
    """Each backward of pipeline rank `rank`'s step (rank_program) with what is held while it runs."""
    program = rank_program(split, rank)
    ends = {(s.stage, s.mb): i for i, s in enumerate(program) if s.kind == "B"}
    # a send's tensor is held by the send alone from after the step that made it (a backward's input
    # gradient) or after its forward's own backward (an output, kept by fwd_cache until then) through the
    # step after which the schedule drops it: +1 / -1 at the ends of that interval, summed as the step runs
    change = [0] * (len(program) + 2)
    for i, t in enumerate(program):
        if t.sends:
            start = i + 1 if t.kind == "B" else ends[t.stage, t.mb] + 1
            if start <= t.released:
                change[start] += 1
                change[t.released + 1] -= 1
    live: set = set()
    done: set = set()
    reduced: set = set()
    out = []
    sends = received = 0
    for j, s in enumerate(program):
        sends += change[j]
        if s.kind == "reduce":
            reduced.add(s.stage)
        elif s.kind == "F":
            live.add((s.stage, s.mb))
            received += s.stage != 0
        elif s.kind == "B":
            out.append(Backward(s.stage, len(live), frozenset(done), sends, frozenset(reduced), received))
            live.discard((s.stage, s.mb))
            received -= s.stage != 0
            done.add(s.stage)
    return tuple(out)
