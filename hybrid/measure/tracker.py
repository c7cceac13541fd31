"""Live-tensor accounting at the dispatcher: every storage an op creates is recorded with its size,
its birth and death time and a category, so the peak and what it was made of can be read after the
run. Works on real tensors (CPU or CUDA) and on fake ones (nothing allocated), and through tensor
subclasses (DTensor) by their inner tensors.

Categories are first guessed from context (the phase the driver is in, the op's namespace) and then
corrected by identity at sync points (`relabel`): whatever is a parameter, a gradient or optimizer
state at that moment is labelled so for its whole life. Storages resized in place (FSDP2 frees and
re-allocates unsharded parameters with `UntypedStorage.resize_`) count as freed and re-born.
"""
from __future__ import annotations

import weakref
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import (TorchDispatchMode, is_traceable_wrapper_subclass,
                                         is_traceable_wrapper_subclass_type)
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

from ..estimation.memory.breakdown import CATEGORIES

_COMM_NAMESPACES = {"_c10d_functional", "c10d", "fsdp", "_dtensor"}


def storages_of(t) -> list:
    """Untyped storages behind a tensor, looking through wrapper subclasses such as DTensor.
    Meta tensors hold no memory and are skipped (fake tensors report their simulated device)."""
    out, todo = [], [t]
    while todo:
        x = todo.pop()
        if is_traceable_wrapper_subclass(x):
            attrs, _ = x.__tensor_flatten__()
            todo.extend(v for v in (getattr(x, a) for a in attrs) if isinstance(v, torch.Tensor))
        elif isinstance(x, torch.Tensor) and x.device.type != "meta":
            out.append(x.untyped_storage())
    return out


class _Owner:
    """A storage's label, shared by all records of that storage."""
    __slots__ = ("label",)

    def __init__(self, label):
        self.label = label


@dataclass
class _Record:
    nbytes: int
    born: int
    died: int | None
    owner: _Owner
    op: str = ""
    phase: str = ""


class MemoryTracker(TorchDispatchMode):
    """Use as a context manager around training steps; set `phase` as the steps progress."""

    def __init__(self):
        super().__init__()
        self.records: list[_Record] = []
        self._live = WeakIdKeyDictionary()      # storage -> (_Record, _Owner)
        self._refs: dict[int, weakref.ref] = {}
        self.clock = 0
        self.current = 0
        self.peak = 0
        self.peak_time = 0
        self.peak_phase = ""
        self._reset_clock = 0
        self._phase = "setup"
        self.phases: list[tuple[int, str]] = [(0, "setup")]   # (clock, phase) at each change
        self._position = "pre"
        self.positions: list[tuple[int, str]] = [(0, "pre")]  # (clock, position) at each change
        self.marks: list[tuple[int, str, str]] = [(0, "setup", "pre")]
        """(clock, phase, position) at every setting of the position, repeats included: where each
        phase and each block's run in it starts (segments)."""
        self._orig_resize = None
        self._orig_meta = None
        self._metadata = 0          # inside DTensor's sharding propagation (_patch_metadata)
        self._answers: dict = {}      # moments and segments already read, by the clock they were read at

    @property
    def phase(self) -> str:
        return self._phase

    @phase.setter
    def phase(self, value: str) -> None:
        if self._mark("phase", value):
            self.position = "pre"

    @property
    def position(self) -> str:
        """Where in the phase the step is, by blocks in the order the phase runs them: pre (before
        the first block), first, mid, last (the block running), post (after the last block)."""
        return self._position

    @position.setter
    def position(self, value: str) -> None:
        self.marks.append((self.clock, self._phase, value))
        self._mark("position", value)

    def _mark(self, name: str, value: str) -> bool:
        """Set phase or position, recording the clock of each change in phases / positions."""
        if value == getattr(self, f"_{name}"):
            return False
        setattr(self, f"_{name}", value)
        getattr(self, f"{name}s").append((self.clock, value))
        return True

    # --- bookkeeping -------------------------------------------------------------------------
    def _default_label(self, op) -> str:
        ns = getattr(op, "namespace", "")
        if ns in _COMM_NAMESPACES:
            return "buffers"
        return {"setup": "buffers", "forward": "activations"}.get(self.phase, "temporaries")

    def _open(self, st, label: str, owner: _Owner | None = None, op: str = ""):
        nbytes = st.nbytes()
        owner = owner or _Owner(label)
        self.clock += 1
        rec = _Record(nbytes, self.clock, None, owner, op, self.phase)
        self.records.append(rec)
        self._live[st] = (rec, owner)
        key = id(rec)
        self._refs[key] = weakref.ref(st, lambda _r, rec=rec, key=key: self._close(rec, key))
        self._grow(nbytes)

    def _close(self, rec: _Record, key=None):
        if rec.died is None:
            self.clock += 1
            rec.died = self.clock
            self.current -= rec.nbytes
        if key is not None:
            self._refs.pop(key, None)

    def _grow(self, nbytes: int):
        self.current += nbytes
        if self.current > self.peak:
            self.peak, self.peak_time, self.peak_phase = self.current, self.clock, self.phase

    def register(self, tensors, label: str):
        """Count tensors that existed before tracking began (parameters, states)."""
        for t in tensors:
            for st in storages_of(t):
                if st not in self._live and st.nbytes() > 0:
                    self._open(st, label)

    def relabel(self, tensors, label: str):
        """Everything stored in these tensors is `label`, for its whole life."""
        for t in tensors:
            for st in storages_of(t):
                entry = self._live.get(st)
                if entry is None:
                    if st.nbytes() > 0:
                        self._open(st, label)
                else:
                    entry[1].label = label

    def reset_peak(self):
        """Start counting the peak from now (what is alive stays counted)."""
        self.peak, self.peak_time, self.peak_phase = self.current, self.clock, self.phase
        self._reset_clock = self.clock

    # --- the dispatch hook -------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(is_traceable_wrapper_subclass_type(t) for t in types):
            # a wrapper subclass (DTensor) runs its own ops on its inner tensors: declining lets it
            # run them with this mode still active, so its handlers' temporaries (loss_parallel's
            # log-softmax and nll backward, a redistribution before a local op) are counted
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if self._metadata:          # DTensor's sharding propagation: fake global-shape tensors, never allocated
            return out
        if getattr(func, "namespace", "") in _COMM_NAMESPACES:
            # whatever a collective reads or writes is a communication buffer, unless it is
            # already known as model state (DDP buckets become grads when relabelled later)
            for t in tree_flatten((args, kwargs))[0]:
                if isinstance(t, torch.Tensor):
                    for st in storages_of(t):
                        entry = self._live.get(st)
                        if entry is not None and entry[1].label in ("activations", "temporaries"):
                            entry[1].label = "buffers"
        label = None
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            for st in storages_of(t):
                if st not in self._live and st.nbytes() > 0:
                    label = label or self._default_label(func)
                    self._open(st, label, op=str(func))
        return out

    def _on_resize(self, st, size):
        entry = self._live.get(st)
        self._orig_resize(st, size)
        if entry is None:
            if size > 0:
                self._open(st, "buffers")
            return
        rec, owner = entry
        self._close(rec)
        if size > 0:
            self._open(st, owner.label, owner)

    def __enter__(self):
        self._orig_resize = torch.UntypedStorage.resize_
        tracker = self

        def resize_(st, size):
            tracker._on_resize(st, size)

        torch.UntypedStorage.resize_ = resize_
        self._patch_metadata()
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._orig_resize
        if self._orig_meta is not None:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
            ShardingPropagator._propagate_tensor_meta_non_cached = self._orig_meta
        return super().__exit__(*exc)

    def _patch_metadata(self):
        """DTensor derives an op's output shape by running it on fake tensors of the global shape
        (ShardingPropagator._propagate_tensor_meta_non_cached): with this mode active inside DTensor's
        dispatch those ops reach it too; they allocate nothing and are not counted."""
        self._orig_meta = None
        try:
            from torch.distributed.tensor._sharding_prop import ShardingPropagator
        except ImportError:          # a torch without DTensor
            return
        original = self._orig_meta = ShardingPropagator._propagate_tensor_meta_non_cached
        tracker = self

        def propagate(*args, **kwargs):
            tracker._metadata += 1
            try:
                return original(*args, **kwargs)
            finally:
                tracker._metadata -= 1
        ShardingPropagator._propagate_tensor_meta_non_cached = propagate

    # --- results -----------------------------------------------------------------------------
    def breakdown_at(self, time: int) -> dict[str, int]:
        out = defaultdict(int)
        for r in self.records:
            if r.born <= time and (r.died is None or r.died > time):
                out[r.owner.label] += r.nbytes
        return {c: out.get(c, 0) for c in CATEGORIES if c != "overhead"}

    def peak_breakdown(self) -> dict[str, int]:
        return self.breakdown_at(self.peak_time)

    def _timeline(self):
        """(clock, live bytes by label) after each instant's births and deaths, from reset_peak on:
        one sweep over the records."""
        events = []
        for r in self.records:
            events.append((r.born, r.nbytes, r.owner.label))
            if r.died is not None:
                events.append((r.died, -r.nbytes, r.owner.label))
        events.sort(key=lambda e: e[0])
        running: dict[str, int] = defaultdict(int)
        i = 0
        while i < len(events):
            t = events[i][0]
            while i < len(events) and events[i][0] == t:
                running[events[i][2]] += events[i][1]
                i += 1
            if t >= self._reset_clock:
                yield t, running

    def peak_replacing(self, labels: set[str], layout) -> tuple[int, dict[str, int], str]:
        """The peak over the recorded timeline when the bytes labelled `labels` are replaced by
        `layout(phase, progress) -> {label: bytes}` (another library's state layout on the same
        compute; progress runs 0 -> 1 through the phase): one sweep over births and deaths.
        Returns (peak bytes, breakdown, phase)."""
        phases, pi = self.phases, 0
        best = (-1, {}, "")
        for t, running in self._timeline():
            while pi + 1 < len(phases) and phases[pi + 1][0] <= t:
                pi += 1
            start = phases[pi][0]
            end = phases[pi + 1][0] if pi + 1 < len(phases) else self.clock
            parts = {c: running.get(c, 0) for c in CATEGORIES if c != "overhead" and c not in labels}
            parts.update(layout(phases[pi][1], (t - start) / max(end - start, 1)))
            total = sum(parts.values())
            if total > best[0]:
                best = (total, parts, phases[pi][1])
        return best

    def moments(self, exclude=frozenset()) -> dict[tuple[str, str], tuple[int, dict[str, int]]]:
        """The largest live bytes (and their breakdown) at each moment of the step since
        reset_peak: (phase, position) -> (bytes, {category: bytes}). For a stack of identical
        blocks each moment holds a + L x b bytes of every category (L blocks), and within a phase
        memory is linear in the block index, so its maximum is at these moments: two traces with
        different block counts give every moment for any L (traced.py: extrapolate). `exclude`:
        categories left out of the bytes compared (those another layout replaces: peak_replacing);
        the breakdown still holds them. Kept until the clock moves (candidates sharing a trace ask
        again)."""
        key = ("moments", frozenset(exclude), self.clock)
        if key not in self._answers:
            self._answers[key] = self._moments(frozenset(exclude))
        return self._answers[key]

    def _moments(self, exclude: frozenset) -> dict[tuple[str, str], tuple[int, dict[str, int]]]:
        marks = sorted([(c, 0, p) for c, p in self.phases] + [(c, 1, p) for c, p in self.positions])
        best: dict[tuple[str, str], tuple[int, dict[str, int]]] = {}
        phase, position, mi = "setup", "pre", 0
        for t, running in self._timeline():
            while mi < len(marks) and marks[mi][0] <= t:
                if marks[mi][1] == 0:
                    phase = marks[mi][2]
                else:
                    position = marks[mi][2]
                mi += 1
            parts = {c: running.get(c, 0) for c in CATEGORIES if c != "overhead"}
            total = sum(v for c, v in parts.items() if c not in exclude)
            key = (phase, position)
            if total > best.get(key, (-1,))[0]:
                best[key] = (total, parts)
        return best

    def segments(self) -> list[tuple[str, str, list[dict[str, int]]]]:
        """The timeline since reset_peak cut at every mark (each phase change, and each block's
        start within a phase: marks): (phase, position, [live bytes by category after each event
        of the segment]), in order, empty segments included. An event at a mark's clock belongs to
        the segment the mark starts, as in peak_replacing and moments. Kept until the clock moves."""
        key = ("segments", self.clock)
        if key not in self._answers:
            self._answers[key] = self._segments()
        return self._answers[key]

    def _segments(self) -> list[tuple[str, str, list[dict[str, int]]]]:
        out, mi, marks = [], 0, self.marks
        current = None
        for t, running in self._timeline():
            while mi < len(marks) and marks[mi][0] <= t:
                current = (marks[mi][1], marks[mi][2], [])
                out.append(current)
                mi += 1
            current[2].append({c: running.get(c, 0) for c in CATEGORIES if c != "overhead"})
        return out


def allocator_net_bytes(fn) -> tuple[object, int]:
    """(fn(), bytes the CPU allocator holds afterwards that it did not before): every allocation
    and free c10's CPU allocator reports to the profiler while fn runs, summed. The count for
    code the dispatch-level MemoryTracker cannot watch: torch.compile runs eagerly under a
    non-infra TorchDispatchMode ("non-infra torch dispatch mode present, this is not supported
    today in torch.compile"), while inductor's compiled kernels allocate their buffers through
    the allocator directly (empty_strided_cpu), below the dispatcher."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    return out, sum(k.self_cpu_memory_usage for k in prof.key_averages())
