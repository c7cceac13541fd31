"""Pipeline parallelism, the pure part: how blocks split into stages, which schedule runs them,
how many micro-batches each rank holds activations for, and the bubble (no torch).

Schedules (the names of `--schedule` and `auto_wrap(schedule=)`), as torch.distributed.pipelining
runs them with m micro-batches (= the gradient-accumulation count) over pp ranks:
  gpipe        all m forwards, then all m backwards: every rank holds m micro-batches' activations
  1f1b         rank r runs pp - 1 - r warm-up forwards, then alternates one forward and one
               backward: it holds at most min(pp - r, m) micro-batches (Narayanan et al. 2021,
               arXiv 2104.04473, sec. 2.2.1)
  interleaved  each rank holds v = 2 chunks (virtual stages r and r + pp): warm-up of
               (v - 1) * k + 2 * (pp - 1 - r) chunk forwards (k = micro-batches per round, pp when
               m is a multiple of pp), then 1F1B over chunks; rank r holds min(warm-up + 1, m * v)
               chunk-micro-batches (torch's ScheduleInterleaved1F1B, Megatron-LM's
               get_num_warmup_microbatches)
torch's 1F1B needs m >= pp; with fewer micro-batches the planner offers gpipe (which then holds
the same m micro-batches).
The bubble (idle fraction of the step): (pp - 1) / (m + pp - 1) for gpipe and 1f1b, and
(pp - 1) / (v * m + pp - 1) interleaved (arXiv 2104.04473, sec. 2.2).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass

from .._compat import lazy_names
from ..errors import HybridError

SCHEDULES = ("1f1b", "gpipe", "interleaved")
VIRTUAL = 2
"""Chunks per rank of the interleaved schedule (Megatron-LM's and torchtitan's usual choice)."""


def in_flight(schedule: str, pp: int, m: int, rank: int, virtual: int = 1) -> int:
    """Micro-batches (interleaved: chunk-micro-batches) whose activations `rank` holds at once, at
    its peak."""
    if schedule == "gpipe":
        return m * virtual
    if schedule == "1f1b":
        return min(pp - rank, m)
    per_round = m // max(1, m // pp)              # torch's microbatches_per_round
    warmup = (virtual - 1) * per_round + 2 * (pp - 1 - rank)
    return min(warmup + 1, m * virtual)


def in_flight_later(schedule: str, pp: int, m: int, rank: int, virtual: int = 1) -> int:
    """Micro-batches (interleaved: chunk-micro-batches) whose activations `rank` holds at its second
    and later backwards, when the earlier ones' accumulated gradients exist: one more forward runs
    before each of them while any is left, so as many as at the first (in_flight) until the
    forwards run out, then one fewer (gpipe: m - 1; 1f1b with m = pp - rank: pp - rank - 1)."""
    total = m * virtual
    held = in_flight(schedule, pp, m, rank, virtual)
    return held if held < total else total - 1


def rank_actions(schedule: str, pp: int, m: int, rank: int, virtual: int = 1) -> list[tuple[str, int, int]]:
    """The order rank `rank` runs its forwards ("F") and backwards ("B") in: (kind, stage, micro-batch),
    the stage a global stage index (rank + k * pp for its k-th chunk). gpipe and 1f1b as torch's
    ScheduleGPipe and Schedule1F1B run them; interleaved as ScheduleInterleaved1F1B orders them
    (_calculate_single_rank_operations: a warm-up of forwards, then a forward and a backward per step,
    then the remaining backwards; the chunk of each advancing every microbatches_per_round steps,
    forwards from the first chunk, backwards from the last)."""
    if schedule == "gpipe":
        return [("F", rank, i) for i in range(m)] + [("B", rank, i) for i in range(m)]
    if schedule == "interleaved":
        return _interleaved_actions(pp, m, rank, virtual)
    if schedule != "1f1b":
        raise HybridError(f"unknown pipeline schedule {schedule!r}; use one of {', '.join(SCHEDULES)}")
    warmup = min(pp - 1 - rank, m)
    out = [("F", rank, i) for i in range(warmup)]
    f, b = warmup, 0
    while b < m:
        if f < m:
            out.append(("F", rank, f))
            f += 1
        out.append(("B", rank, b))
        b += 1
    return out


def _interleaved_actions(pp: int, m: int, rank: int, virtual: int) -> list[tuple[str, int, int]]:
    """ScheduleInterleaved1F1B's compute actions of one rank (torch's _get_warmup_ops and
    _get_1f1b_rank_ops without their idle slots)."""
    per_round = m // max(1, m // pp)                   # torch's microbatches_per_round
    total = m * virtual
    warmup = min((virtual - 1) * per_round + 2 * (pp - 1 - rank), total)
    forward, backward = [0] * virtual, [0] * virtual
    out = []
    for op in range(total + warmup):               # warm-up, steady and cool-down steps
        if op < total:                                 # warm-up and steady steps: a forward
            k = (op // per_round) % virtual
            out.append(("F", k * pp + rank, forward[k]))
            forward[k] += 1
        if op >= warmup:                               # steady and cool-down steps: a backward
            k = virtual - 1 - ((op - warmup) // per_round) % virtual
            out.append(("B", k * pp + rank, backward[k]))
            backward[k] += 1
    return out


def bubble(schedule: str, pp: int, m: int, virtual: int = 1) -> float:
    """Idle fraction of a step: (pp - 1) slots of a micro-batch's stage time out of m + pp - 1
    (interleaved: chunk slots, v times more of them for the same bubble)."""
    if pp == 1:
        return 0.0
    slots = m * (virtual if schedule == "interleaved" else 1)
    return (pp - 1) / (slots + pp - 1)


@dataclass(frozen=True)
class StageSplit:
    """The stages of one candidate: blocks per stage (pp * virtual stages, in stage order; stage
    i runs on rank i % pp), the schedule and the micro-batch count."""

    pp: int
    schedule: str
    micro_batches: int
    blocks: tuple[int, ...]
    virtual: int = 1

    def __post_init__(self):
        if self.schedule not in SCHEDULES:
            raise HybridError(f"unknown pipeline schedule {self.schedule!r}; use one of {', '.join(SCHEDULES)}")
        if len(self.blocks) != self.pp * self.virtual or min(self.blocks) < 1:
            raise HybridError(f"{self.pp * self.virtual} pipeline stages need at least one block each; "
                              f"got {list(self.blocks)}")

    @property
    def stages(self) -> int:
        return self.pp * self.virtual

    def stage_range(self, stage: int) -> tuple[int, int]:
        """Blocks [lo, hi) of a stage, in the model's order."""
        lo = sum(self.blocks[:stage])
        return lo, lo + self.blocks[stage]

    def rank_stages(self, rank: int) -> list[int]:
        """The stages (virtual stages) rank `rank` of the pp group runs."""
        return [rank + k * self.pp for k in range(self.virtual)]

    def in_flight(self, rank: int) -> int:
        return in_flight(self.schedule, self.pp, self.micro_batches, rank, self.virtual)

    def in_flight_layers(self, rank: int) -> int:
        """Block activations `rank` holds at its peak: in-flight (chunk-)micro-batches x blocks
        per stage (interleaved: its larger chunk's, when the blocks do not split evenly)."""
        return self.in_flight(rank) * max(self.blocks[s] for s in self.rank_stages(rank))

    def later(self, rank: int) -> int:
        """Micro-batches `rank` holds at its later backwards (in_flight_later)."""
        return in_flight_later(self.schedule, self.pp, self.micro_batches, rank, self.virtual)

    @property
    def bubble(self) -> float:
        return bubble(self.schedule, self.pp, self.micro_batches, self.virtual)

    def describe(self) -> str:
        split = "/".join(str(sum(self.blocks[s] for s in self.rank_stages(r))) for r in range(self.pp))
        return (f"pp {self.pp} {self.schedule}{'' if self.virtual == 1 else f' x{self.virtual} chunks'}, "
                f"{self.micro_batches} micro-batches, blocks per rank {split}, bubble {self.bubble:.0%}")

    def to_dict(self) -> dict:
        return {"pp": self.pp, "schedule": self.schedule, "virtual_stages": self.virtual,
                "micro_batches": self.micro_batches, "blocks_per_stage": list(self.blocks),
                "bubble": round(self.bubble, 4)}


def even_split(layers: int, stages: int) -> tuple[int, ...]:
    """layers blocks over `stages` stages as evenly as possible, the extra ones in the middle."""
    base, extra = divmod(layers, stages)
    order = sorted(range(stages), key=lambda i: abs(i - (stages - 1) / 2))
    more = set(order[:extra])
    return tuple(base + (i in more) for i in range(stages))


def balanced_split(layers: int, fixed: list[float], per_block: list[float]) -> tuple[int, ...]:
    """Blocks per stage that minimise the largest stage's cost fixed[i] + n_i * per_block[i]
    (a linear model of each stage's memory: its embedding/head and the blocks' states and
    in-flight activations), every stage at least one block, summing to `layers`."""
    stages = len(fixed)
    if layers < stages:
        raise HybridError(f"{stages} pipeline stages need at least {stages} blocks; the model has {layers}")

    def counts(limit: float) -> list[int]:
        return [max(1, int((limit - f) // b)) if b > 0 else layers for f, b in zip(fixed, per_block)]

    lo, hi = 0.0, max(f + layers * b for f, b in zip(fixed, per_block))
    for _ in range(100):                              # bisect the smallest feasible largest cost
        mid = (lo + hi) / 2
        if sum(counts(mid)) >= layers:
            hi = mid
        else:
            lo = mid
    return tuple(_give_back(counts(hi), sum(counts(hi)) - layers, fixed, per_block))


def _give_back(n: list[int], excess: int, fixed: list[float], per_block: list[float]) -> list[int]:
    """`n` less `excess` blocks, as taking one at a time from the costliest stage with more than
    one (cost fixed + n * per_block, ties to the lower index) would, in closed form: a stage's
    removals cost f + m * b for m = n, ..., 2 (a stage with b <= 0 gives all of them back at its
    first cost), so they are the `excess` costliest removals, found by bisecting the cost."""
    if excess <= 0:
        return n

    def at_least(t: float) -> list[int]:          # removals per stage costing t or more
        out = []
        for f, b, k in zip(fixed, per_block, n):
            if b <= 0:
                out.append(k - 1 if f + k * b >= t else 0)
                continue
            lo, hi = 2, k + 1                         # the smallest m in [2, k] with f + m * b >= t
            while lo < hi:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if f + mid * b >= t else (mid + 1, hi)
            out.append(k + 1 - lo)
        return out

    costs = [f + m * b for f, b, k in zip(fixed, per_block, n) if k > 1 for m in ({k, 2} if b > 0 else {k})]
    lo, hi = _order(min(costs)), _order(max(costs))
    while lo < hi:                                    # the largest cost t with at least `excess` removals >= t
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if sum(at_least(_unorder(mid))) >= excess else (lo, mid - 1)
    t = _unorder(lo)
    above = at_least(_unorder(lo + 1))
    left = excess - sum(above)
    out = []
    for k, a, e in zip(n, above, at_least(t)):       # removals costing exactly t go to the lower stages first
        take = min(e - a, left)
        left -= take
        out.append(k - a - take)
    return out


def _order(x: float) -> int:
    """A float's rank among floats as an integer (-0.0 and 0.0 alike), for bisection over them."""
    i = struct.unpack("<q", struct.pack("<d", x))[0]
    return i if i >= 0 else -(i & 0x7FFF_FFFF_FFFF_FFFF)


def _unorder(i: int) -> float:
    return struct.unpack("<d", struct.pack("<q", i))[0] if i >= 0 else -_unorder(-i)


def stage_cluster(cluster, pp: int):
    """The cluster one pipeline stage runs on (pp is the outermost mesh dimension): pp divides
    the nodes (each stage whole nodes), or a single node splits into pp groups of GPUs."""
    from dataclasses import replace
    if pp == 1:
        return cluster
    if cluster.nodes % pp == 0:
        return replace(cluster, nodes=cluster.nodes // pp)
    if cluster.nodes == 1 and cluster.gpus_per_node % pp == 0:
        return replace(cluster, gpus_per_node=cluster.gpus_per_node // pp)
    raise HybridError(f"pp {pp} must divide the {cluster.nodes} nodes (each stage on whole nodes), or the GPUs "
                      f"of a single node; valid pp: {', '.join(map(str, pp_degrees(cluster)))}")


def pp_degrees(cluster) -> list[int]:
    """Pipeline degrees a cluster allows: divisors of the node count, or within one node the
    divisors of its GPUs."""
    from .dims import divisors
    return divisors(cluster.nodes) if cluster.nodes > 1 else divisors(cluster.gpus_per_node)


def splits_sequences(pp: int | None) -> bool:
    """Whether a plan at this pipeline degree (None: not pinned, so 1 among others) may split the
    sequence over cp ranks: pipeline stages do not carry the sequence positions cp needs."""
    return (pp or 1) == 1


def check_stages_with_cp(pp: int | None, cp: int | None) -> None:
    """Pinned pipeline stages and context parallelism together: HybridError (the one rule)."""
    if (cp or 1) > 1 and not splits_sequences(pp):
        raise HybridError(f"--cp {cp} with --pp {pp}: pipeline stages do not carry the sequence positions context "
                          "parallelism needs; use --pp 1 with --cp, or --cp 1 with --pp")


def stage_degrees(cluster, blocks: int, pp: int | None, cp: int, most: int) -> list[int]:
    """Pipeline degrees a plan tries: a pinned one, else 1 and every pp_degrees one up to the
    model's blocks (0: no known decoder, nothing to split) and `most`; none above 1 with context
    parallelism (stages do not carry sequence positions, runtime/backends/cp.py)."""
    tries = [pp] if pp is not None else [1] + [p for p in pp_degrees(cluster) if 1 < p <= min(blocks, most)]
    return [p for p in tries if p == 1 or cp == 1]


def interleaved_problem(pp: int, m: int) -> str | None:
    """Why torch's ScheduleInterleaved1F1B cannot run m micro-batches on pp ranks (None where it can): it
    runs them in rounds of m // (m // pp) and raises unless m is a multiple of the round count m // pp
    (schedules.py, ScheduleInterleaved1F1B.__init__); below pp micro-batches its warm-up has too few."""
    rounds = max(1, m // pp)
    if m < pp:
        return f"interleaved needs at least pp = {pp} micro-batches, not {m}"
    if m % rounds:
        return (f"interleaved runs {m} micro-batches in {rounds} rounds, which torch's ScheduleInterleaved1F1B "
                f"refuses ({m} is not a multiple of {rounds}); use 1f1b, or a micro-batch count that is")
    return None


def schedules_for(pp: int, m: int, layers_per_rank: int) -> list[str]:
    """The schedules the planner tries: 1f1b where torch runs it (m >= pp), else gpipe (the same
    memory and bubble with m < pp); interleaved where each rank's blocks split into 2 chunks."""
    if pp == 1:
        return ["1f1b"]
    out = ["1f1b"] if m >= pp else ["gpipe"]
    if layers_per_rank >= VIRTUAL and interleaved_problem(pp, m) is None:
        out.append("interleaved")
    return out


def batch_schedules(pp: int, layers_per_rank: int, pinned: str | None) -> list[str]:
    """Pipeline schedules searched at a global batch (the micro-batch count varies with the
    micro-batch): 1f1b (run as gpipe where the count is below pp, as torch's 1F1B needs m >= pp,
    pipeline.schedules_for) and interleaved where each rank's blocks make two chunks."""
    if pinned:
        return [pinned]
    if pp == 1:
        return ["1f1b"]
    return ["1f1b"] + (["interleaved"] if layers_per_rank >= VIRTUAL else [])


__getattr__ = lazy_names("hybrid.layout.pipeline", {"PipelineLayout": ("hybrid.layout.pipeline", "StageSplit")})
