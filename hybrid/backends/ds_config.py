"""The DeepSpeed JSON config of a ZeRO strategy (pure: usable by `hybrid plan --emit deepspeed`)."""
from __future__ import annotations

from ..errors import HybridError


def ds_config(strategy, spec, hidden: int | None, world_size: int, gpus_per_node: int,
              cuda: bool = True, gradient_accumulation: int = 1, max_grad_norm: float | None = None) -> dict:
    """Bucket sizes left unset in the catalogue follow HF Trainer's 'auto' rules (hidden^2,
    0.9 hidden^2, 10 hidden); the analytic model uses the same numbers."""
    if strategy.family != "deepspeed":
        raise HybridError(f"{strategy.name} is a {strategy.family} strategy, not DeepSpeed ZeRO")
    if spec.precision == "bf16":
        raise HybridError(f"{strategy.name}: DeepSpeed ZeRO keeps an fp32 master copy; use --precision "
                          "bf16-mixed or fp32")
    zero = {"stage": strategy.stage, "contiguous_gradients": True, "overlap_comm": cuda,
            "reduce_bucket_size": strategy.reduce_bucket_size or (hidden * hidden if hidden else 500_000_000)}
    if strategy.stage < 3:
        zero["allgather_bucket_size"] = strategy.allgather_bucket_size
    else:
        zero["stage3_prefetch_bucket_size"] = strategy.prefetch_bucket_size or (
            int(0.9 * hidden * hidden) if hidden else 50_000_000)
        zero["stage3_param_persistence_threshold"] = (strategy.param_persistence_threshold
                                                      if strategy.param_persistence_threshold is not None
                                                      else (10 * hidden if hidden else 100_000))
        zero["stage3_max_live_parameters"] = strategy.max_live_parameters
        zero["stage3_max_reuse_distance"] = strategy.max_reuse_distance
        zero["stage3_gather_16bit_weights_on_model_save"] = False
    if strategy.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    if strategy.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": cuda}
    if strategy.hpz:
        zero["zero_hpz_partition_size"] = gpus_per_node if strategy.hpz == "node" else int(strategy.hpz)
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
