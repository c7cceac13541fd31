"""MemoryBreakdown: per-GPU bytes by category at the peak, plus host (CPU) bytes (pure)."""
from __future__ import annotations

from dataclasses import dataclass, field

from ...config.cluster import ALLOCATOR_HEADROOM, EXPANDABLE_HEADROOM, headroom  # noqa: F401 - the reserve's figures
from ...units import MiB, fmt_bytes

# torch's caching allocator (c10/cuda/CUDACachingAllocator.cpp): requests up to kSmallSize (1 MiB)
# are packed into kSmallBuffer (2 MiB) segments, requests of 1-10 MiB split a kLargeBuffer (20 MiB)
# segment, larger ones get a segment of their size rounded up to kRoundLarge (2 MiB); a free block
# is reused only by the stream that allocated it; expandable segments map physical memory in 2 MiB
# (small pool) and 20 MiB (large pool) pages.
SMALL_SEGMENT = 2 * MiB
LARGE_SEGMENT = 20 * MiB
ALLOCATOR_STREAMS = 3
"""Streams that allocate at the peak, each with its own cached blocks: compute, and the data-parallel
all-gather and reduce-scatter streams (FSDP2's and DeepSpeed's side streams)."""


def fragmentation_floor(cluster, transient: float) -> int:
    """Reserved bytes the allocator cannot hand back even under pressure, beside the live tensors.

    When a request finds no cached block and cudaMalloc fails, the allocator frees every cached
    block that is a whole segment and retries (release_cached_blocks: "Free all non-split cached
    blocks"); only then does it raise OOM, whose message notes that "the only remaining cached
    memory is split from a larger block that is partially in-use". So a full GPU compresses the
    roomy-GPU headroom down to the free parts of split segments:
    - default allocator: a freed per-block transient (`transient`: the largest tensor a block
      makes and frees in forward, e.g. the MLP intermediate) whose segment a smaller live tensor
      was carved from keeps its remainder (should_split: remainders over 1 MiB become free blocks
      of the same segment), plus per stream one part-used 20 MiB segment (1-10 MiB requests) and
      one part-used 2 MiB small segment;
    - expandable segments: free pages are unmapped on the retry, so only the part-used 20 MiB
      pages at the two ends of a free range stay, per stream.
    CPU ranks have no caching allocator: 0."""
    if not cluster.gpu.is_cuda:
        return 0
    if cluster.expandable_segments:
        return int(ALLOCATOR_STREAMS * 2 * LARGE_SEGMENT)
    return int(transient + ALLOCATOR_STREAMS * (LARGE_SEGMENT + SMALL_SEGMENT))


def overhead_bytes(cluster, tensors: float, transient: float = 0) -> float:
    """The runtime's share on top of live tensors: CUDA context and workspaces, allocator slack
    (the calibrated headroom, never less than what the allocator cannot reclaim)."""
    return cluster.gpu.cuda_context_bytes + max(headroom(cluster) * tensors, fragmentation_floor(cluster, transient))


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
    floor: int = 0
    """Of the allocator slack, what a full GPU cannot reclaim (fragmentation_floor): the part of
    `overhead` beyond the context that must fit too."""
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
    def needed(self) -> int:
        """What must fit on the GPU: the live tensors at the peak, the CUDA context and the
        fragmentation floor (the roomy-GPU headroom compresses down to it under pressure)."""
        return self.allocated + self.context + self.floor

    @property
    def largest(self) -> str:
        return max(CATEGORIES, key=lambda c: getattr(self, c) or 0)

    def to_dict(self) -> dict:
        d = {c: getattr(self, c) for c in CATEGORIES}
        d["total"] = self.total
        return d

    @classmethod
    def from_tensors(cls, parts: dict, cluster, transient: float = 0, **kw) -> "MemoryBreakdown":
        """From bytes per tensor category (a tracer's count), adding the runtime overhead the
        same way the analytic model does (`transient`: see fragmentation_floor)."""
        tensors = sum(v for v in parts.values() if v)
        return cls(**{c: int(parts[c]) for c in CATEGORIES if c != "overhead"},
                   overhead=int(overhead_bytes(cluster, tensors, transient)), context=cluster.gpu.cuda_context_bytes,
                   floor=fragmentation_floor(cluster, transient), **kw)

    def describe_largest(self) -> str:
        c = self.largest
        return f"{c} {fmt_bytes(getattr(self, c))}"
