"""DDP: a full replica per rank, bucketed all-reduce of gradients (torch DistributedDataParallel)."""
from __future__ import annotations

import math

from dataclasses import dataclass

from ..errors import HybridError
from ..units import MiB
from .placement import Placement, draft, optimizer_state_bytes, param_bytes, step_scratch_bytes
from .base import Comm, Family, FamilyConfig


@dataclass(frozen=True)
class DDPConfig(FamilyConfig):
    """DistributedDataParallel's knobs."""

    bucket_cap_mb: float = 25.0
    """All-reduce bucket size in MiB (torch default 25); hybrid passes it, so torch's 1 MiB first
    bucket (used only when bucket_cap_mb is None) is not made."""
    gradient_as_bucket_view: bool = True
    """Gradients are views into the buckets (one gradient copy instead of two)."""
    static_graph: bool = False
    """DDP static_graph (same used parameters every step)."""

    def __post_init__(self):
        v = self.bucket_cap_mb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1e6:
            raise HybridError(f"bucket_cap_mb must be a positive number of MiB, got {v!r}")

    @property
    def bucket_bytes(self) -> int:
        """The bucket cap as DDP computes it (torch 2.6-2.13: bucket_cap_mb x 1024 x 1024)."""
        return int(self.bucket_cap_mb * MiB)


class DDPFamily(Family):
    name = "ddp"
    config = DDPConfig
    runtime_module = "hybrid.runtime.backends.ddp"
    fault_tolerant = True
    handoff_module = "hybrid.handoff.ddp"
    runs_bitsandbytes_base = True

    def checkpoint_shards(self, dims):
        """Every data-parallel replica holds (and loads) its whole tensor-parallel share."""
        return 1

    def validate(self, s, where):
        if s.shard not in ("none", "1"):
            raise HybridError(f"{where}: ddp does not shard; use shard: none")

    def sharded_optimizer(self, s):
        return False

    def applied_wrap(self, layout, staged):
        # torch's DDP takes no DTensor parameters and breaks under a pipeline schedule: replication
        # over tensor-parallel groups or of a stage runs through FSDP2 (runtime/backends/ddp.py wrap),
        # one unit per block and the root, kept gathered from forward to backward
        if layout.dims.tp > 1 or staged:
            return "fsdp", "blocks+root", False, False
        return "ddp", "buckets", None, True

    def states_split(self, layout, n):
        return 1, False

    def priced_strategy(self, s, applied):
        # replication through FSDP2 (applied_wrap) is priced as that wrap: whole parameters (a shard
        # group of 1), kept gathered from forward to backward, MixedPrecisionPolicy's casts
        if applied is None or applied.wrap != "fsdp":
            return s
        from dataclasses import replace
        from .fsdp import FSDPConfig
        return replace(s, name=f"{s.name}-through-fsdp2", family="fsdp",
                       config=FSDPConfig(reshard_after_forward=applied.reshards))

    def problems(self, layout):
        s, d = layout.dp, layout.dims
        if d.cp > 1 and d.tp > 1:
            from .placement import NotApplicable
            return [NotApplicable(f"{s.name} with tp and cp: replicas of tensor-parallel groups run through FSDP2's "
                                  "replication, which has no cp dimension here; use an fsdp strategy with tp and cp",
                                  "cp")]
        return []

    def placement(self, s, p, spec, n, cl, stage=None) -> Placement:
        b = spec.bytes
        grads = p.trainable_params * b.grad
        place = draft(params=param_bytes(p, spec), optimizer=optimizer_state_bytes(p, spec),
                     scratch=sum(step_scratch_bytes(p, spec)),
                     autocast=spec.precision in ("bf16-mixed", "fp16-mixed"), grads_end=grads)
        if s.config.gradient_as_bucket_view:
            place.grads_start = grads          # grads are views into buckets allocated at DDP init
            if spec.gradient_accumulation > 1:
                # ... but inside a window (no_sync) autograd's own gradients accumulate beside the buckets
                # until the last backward copies them in (runtime/backends/ddp._EmulatedDDP, measured live)
                place.grads_start += grads
                place.notes.append("gradient accumulation: DDP's no_sync gradients are kept beside its buckets")
        else:
            if spec.gradient_accumulation > 1:
                place.grads_start = grads      # .grad accumulates across the window (no_sync)
            place.buffers_start = place.buffers_mid = place.buffers_end = place.buffers_step = grads
            place.notes.append("DDP buckets hold a second gradient copy (gradient_as_bucket_view=False)")
        return Placement.of(place)



    def comm(self, s, p, spec, cl, n, links):
        # all-reduce of the gradients over the world, bucketed, in the window's last backward
        grad_bytes = p.trainable_params * spec.bytes.grad
        buckets = max(1, math.ceil(grad_bytes / s.config.bucket_bytes))
        sync = links.collective("all_reduce", grad_bytes, cl.world_size, buckets)
        copied = 0.0 if s.config.gradient_as_bucket_view or cl.world_size == 1 else 2 * grad_bytes
        return Comm(sync_bwd=sync, sync_tail=sync / buckets, copied_sync=copied)

    def host(self, s, p, spec, cl, n, stage=None):
        from .host import Host, param_tensors
        # one all-reduce per bucket at the window's end (as comm counts them); the optimizer steps
        # each local tensor in a loop: torch's foreach kernels take CUDA tensors only
        # (torch 2.6-2.13 torch/optim/optimizer.py _default_to_fused_or_foreach)
        grad_bytes = p.trainable_params * spec.bytes.grad
        buckets = max(1, math.ceil(grad_bytes / s.config.bucket_bytes)) if cl.world_size > 1 else 0
        return Host(calls=buckets, tensors=len(param_tensors(p, stage)))

FAMILY = DDPFamily()
