"""The batch shape of one layout at a fixed global batch (pure, no torch).

The global batch (sequences per optimizer step) is the user's hyperparameter; how a layout trains
it is its own: micro-batch x gradient accumulation x its data-parallel ranks = the global batch.
For each layout the search tries the micro-batches that make that product exact (the divisors of
the per-rank batch, powers of two among them), judges each with the planner's memory and cost
model, and keeps the fastest that fits, with the largest that fits beside it. Layouts whose
data-parallel ranks do not divide the global batch are rejected with the reason, so every row of
a plan trains the same global batch.
"""
from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Callable

from .candidate import BatchChoice, Candidate
from ..errors import HybridError
from ..layout.dims import divisors

if TYPE_CHECKING:
    from ..layout.layout import Layout


def micro_batch_options(per_rank: int, pinned: int | None = None) -> list[int]:
    """The micro-batches that make micro-batch x accumulation = the per-rank batch exactly: its
    divisors (the powers of two among them), ascending; a pinned one alone when it divides."""
    if pinned is not None:
        return [pinned] if per_rank % pinned == 0 else []
    return divisors(per_rank)


def search(judge: Callable[..., "Candidate"], layout: "Layout", spec, estimator=None,
           micro_batch: int | None = None, pinned_schedule: bool = False) -> "Candidate":
    """The layout at the global batch spec.global_batch: its fastest fitting micro-batch, as a
    Candidate carrying `batch`.

    judge(layout, spec, estimator) is the planner's judge of one layout at one batch shape. Memory
    grows with the micro-batch except where a single micro-batch ends the accumulation (FSDP keeps
    no unsharded gradients then), so the search walks the options upward, stops after the first
    that does not fit and still judges the whole per-rank batch; an expensive estimator (traced,
    measured) runs once, on the choice. micro_batch pins the micro-batch; an unpinned 1f1b runs as
    gpipe below pp micro-batches."""
    gb = spec.global_batch
    dp = layout.dims.dp_size        # the tp and cp ranks of a group read the same sequences
    pp = layout.dims.pp
    def not_applicable(reason: str) -> "Candidate":
        c = judge(layout, replace(spec, micro_batch=1, gradient_accumulation=1), None)
        return replace(c, memory=None, fits=False, cost=None, stage_memory=(), tight=False,
                       reason=f"not applicable: {reason}")

    if gb % dp:
        return not_applicable(f"the global batch {gb} is not a multiple of this layout's {dp} data-parallel ranks "
                              f"(choose a global batch divisible by {dp})")
    per_rank = gb // dp
    options = micro_batch_options(per_rank, micro_batch)
    if not options:
        return not_applicable(f"micro-batch {micro_batch} does not divide the {per_rank} sequences per "
                              f"data-parallel rank (global batch {gb} / {dp} ranks); use a divisor of {per_rank}")
    judged: dict[int, Candidate] = {}

    def at(mb: int) -> "Candidate":
        if mb not in judged:
            m = per_rank // mb
            lay = layout
            if layout.schedule == "1f1b" and m < pp and not pinned_schedule:
                lay = replace(layout, schedule="gpipe")      # torch's 1F1B needs m >= pp; gpipe runs fewer
            judged[mb] = judge(lay, replace(spec, micro_batch=mb, gradient_accumulation=m), None)
        return judged[mb]

    for mb in options:
        if not at(mb).fits:
            break
    at(options[-1])
    fitting = [mb for mb in options if mb in judged and judged[mb].fits]
    roomy = [mb for mb in fitting if not judged[mb].tight]       # as choose(): tight only when none has room
    if fitting:
        best = min(roomy or fitting, key=lambda mb: (judged[mb].cost.time_per_token, -mb))
        chosen = judged[best]
    else:
        usable = [mb for mb in options if judged.get(mb) is not None and judged[mb].memory is not None]
        best = min(usable, key=lambda mb: judged[mb].memory.total) if usable else options[0]
        chosen = judged[best]
    if estimator is not None and chosen.memory is not None:
        chosen = judge(replace(chosen.layout, pipeline=None), chosen.spec, estimator)
    choice = BatchChoice(gb, best, per_rank // best, max(fitting) if fitting else None, micro_batch is not None)
    return replace(chosen, batch=choice)


def global_batch_of(global_batch: int | None, global_batch_tokens: int | None, seq_len: int,
                    gradient_accumulation: int | None = None, cli: bool = True) -> int | None:
    """The job's global batch in sequences from --global-batch or --global-batch-tokens (a whole
    number of sequences of seq_len tokens); None when neither is given. Accumulation is then
    chosen per layout, so it cannot be given too (the micro-batch can: it pins the search)."""
    name = (lambda flag: f"--{flag.replace('_', '-')}") if cli else (lambda flag: f"{flag}=")
    for flag, v in (("global_batch", global_batch), ("global_batch_tokens", global_batch_tokens)):
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or not 1 <= v <= 10**12):
            raise HybridError(f"{name(flag)} must be a positive integer (at most 1e12), got {v!r}")
    if global_batch is not None and global_batch_tokens is not None:
        raise HybridError(f"give {name('global_batch')} (sequences) or {name('global_batch_tokens')}, not both")
    if global_batch_tokens is not None:
        if global_batch_tokens % seq_len:
            raise HybridError(f"{name('global_batch_tokens')} {global_batch_tokens} is not a whole number of "
                              f"{seq_len}-token sequences: use a multiple of the sequence length, e.g. "
                              f"{max(1, global_batch_tokens // seq_len) * seq_len}")
        global_batch = global_batch_tokens // seq_len
    if global_batch is not None and gradient_accumulation is not None:
        raise HybridError(f"{name('gradient_accumulation')} is chosen per layout at a global batch (micro-batch x "
                          f"accumulation x data-parallel ranks = {global_batch}); drop it, or pin "
                          f"{name('micro_batch')}")
    return global_batch
