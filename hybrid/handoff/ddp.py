"""DDP's hand-off: an Accelerate multi-GPU config; torchtitan runs it as FSDP2 with one shard."""
from __future__ import annotations

from ..errors import HybridError
from .base import Handoff, user_checkpointing


class DDPHandoff(Handoff):
    def accelerate(self, c, layer_class):
        if c.parallel.cp > 1:
            raise HybridError(f"{c.label}: Accelerate runs context parallelism only under FSDP2 (parallelism_config "
                              "cp_size); emit an fsdp layout (--strategy fsdp or hsdp) or pin --cp 1")
        if c.parallel.tp > 1:
            raise HybridError(f"{c.label}: Accelerate runs tensor parallelism only under FSDP2; emit an fsdp layout "
                              "(--strategy fsdp or hsdp) or pin --tp 1")
        return {"distributed_type": "MULTI_GPU"}, user_checkpointing(c)


HANDOFF = DDPHandoff()
