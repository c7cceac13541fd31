"""The chosen layout as other tools' configs: DeepSpeed, FSDP, torchtitan, Accelerate (pure)."""
