"""MemoryBreakdown: per-GPU bytes by category at the peak, plus host (CPU) bytes (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ..units import fmt_bytes

ALLOCATOR_HEADROOM = 0.28
"""Reserved over allocated with torch's default caching allocator (no expandable segments), as a
fraction of allocated: block rounding and fragmentation by transient buffers of varying size.
Calibrated on published pairs of peak active and peak reserved (benchmarks/public_runs.yaml:
torchtitan PR #165, FSDP2 on Llama-2-7B shape, 8 H100: 22.73 -> 31.02 GiB with full AC (+36%),
49.54 -> 59.41 GiB with per-op SAC (+20%); the mean is taken)."""
EXPANDABLE_HEADROOM = 0.10
"""The same with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, which maps physical pages into
one growing segment per stream, so freed space is reused whatever the request size. Calibrated on
torchtitan's December 2024 Llama 3.1 8B runs, eager and compiled (expandable segments set by its
launcher), where only reserved is published: the median of published reserved / our allocated, minus one
(`benchmarks/public_runs.py --calibrate`)."""


def headroom(cluster) -> float:
    """Reserved over allocated for this cluster's allocator setting, or its `--headroom`."""
    if cluster.headroom is not None:
        return cluster.headroom
    return EXPANDABLE_HEADROOM if cluster.expandable_segments else ALLOCATOR_HEADROOM


def overhead_bytes(cluster, tensors: float) -> float:
    """The runtime's share on top of live tensors: CUDA context and workspaces, allocator slack."""
    return cluster.gpu.cuda_context_bytes + headroom(cluster) * tensors


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
    context: int = 0
    """The CUDA context and library workspaces inside `overhead` (the rest is allocator slack)."""
    phase: str = ""
    """When the peak happens: forward, backward, step."""
    notes: tuple[str, ...] = field(default=())

    @property
    def tensors(self) -> int:
        """Everything but the runtime overhead: what a tracer of live tensors would count."""
        return sum(getattr(self, c) or 0 for c in CATEGORIES if c != "overhead")

    @property
    def total(self) -> int:
        """What the process takes on the device: reserved memory plus the CUDA context."""
        return self.tensors + self.overhead

    @property
    def allocated(self) -> int:
        """Predicted torch.cuda.max_memory_allocated: the live tensors at the peak."""
        return self.tensors

    @property
    def reserved(self) -> int:
        """Predicted torch.cuda.max_memory_reserved: allocated plus the allocator's slack."""
        return self.total - self.context

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
                   overhead=int(overhead_bytes(cluster, tensors)), context=cluster.gpu.cuda_context_bytes, **kw)

    def describe_largest(self) -> str:
        c = self.largest
        return f"{c} {fmt_bytes(getattr(self, c))}"
