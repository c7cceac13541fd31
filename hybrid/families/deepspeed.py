"""DeepSpeed ZeRO stage 1/2/3 (with offload and ZeRO++ hpZ): memory layout, communication, config."""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..config.spec import recomputed_blocks
from ..errors import HybridError
from ..config.cluster import HOST_STEP_RATE, PCIE_BW
from ..layout.dims import validate_shard_size
from .placement import (FP32, Placement, draft, NotApplicable, gathered_bytes, optimizer_state_bytes, param_bytes,
                        step_scratch_bytes)
from .base import Comm, Family, HostOffloadConfig

SUB_GROUP_SIZE = 1_000_000_000
"""DeepSpeed ZeRO-3 `sub_group_size` default: elements stepped (and fp32 grads made) at a time."""


def bucket_sizes(s, hidden: int | None) -> tuple[int, int, int]:
    """(reduce bucket, ZeRO-3 prefetch, ZeRO-3 persistence threshold) in elements: the preset's, or
    HF Trainer's "auto" rules (hidden^2, 0.9 hidden^2, 10 hidden), or DeepSpeed's own defaults
    (5e8, 5e7, 1e5) when the hidden size is unknown. The one source for the config and the memory."""
    h = hidden
    reduce = s.config.reduce_bucket_size or (h * h if h else 500_000_000)
    prefetch = s.config.prefetch_bucket_size or (int(0.9 * h * h) if h else 50_000_000)
    persist = s.config.param_persistence_threshold
    if persist is None:
        persist = 10 * h if h else 100_000
    return reduce, prefetch, persist


def persistent_params(p, threshold: int) -> int:
    """ZeRO-3 stage3_param_persistence_threshold: tensors under it are never partitioned."""
    d = p.decoder
    if d is None:
        return 0
    small = [m for m in d.block_matrices() if (m[0] * (m[1] if len(m) == 2 else 1)) < threshold]
    return d.layers * sum(m[0] * (m[1] if len(m) == 2 else 1) for m in small) + d.hidden



def over_bucket(p, bucket: int) -> int:
    """Elements of the largest block parameter over the reduce bucket (0 where none is): ZeRO-1/2 reduce such a
    gradient on its own (extra_large_param_to_reduce) once the next one arrives."""
    d = p.decoder
    shapes = d.block_matrices() if d is not None else [(p.largest_param,)]
    largest = max((math.prod(m) for m in shapes), default=0)
    return largest if largest > bucket else 0


def stage3_gathered(p, s, spec, persist: int, prefetch: int) -> tuple[float, float]:
    """(at the forward/backward turn, at the start of the blocks' backward) the elements ZeRO-3 holds gathered,
    persistent ones aside (they are whole parameters). DeepSpeed's PartitionedParameterCoordinator, once its
    trace of the step's module order is complete (from the second step), releases a module's parameters after
    its forward only if the modules that follow, up to their next use, hold max_reuse_distance elements or more
    (__params_to_release), and after its backward when nothing follows that uses them. A block's next use is its
    own backward (with checkpointing, its recomputed forward): between them the later blocks forward, backward,
    and forward again where they are recomputed (2 or 3 B each), the head and final norm both ways (2 H), and
    its own block (B: with checkpointing the rest of its forward and its recomputed forward up to the module,
    B less the module; without, the rest of its forward and of its backward before the module, 0 to 2 B). So
    the last blocks within the distance stay gathered into backward, with the head, and the input embedding
    where the whole step is within it (a tied one is the head's); each is released after its backward.
    max_live_parameters caps only the prefetch: up to prefetch_bucket_size elements not yet gathered are
    fetched ahead (_fetch_sub_module_impl)."""
    L, B, d, R = p.num_blocks, p.block_params, p.decoder, s.config.max_reuse_distance
    live = s.config.max_live_parameters
    if not L or d is None:                      # no blocks read: the largest layer and R / 2 around the turn
        largest = p.largest_layer_params or p.largest_param
        kept = min(p.params, largest + R / 2)
        return kept + min(prefetch, p.params - kept), min(p.params, kept + prefetch)
    block = B - (persistent_params(p, persist) - d.hidden) / L      # a block's gathered elements: norms persist
    head = d.vocab * d.hidden                   # lm_head's weight (the token embedding where tied)
    others = p.params - L * B - d.hidden - head      # position embeddings, and the token embedding if untied
    rerun = recomputed_blocks(spec.activation_checkpointing, L)
    between, kept = 2 * (head + d.hidden), 0    # from the last block on: what lies between its uses
    for i in reversed(range(L)):
        if between + B >= R:
            break
        kept, between = kept + 1, between + (2 + rerun[i]) * B
    step = 2 * (head + d.hidden) + sum(2 + r for r in rerun) * B
    first = step < R                            # the input embeddings: from their forward to their backward
    tied = d.tied and step - 2 * (head + d.hidden) - L * B < R      # a tied head: its backward to the embedding's

    def ahead(held: float, rest: float) -> float:
        return min(prefetch, rest, max(live - held, 0))

    at_turn = head + kept * block + others * first
    in_backward = max(kept, 1) * block + others * first + head * tied
    rest = (L - max(kept, 1)) * block + others * (not first) + head * (d.tied and not tied)
    return (at_turn + ahead(at_turn, (L - kept) * block + others * (not first)),
            in_backward + ahead(in_backward, rest))


def ds_config(strategy, spec, hidden: int | None, world_size: int, gpus_per_node: int,
              cuda: bool = True, gradient_accumulation: int = 1, max_grad_norm: float | None = None) -> dict:
    """Bucket sizes left unset in the catalogue follow HF Trainer's 'auto' rules (hidden^2,
    0.9 hidden^2, 10 hidden); the analytic model uses the same numbers (families.deepspeed.bucket_sizes)."""
    if "stage" not in strategy.family_obj.knobs:
        raise HybridError(f"{strategy.name} is a {strategy.family} strategy, not DeepSpeed ZeRO")
    if spec.precision == "bf16":
        raise HybridError(f"{strategy.name}: DeepSpeed ZeRO keeps an fp32 master copy; use --precision "
                          "bf16-mixed or fp32")
    reduce_bucket, prefetch, persist = bucket_sizes(strategy, hidden)
    zero = {"stage": strategy.config.stage, "contiguous_gradients": True, "overlap_comm": cuda,
            "reduce_bucket_size": reduce_bucket}
    if strategy.config.stage < 3:
        zero["allgather_bucket_size"] = strategy.config.allgather_bucket_size
    else:
        zero["stage3_prefetch_bucket_size"] = prefetch
        zero["stage3_param_persistence_threshold"] = persist
        zero["stage3_max_live_parameters"] = strategy.config.max_live_parameters
        zero["stage3_max_reuse_distance"] = strategy.config.max_reuse_distance
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if strategy.config.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if strategy.config.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if strategy.config.hpz:
        zero["zero_hpz_partition_size"] = gpus_per_node if strategy.config.hpz == "node" else int(strategy.config.hpz)
    out = {
        "train_micro_batch_size_per_gpu": spec.micro_batch,
        "gradient_accumulation_steps": gradient_accumulation,
        "train_batch_size": spec.micro_batch * gradient_accumulation * world_size,
        "bf16": {"enabled": spec.precision == "bf16-mixed"},
        "zero_optimization": zero,
        # the user's torch optimizer is used as given, also with offload
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "gradient_clipping": float(max_grad_norm or 0.0),
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if spec.precision == "fp16-mixed":
        # dynamic loss scaling with torch GradScaler's defaults: 2^16, halve on overflow, double
        # after 2000 clean steps (DeepSpeed's own default window is 1000)
        out["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 2000,
                       "hysteresis": 1, "min_loss_scale": 1}
    return out


@dataclass(frozen=True)
class DeepSpeedConfig(HostOffloadConfig):
    """DeepSpeed ZeRO's knobs (the names of its zero_optimization config)."""

    offload_optimizer: bool = False
    """Optimizer state, fp32 master and the step on the host (stage 2 or 3)."""
    offload_params: bool = False
    """Parameter partitions on the host, copied in per use (stage 3)."""
    stage: int = 0
    """ZeRO stage 1, 2 or 3."""
    hpz: str | None = None
    """ZeRO++ hpZ secondary partition size rule ('node' or a number); None = off (stage 3)."""
    reduce_bucket_size: int | None = None
    """Elements per gradient reduce bucket; None = hidden^2 (HF 'auto'), 5e8 if unknown."""
    allgather_bucket_size: int = 500_000_000
    """ZeRO-1/2 elements per parameter all-gather bucket (DeepSpeed default 5e8)."""
    prefetch_bucket_size: int | None = None
    """ZeRO-3 elements prefetched ahead; None = 0.9 hidden^2 (HF 'auto'), 5e7 if unknown."""
    max_live_parameters: int = 1_000_000_000
    """ZeRO-3 cap on gathered elements alive at once (DeepSpeed default 1e9)."""
    max_reuse_distance: int = 1_000_000_000
    """ZeRO-3 keeps a gathered parameter if it is used again within this many parameter fetches
    (DeepSpeed default 1e9): the last blocks of forward stay gathered into backward."""
    param_persistence_threshold: int | None = None
    """ZeRO-3: params smaller than this stay whole on every rank; None = 10 hidden (HF 'auto')."""

    def __post_init__(self):
        if self.stage not in (1, 2, 3):
            raise HybridError(f"stage must be 1, 2 or 3, got {self.stage!r}")
        if self.offload_params and self.stage != 3:
            raise HybridError(f"offload_params needs stage 3, got stage {self.stage}")
        if self.offload_optimizer and self.stage == 1:
            raise HybridError("DeepSpeed offloads the optimizer only with stage 2 or 3")
        if self.hpz is not None:
            h = str(self.hpz).lower()
            if h != "node" and not (h.isdigit() and int(h) >= 1):
                raise HybridError(f"hpz {self.hpz!r} must be node or a positive integer")
            if self.stage != 3:
                raise HybridError(f"hpz needs stage 3, got stage {self.stage}")
            object.__setattr__(self, "hpz", h)

    def hpz_size(self, cluster) -> int | None:
        """Ranks of the hpZ secondary partition on this cluster; None without hpZ."""
        if self.hpz is None:
            return None
        n = cluster.gpus_per_node if self.hpz == "node" else int(self.hpz)
        validate_shard_size(n, cluster.world_size, cluster.gpus_per_node, cluster.domain)
        return n


class DeepSpeedFamily(Family):
    name = "deepspeed"
    config = DeepSpeedConfig
    runtime_module = "hybrid.runtime.backends.deepspeed"
    handoff_module = "hybrid.handoff.deepspeed"
    emits = "deepspeed"
    keeps_master_copy = True
    torchtitan = False

    def applied_wrap(self, layout, staged):
        return "deepspeed", f"zero stage {layout.dp.config.stage}", None, False

    def problems(self, layout):
        s, d, out = layout.dp, layout.dims, []
        if d.pp > 1:
            # DeepSpeed's own PipelineModule engine is a different runtime (its own schedules and
            # checkpoints): not driven from here, so ZeRO candidates have pp 1
            out.append(NotApplicable(f"{s.family} strategies do not run pipeline stages here; use an fsdp or ddp "
                                     "strategy with pp", "pp"))
        if d.tp > 1:
            # DeepSpeed's AutoTP training path (0.16+) composes with ZeRO 1/2 only, on CUDA, and
            # shards by its own module rules: not driven from here
            out.append(NotApplicable(f"{s.name}: not applicable with tp > 1 (use an fsdp or ddp strategy over the "
                                     "tensor-parallel groups)", "tp"))
        if d.cp > 1:
            # ZeRO partitions over the whole world; DeepSpeed's own sequence parallelism (Ulysses)
            # is a different runtime, not driven from here
            out.append(NotApplicable(f"{s.name}: not applicable with cp > 1 (ZeRO partitions over the whole world, "
                                     "the cp ranks included; use an fsdp or ddp strategy with cp)", "cp"))
        return out

    def validate(self, s, where):
        if s.shard != "world":
            raise HybridError(f"{where}: DeepSpeed ZeRO partitions over the whole world (shard: world); "
                              "for node-local sharding use hpz: node with stage 3, or the fsdp family")

    def checkpoint_shards(self, dims):
        """The portable checkpoint keeps every full fp32 master and state as 1/world shards
        (hybrid/runtime/backends/deepspeed.py `_sharded`)."""
        return dims.world_size

    def default_complexity(self, s):
        base = {1: 1, 2: 2, 3: 6}[s.config.stage] + (1 if s.config.hpz else 0)
        return base + 10 * s.config.offload_optimizer + 2 * s.config.offload_params

    def check_device(self, s, spec, cuda):
        super().check_device(s, spec, cuda)
        if spec.precision == "bf16":
            raise NotApplicable(f"{s.name}: DeepSpeed ZeRO keeps an fp32 master copy; pure bf16 training is "
                                "not one of its modes. Use --precision bf16-mixed, or an fsdp/ddp strategy")
        if getattr(spec, "compile", False):
            raise NotApplicable(f"{s.name}: per-block torch.compile is applied here to fsdp and ddp strategies only "
                                "(DeepSpeed compiles through its own engine.compile); use an fsdp or ddp strategy")
        if spec.optimizer == "muon":
            raise NotApplicable(f"{s.name}: DeepSpeed ZeRO hands the optimizer flat 1-D partitions and Muon "
                                "orthogonalises 2-D matrices; use an fsdp or ddp strategy for --optimizer muon")
        if spec.precision == "fp16-mixed" and not cuda:
            raise NotApplicable(f"{s.name}: DeepSpeed's fp16 mode needs CUDA (its CPU accelerator has no fp16); "
                                "use ddp or fsdp for fp16-mixed on CPU ranks")

    def placement(self, s, p, spec, n, cl, stage=None) -> Placement:
        c = spec.bytes.compute                  # module params/grads: bf16 (bf16.enabled) or fp32
        P, h = p.trainable_params, (p.decoder.hidden if p.decoder else None)
        reduce_bucket, prefetch, persist = bucket_sizes(s, h)
        # fp32 master partition + optimizer states, DeepSpeed's "4_params_32bit + 8_optimizer_states"
        opt = (P * FP32 + optimizer_state_bytes(p, spec, FP32, flat=True)) / n
        fp32_grad = P * FP32 / n                # single_partition_of_fp32_groups[i].grad at the step
        scratch = step_scratch_bytes(p, spec, FP32)[0] / n
        place = draft()
        if s.config.stage in (1, 2):
            place.params = param_bytes(p, spec, c)  # the module's 16-bit params, whole on every rank
            # stage 1 keeps full bf16 grads until the step; stage 2 reduces them into a 1/N partition
            place.grads_end = P * c if s.config.stage == 1 else P * c / n
            if spec.gradient_accumulation > 1:
                # stage 1 accumulates whole 16-bit grads over the window; stage 2 accumulates its
                # fp32 partition (averaged_gradients) between micro-batches
                place.grads_start = P * c if s.config.stage == 1 else P * FP32 / n
            # the IPG reduce bucket; updated partitions are all-gathered in place into the flat params
            place.buffers_start = place.buffers_mid = place.buffers_end = c * reduce_bucket
            if s.config.stage == 2:
                # stage_1_and_2.py copy_grads_in_partition allocates the rank's whole partition at the first
                # gradient reduced into it, and a gradient over the bucket (extra_large_param_to_reduce) waits
                # as it is for the next one before it is reduced
                place.grads_early = True
                place.buffers_mid += c * over_bucket(p, reduce_bucket)
        else:
            small = persistent_params(p, persist)
            place.params = param_bytes(p, spec, c) / n + c * small * (1 - 1 / n)
            # stage3.py allocates grad_partitions_flat_buffer (1/N, 16-bit) once, at init
            place.grads_start = place.grads_end = P * c / n
            # ... and makes the fp32 grad one sub-group (sub_group_size, default 1e9) at a time
            fp32_grad = FP32 * min(SUB_GROUP_SIZE, P / n)
            scratch = min(SUB_GROUP_SIZE * FP32, step_scratch_bytes(p, spec, FP32)[0] / n)
            largest = p.largest_layer_params or p.largest_param
            turn, backward = stage3_gathered(p, s, spec, persist, prefetch)
            place.buffers_start = c * (turn + reduce_bucket)
            place.buffers_mid = c * (backward + reduce_bucket)
            place.buffers_end = c * (min(p.params, s.config.max_live_parameters, largest + prefetch) + reduce_bucket)
            hpz = s.config.hpz_size(cl)
            if hpz:
                place.params += c * p.params / hpz   # ZeRO++ hpZ secondary partition (bf16, node-local)
                place.notes.append(f"hpZ keeps a secondary bf16 partition over {hpz} ranks")
        if s.config.offload_optimizer:
            place.cpu += opt + fp32_grad + scratch
            if s.config.stage == 3:
                # the gradient partitions are pinned host memory (docs/estimation.md, ZeRO offload)
                place.cpu += place.grads_end
            else:
                # the fp32 gradient partition on the host, one staging buffer on the GPU
                # (docs/estimation.md, ZeRO offload)
                if spec.gradient_accumulation > 1:
                    place.cpu += c * P / n
                staging = c * (p.largest_param or 0)
                place.buffers_start += staging
                place.buffers_mid += staging
                place.buffers_end += staging
            place.grads_start = place.grads_end = 0
            place.notes.append("optimizer states, fp32 master and the gradient partitions in host memory")
        else:
            place.optimizer, place.grads_step, place.scratch = opt, fp32_grad, scratch
        if s.config.offload_params:
            place.cpu += place.params
            place.params = 0
        return Placement.of(place)



    def comm(self, s, p, spec, cl, n, links):
        c, P, A, W = spec.bytes.compute, p.trainable_params, p.params, cl.world_size
        units = max(p.num_blocks, 1) + 1
        unit_bytes = c * (p.block_params or p.params)
        offload = 0.0
        if s.config.offload_optimizer:
            # fp32 grads to the host, updated 16-bit params back, and the step on the host
            offload = (4 * P / n + c * P / n) / PCIE_BW + (P / n) / HOST_STEP_RATE
        if s.config.offload_params:
            offload += c * (A + P) / n / PCIE_BW     # every param up for its gather, the grads down
        if s.config.stage == 1:
            # gradients reduced at the window's end; updated partitions all-gathered after the step
            return Comm(sync_bwd=links.collective("reduce_scatter", c * P, W, units),
                        after_step=links.collective("all_gather", c * P, W, 1), offload=offload,
                        copied_sync=2 * c * P)
        if s.config.stage == 2:
            # partitioned gradients: reduce-scattered in every micro-batch's backward
            return Comm(bwd=links.collective("reduce_scatter", c * P, W, units),
                        after_step=links.collective("all_gather", c * P, W, 1), offload=offload,
                        copied_micro=2 * c * P)
        everything = gathered_bytes(p, spec, A, p.num_blocks)       # stage 3 gathers frozen params too
        ag = links.collective("all_gather", everything, W, units)
        hpz = s.config.hpz_size(cl)
        bwd = (links.collective("all_gather", everything, hpz, units) if hpz else ag)
        bwd += links.collective("reduce_scatter", c * P, W, units)
        tail = links.collective("all_gather", unit_bytes, W) + links.collective("reduce_scatter", unit_bytes, W)
        return Comm(fwd=ag, bwd=bwd, tail=tail, offload=offload,
                    copied_micro=2 * 2 * c * A + 2 * c * P)   # two gathers' copy-out, one bucket copy

    def host(self, s, p, spec, cl, n, stage=None):
        from .host import Host, ipg_buckets, param_tensors
        # the calls and per-tensor work DeepSpeed issues (docs/estimation.md, host work per step)
        ga, W = spec.gradient_accumulation, cl.world_size
        tensors = param_tensors(p, stage)
        T = len(tensors)
        if W <= 1:
            return Host(tensors=1 + ga * T)
        reduce, _, _ = bucket_sizes(s, p.decoder.hidden if p.decoder else None)
        red = ipg_buckets(tensors, reduce)
        if s.config.stage == 3:
            return Host(calls=ga * (T + red) + 1, tensors=1 + ga * 5 * T)
        gather = max(1, math.ceil(p.trainable_params / W / s.config.allgather_bucket_size))
        return Host(calls=(ga if s.config.stage == 2 else 1) * red + gather + 1, tensors=1 + ga * T)

    def traced_replaces(self, s):
        return frozenset({"params", "grads", "optimizer", "buffers"})

    def traced_note(self, s):
        return (f"{s.name}: traced as its FSDP2 equivalent, with DeepSpeed's partitions and buckets "
                "in place of the traced state")

FAMILY = DeepSpeedFamily()
