"""DeepSpeed ZeRO stage 1/2/3 (with offload and ZeRO++ hpZ): memory layout, communication, config."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass

from ..errors import HybridError
from ..links import HOST_STEP_RATE, PCIE_BW
from ..parallel import validate_shard_size
from ..memory.placement import FP32, Placement, NotApplicable, optimizer_elements, scratch_elements
from .base import Comm, Family, HostOffloadConfig, provenance, user_checkpointing

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
        validate_shard_size(n, cluster.world_size, cluster.gpus_per_node)
        return n


class DeepSpeedFamily(Family):
    name = "deepspeed"
    config = DeepSpeedConfig
    runtime_module = "hybrid.backends.deepspeed"
    emits = "deepspeed"
    keeps_master_copy = True
    torchtitan = False

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
        if spec.precision == "fp16-mixed" and not cuda:
            raise NotApplicable(f"{s.name}: DeepSpeed's fp16 mode needs CUDA (its CPU accelerator has no fp16); "
                                "use ddp or fsdp for fp16-mixed on CPU ranks")

    def placement(self, s, p, spec, n, cl, stage=None) -> Placement:
        c = spec.bytes.compute                  # module params/grads: bf16 (bf16.enabled) or fp32
        P, h = p.trainable_params, (p.decoder.hidden if p.decoder else None)
        reduce_bucket, prefetch, persist = bucket_sizes(s, h)
        # fp32 master partition + optimizer states, DeepSpeed's "4_params_32bit + 8_optimizer_states"
        opt = (P * FP32 + optimizer_elements(p, spec) * FP32) / n
        fp32_grad = P * FP32 / n                # single_partition_of_fp32_groups[i].grad at the step
        scratch = scratch_elements(p, spec) * FP32 / n
        lay = Placement()
        if s.config.stage in (1, 2):
            lay.params = p.params * c           # the module's bf16 params, whole on every rank
            # stage 1 keeps full bf16 grads until the step; stage 2 reduces them into a 1/N partition
            lay.grads_end = P * c if s.config.stage == 1 else P * c / n
            if spec.gradient_accumulation > 1:
                # stage 1 accumulates whole 16-bit grads over the window; stage 2 accumulates its
                # fp32 partition (averaged_gradients) between micro-batches
                lay.grads_start = P * c if s.config.stage == 1 else P * FP32 / n
            # the IPG reduce bucket; updated partitions are all-gathered in place into the flat params
            lay.buffers_start = lay.buffers_mid = lay.buffers_end = c * reduce_bucket
        else:
            small = persistent_params(p, persist)
            lay.params = c * (p.params / n + small * (1 - 1 / n))
            # stage3.py allocates grad_partitions_flat_buffer (1/N, 16-bit) once, at init
            lay.grads_start = lay.grads_end = P * c / n
            # ... and makes the fp32 grad one sub-group (sub_group_size, default 1e9) at a time
            fp32_grad = FP32 * min(SUB_GROUP_SIZE, P / n)
            scratch = FP32 * min(SUB_GROUP_SIZE, scratch_elements(p, spec) / n)
            largest = p.largest_layer_params or p.largest_param
            unit = p.block_params if p.num_blocks else largest
            # Gathered params stay gathered while they are reused within max_reuse_distance fetches:
            # at the forward/backward turn the last blocks (fetched again after 2 x the params in
            # between) and the head are kept; everything is capped by max_live_parameters.
            kept = min(p.params, s.config.max_live_parameters, largest + s.config.max_reuse_distance / 2 + prefetch)
            lay.buffers_start = c * (kept + reduce_bucket)
            lay.buffers_mid = c * (min(s.config.max_live_parameters, kept + unit) + reduce_bucket)
            lay.buffers_end = c * (min(p.params, s.config.max_live_parameters, largest + prefetch) + reduce_bucket)
            hpz = s.config.hpz_size(cl)
            if hpz:
                lay.params += c * p.params / hpz   # ZeRO++ hpZ secondary partition (bf16, node-local)
                lay.notes.append(f"hpZ keeps a secondary bf16 partition over {hpz} ranks")
        if s.config.offload_optimizer:
            lay.cpu += opt + fp32_grad + scratch
            if s.config.stage == 3:
                # stage3.py: self.device is the CPU under offload_optimizer (l.333), so the
                # gradient partitions (grad_partitions_flat_buffer, l.791-795) are pinned host memory
                lay.cpu += lay.grads_end
            else:
                # stage_1_and_2.py: under cpu_offload (self.device 'cpu', l.278) the fp32 gradient
                # partition is pinned host memory (initialize_optimizer_states, l.936-940) and
                # copy_grads_in_partition copies each reduced gradient straight into it and returns
                # (l.2161-2178) before the GPU partition grads_in_partition is ever allocated
                # (l.2184-2194); accumulation keeps 16-bit copies of this rank's parameters on the
                # host (accumulated_grads_in_cpu, l.1821-1853); the GPU keeps one 16-bit staging
                # buffer of the largest parameter (temp_grad_buffer_for_gpu_offload, l.659)
                if spec.gradient_accumulation > 1:
                    lay.cpu += c * P / n
                staging = c * (p.largest_param or 0)
                lay.buffers_start += staging
                lay.buffers_mid += staging
                lay.buffers_end += staging
            lay.grads_start = lay.grads_end = 0
            lay.notes.append("optimizer states, fp32 master and the gradient partitions in host memory")
        else:
            lay.optimizer, lay.grads_step, lay.scratch = opt, fp32_grad, scratch
        if s.config.offload_params:
            lay.cpu += lay.params
            lay.params = 0
        return lay



    def comm(self, s, p, spec, cl, n, links):
        c, P, W = spec.bytes.compute, p.trainable_params, cl.world_size
        units = max(p.num_blocks, 1) + 1
        unit_bytes = c * (p.block_params or p.params)
        offload = 0.0
        if s.config.offload_optimizer:
            # fp32 grads to the host, updated 16-bit params back, and the step on the host
            offload = (4 * P / n + c * P / n) / PCIE_BW + (P / n) / HOST_STEP_RATE
        if s.config.offload_params:
            offload += 2 * (c * P / n) / PCIE_BW
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
        ag = links.collective("all_gather", c * P, W, units)
        hpz = s.config.hpz_size(cl)
        bwd = (links.collective("all_gather", c * P, hpz, units) if hpz else ag)
        bwd += links.collective("reduce_scatter", c * P, W, units)
        tail = links.collective("all_gather", unit_bytes, W) + links.collective("reduce_scatter", unit_bytes, W)
        return Comm(fwd=ag, bwd=bwd, tail=tail, offload=offload,
                    copied_micro=2 * 2 * c * P + 2 * c * P)   # two gathers' copy-out, one bucket copy

    def host(self, s, p, spec, cl, n, stage=None):
        from ..overhead import Host, ipg_buckets, param_tensors
        # gradients reduced in buckets of reduce_bucket_size elements (ipg_buckets); the step's
        # gradient norm is always all-reduced (stage_1_and_2.py:3039 scaled_global_norm, 1945);
        # stage 1/2 all-gather the updated flat partitions (one call per allgather_bucket_size,
        # all_gather_dp_groups); each parameter's gradient hook runs in Python every backward
        # (reduce_ready_partitions_and_remove_grads); the optimizer steps one flat fp32 partition.
        # Stage 3 all-gathers each parameter tensor on its first use in a micro-batch (counted by
        # torch.profiler: 52 gathers for 52 tensors) and keeps it for backward; its bookkeeping per
        # parameter runs at fetch and release in forward and backward (partitioned_param_coordinator)
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

    def emit_notes(self, c, target="engine"):
        """With --for trainer: what to set in TrainingArguments beside deepspeed="ds.json"."""
        if target != "trainer":
            return []
        kw = [f"per_device_train_batch_size={c.spec.micro_batch}",
              f"gradient_accumulation_steps={c.spec.gradient_accumulation}"]
        if c.spec.precision == "bf16-mixed":
            kw.append("bf16=True")
        elif c.spec.precision == "fp16-mixed":
            kw.append("fp16=True")
        if c.spec.compile:
            kw.append("torch_compile=True")
        if c.spec.activation_checkpointing != "none":
            # transformers 5 renamed the field (the old name still works, with a FutureWarning)
            kw.append("gradient_checkpointing=True (transformers >= 5: activation_checkpointing=True)")
        return ["hybrid: with --for trainer, set TrainingArguments(deepspeed=\"ds.json\", " + ", ".join(kw) + ")"]

    def emit(self, c, plan, profile, target="engine"):
        """The DeepSpeed JSON config of the candidate. target "engine": concrete values for
        deepspeed.initialize; "trainer": the HF Trainer's form, "auto" wherever the Trainer fills
        the value from its TrainingArguments (batch sizes, accumulation, clipping, precision), and
        16-bit weights gathered on save (so Trainer.save_model writes a usable model)."""
        cfg = ds_config(c.strategy, c.spec, profile.decoder.hidden if profile.decoder else None,
                        plan.cluster.world_size, plan.cluster.gpus_per_node, cuda=plan.cluster.gpu.is_cuda,
                        gradient_accumulation=c.spec.gradient_accumulation)
        if target == "trainer":
            for key in ("train_micro_batch_size_per_gpu", "train_batch_size", "gradient_accumulation_steps",
                        "gradient_clipping"):
                cfg[key] = "auto"
            cfg["bf16"] = {"enabled": "auto"}
            cfg["fp16"] = {**cfg.get("fp16", {}), "enabled": "auto"}
            if c.strategy.config.stage == 3:
                cfg["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] = True
        elif c.spec.activation_checkpointing != "none":
            cfg["activation_checkpointing"] = {"partition_activations": False,
                                               "contiguous_memory_optimization": False}
        cfg["_hybrid"] = provenance(plan, c)
        return json.dumps(cfg, indent=2)

    def accelerate(self, c, layer_class):
        s = c.strategy
        if s.config.hpz:
            raise HybridError(f"{s.name}: Accelerate's DeepSpeed plugin fields cannot set hpZ; write the JSON with "
                              f"`--emit deepspeed --for trainer -o ds.json` and point Accelerate's "
                              f"deepspeed_config_file at it")
        keys = {"distributed_type": "DEEPSPEED",
                "deepspeed_config": {"zero_stage": s.config.stage,
                                     "gradient_accumulation_steps": c.spec.gradient_accumulation,
                                     "offload_optimizer_device": "cpu" if s.config.offload_optimizer else "none",
                                     "offload_param_device": "cpu" if s.config.offload_params else "none",
                                     "zero3_init_flag": s.config.stage == 3,
                                     "zero3_save_16bit_model": s.config.stage == 3}}
        return keys, user_checkpointing(c)


FAMILY = DeepSpeedFamily()
