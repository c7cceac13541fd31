"""MemoryBreakdown: per-GPU bytes by category at the peak, plus host (CPU) bytes (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import fmt_bytes

ALLOCATOR_HEADROOM = 0.05
"""Caching-allocator slack over live tensors (block rounding, fragmentation): reserved exceeds
allocated by a few percent in steady-state training. Assumption (5%) until measured on a GPU:
benchmarks/gpu_memory_check.py measures it where a GPU is lent."""


def overhead_bytes(cluster, tensors: float) -> float:
    """The runtime's share on top of live tensors: CUDA context and workspaces, allocator slack."""
    return cluster.gpu.cuda_context_bytes + ALLOCATOR_HEADROOM * tensors


CATEGORIES = ("params", "grads", "optimizer", "activations", "temporaries", "buffers", "overhead")
"""params: parameter storage on the GPU (sharded or whole, incl. a persistent low-precision copy);
grads: gradient storage; optimizer: optimizer states and fp32 master copies held by the optimizer;
activations: tensors saved for backward by the blocks; temporaries: logits, loss, autocast weight
casts, optimizer-step scratch, recomputation; buffers: communication buffers (DDP buckets, FSDP
all-gathered units and reduce-scatter inputs, DeepSpeed buckets, hpZ secondary copy);
overhead: the runtime's share (CUDA context, allocator headroom), not a tensor."""


@dataclass(frozen=True)
class MemoryBreakdown:
    """Bytes per GPU at the estimated peak. `activations` is None when it cannot be known (a model
    given only as a parameter count); the total then covers the known parts and says so."""

    params: int
    grads: int
    optimizer: int
    activations: int | None
    temporaries: int
    buffers: int
    overhead: int
    cpu: int = 0
    """Host memory per rank for offloaded state (pinned buffers included)."""
    model_states: int = 0
    """Parameters + gradients + optimizer state at their largest (all gradients present), whatever
    the moment of the peak: the figure the ZeRO paper tabulates."""
    phase: str = ""
    """When the peak happens: forward, backward, step."""
    notes: tuple[str, ...] = field(default=())

    @property
    def tensors(self) -> int:
        """Everything but the runtime overhead: what a tracer of live tensors would count."""
        return sum(getattr(self, c) or 0 for c in CATEGORIES if c != "overhead")

    @property
    def total(self) -> int:
        return self.tensors + self.overhead

    @property
    def largest(self) -> str:
        return max(CATEGORIES, key=lambda c: getattr(self, c) or 0)

    def to_dict(self) -> dict:
        d = {c: getattr(self, c) for c in CATEGORIES}
        d["total"] = self.total
        return d

    @classmethod
    def from_tensors(cls, parts: dict, cluster, **kw) -> "MemoryBreakdown":
        """From bytes per tensor category (a tracer's count), adding the runtime overhead the
        same way the analytic model does."""
        tensors = sum(v for v in parts.values() if v)
        return cls(**{c: int(parts[c]) for c in CATEGORIES if c != "overhead"},
                   overhead=int(overhead_bytes(cluster, tensors)), **kw)

    def describe_largest(self) -> str:
        c = self.largest
        return f"{c} {fmt_bytes(getattr(self, c))}"
