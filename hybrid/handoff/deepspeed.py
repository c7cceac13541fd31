"""DeepSpeed's hand-off: the ZeRO JSON config (engine or HF Trainer form) and Accelerate's plugin."""
from __future__ import annotations

import json

from ..errors import HybridError
from ..families.deepspeed import ds_config
from .base import Handoff, provenance, user_checkpointing


class DeepSpeedHandoff(Handoff):
    def emit_notes(self, c, target="engine"):
        """Where DeepSpeed builds its ops; with --for trainer, what to set in TrainingArguments
        beside deepspeed="ds.json"."""
        cache = ("hybrid: DeepSpeed JIT-builds its ops into TORCH_EXTENSIONS_DIR, by default one per-user cache "
                 "that every environment shares (an interrupted build's lock there stalls later runs): export "
                 "TORCH_EXTENSIONS_DIR=<the job's venv>/torch_extensions where it runs")
        if target != "trainer":
            return [cache]
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
        return [cache, 'hybrid: with --for trainer, set TrainingArguments(deepspeed="ds.json", ' + ", ".join(kw) + ")"]

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


HANDOFF = DeepSpeedHandoff()
