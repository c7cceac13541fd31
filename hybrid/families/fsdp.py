"""FSDP2 (`fully_shard`): per-block units plus the root, on a 1D or 2D (HSDP) mesh."""
from __future__ import annotations

from dataclasses import dataclass

import yaml

from ..errors import HybridError
from ..links import HOST_STEP_RATE, PCIE_BW
from ..memory.placement import Placement, optimizer_elements, reduce_bytes, scratch_elements
from ..profile import transformers_layer_class
from .base import Comm, Family, HostOffloadConfig, provenance


@dataclass(frozen=True)
class FSDPConfig(HostOffloadConfig):
    """FSDP2 (fully_shard)'s knobs."""

    reshard_after_forward: bool = True
    """Free gathered params after each block's forward (re-gather in backward)."""
    offload_optimizer: bool = False
    """CPUOffloadPolicy: parameter shards, gradients and the optimizer step on the host."""
    offload_params: bool = False
    """The same policy (FSDP2 moves all three together): must equal offload_optimizer."""

    def __post_init__(self):
        if self.offload_params != self.offload_optimizer:
            raise HybridError("FSDP2's CPUOffloadPolicy moves params, grads and optimizer together; set "
                              "offload_params and offload_optimizer both true or both false")


class FSDPFamily(Family):
    name = "fsdp"
    config = FSDPConfig
    runtime_module = "hybrid.backends.fsdp"
    emits = "fsdp"
    supports_ep = True

    def default_complexity(self, s):
        base = 3 if not s.config.reshard_after_forward else (5 if s.shard == "world" else 4)
        return base + 10 * s.config.offload_optimizer + 2 * s.config.offload_params

    def shard_is_free(self, s):
        return s.shard == "node"

    def placement(self, s, p, spec, n, cl, stage=None) -> Placement:
        b = spec.bytes
        c = b.compute
        rb = reduce_bytes(spec)
        P = p.trainable_params
        lay = Placement()
        # a bare parameter count has no module tree: its units' sizes are unknown (not the whole
        # model as one unit), so only what holds for any units is counted: with
        # reshard_after_forward off every parameter stays gathered from forward to backward
        bare = p.source == "params"
        unit = 0 if bare else (p.block_params if p.num_blocks else p.params)
        root = p.root_params if p.num_blocks else 0
        every_block = p.params if bare else p.num_blocks * unit
        if bare:
            lay.notes.append("FSDP's gathered units are unknown for a bare parameter count: not counted")
        # the head's (or embedding's) unsharded gradient: its tensor-parallel share, none on a
        # middle pipeline stage (the root holds it, as tp_share and stage_share count it)
        head = min(p.decoder.vocab * p.decoder.hidden, root) if p.decoder else root
        sharded = dict(params=p.params * b.param / n, optimizer=optimizer_elements(p, spec) * b.state / n,
                       grads=P * b.grad / n, scratch=scratch_elements(p, spec) * b.state / n)
        if s.config.offload_params:
            lay.cpu = sharded["params"] + sharded["optimizer"] + sharded["grads"] + sharded["scratch"]
            lay.notes.append("CPUOffloadPolicy: sharded params, grads and the optimizer step live in host memory")
        else:
            lay.params, lay.optimizer = sharded["params"], sharded["optimizer"]
            lay.grads_end, lay.scratch = sharded["grads"], sharded["scratch"]
        # The root (embeddings, final norm, head) is not resharded after forward (FSDP2 keeps the root
        # gathered for backward); blocks are gathered one at a time plus one prefetched.
        gathered_blocks = 2 * unit if s.config.reshard_after_forward else every_block + unit
        lay.buffers_start = c * (root + (unit if s.config.reshard_after_forward else every_block))
        # resharded after forward (reshard_after_forward=True is passed explicitly, so FSDP2 reshards
        # the root too), the root and the last block are gathered again by the root's pre-backward
        # hook on its outputs: after the loss backward when the loss is computed outside (traced)
        lay.regathered = lay.buffers_start if s.config.reshard_after_forward else 0
        # in a block's backward: root params + the head's unsharded grad, two blocks gathered (the
        # block and the prefetched one, whose all-gather output and copy-out overlap it), and the
        # block's reduce-scatter input in the reduce dtype (its grads themselves: unit_grads)
        lay.buffers_mid = c * (root + head + gathered_blocks) + rb * unit
        lay.buffers_end = c * (2 * root) + rb * root
        if stage is not None:
            # a pipeline stage reduce-scatters once, after its last micro-batch (perform_reduce_grad):
            # until then only the accumulated unsharded gradients exist, then only the shards
            acc = P * rb
            lay.grads_step = lay.grads_end - acc
            lay.grads_start = lay.grads_end = acc
        if spec.gradient_accumulation > 1 and stage is None:
            # FSDP2's no-sync (set_requires_gradient_sync(False)) keeps every unsharded gradient
            # from the window's first backward to its last reduce-scatter, upcast to the reduce
            # dtype to accumulate (FSDPParam.to_accumulated_grad_if_needed: fp32 under bf16-mixed);
            # a pipeline stage always runs so (torch.distributed.pipelining's
            # backward_maybe_with_nosync), reducing once in perform_reduce_grad after the last
            # micro-batch
            lay.grads_start += P * rb
            lay.grads_end += P * rb
            lay.notes.append(f"gradient accumulation: unsharded {('bf16' if rb == 2 else 'fp32')} gradients are kept "
                             "between micro-batches (reduce-scatter once per window)")
        if stage is not None:
            # ... and with set_reshard_after_backward(False): a block's parameters stay gathered
            # from its backward until its next forward reshards them; all the blocks' at the end
            # of a backward (the stage root's are resharded: traced)
            lay.buffers_end = c * every_block
            lay.notes.append("pipeline stage: FSDP keeps the stage's parameters gathered after their backward "
                             "until the step's reduce-scatter (torch.distributed.pipelining)")
        return lay



    def comm(self, s, p, spec, cl, n, links):
        # all-gather params in every forward and again in backward (unless kept), reduce-scatter
        # grads within the shard group at the window's end; HSDP adds an all-reduce across replicas
        c, rb, P = spec.bytes.compute, reduce_bytes(spec), p.trainable_params
        units = max(p.num_blocks, 1) + 1
        unit_bytes = c * (p.block_params or p.params)
        ag = links.collective("all_gather", c * P, n, units)
        sync = links.collective("reduce_scatter", rb * P, n, units)
        sync += links.across_replicas("all_reduce", rb * P / n, cl.world_size // n, units)
        tail = links.collective("all_gather", unit_bytes, n) + links.collective("reduce_scatter", unit_bytes, n)
        gathers = 2 if s.config.reshard_after_forward else 1
        offload = 0.0
        if s.config.offload_params:
            offload = 2 * (spec.bytes.param * P / n) / PCIE_BW + (P / n) / HOST_STEP_RATE
        return Comm(fwd=ag, bwd=ag if s.config.reshard_after_forward else 0.0, sync_bwd=sync, tail=tail,
                    offload=offload,
                    copied_micro=gathers * 2 * c * P,   # copy-out of each gather
                    copied_sync=2 * rb * P)             # chunk_cat per reduce-scatter

    def host(self, s, p, spec, cl, n, stage=None):
        from ..overhead import Host, param_tensors
        # per micro-batch one all-gather per unit in forward and again in backward when resharded
        # (the root included: 2 x 5 for 4 blocks, counted by torch.profiler on 4 gloo ranks); one
        # reduce-scatter per unit and, with replicas, one all-reduce per unit at the window's end;
        # the optimizer loops over the DTensor shards (not foreach types: torch/optim/optimizer.py:172)
        units = max(p.num_blocks, 1) + 1
        if n <= 1 and cl.world_size <= 1:
            return Host(tensors=len(param_tensors(p, stage)))
        gathers = units * (2 if s.config.reshard_after_forward else 1) if n > 1 else 0
        window = (units if n > 1 else 0) + (units if cl.world_size // n > 1 else 0)
        return Host(calls=spec.gradient_accumulation * gathers + window, tensors=len(param_tensors(p, stage)))

    def emit(self, c, plan, profile, target="engine"):
        """The FSDP2 settings as YAML: mesh, units, mixed precision, reshard, offload."""
        s = c.strategy
        dims = c.parallel
        layer = transformers_layer_class(profile)
        settings = {
            "strategy": s.name,
            # with context parallelism FSDP shards over dp_shard x cp flattened (hybrid.mesh.fsdp_mesh)
            "mesh": {"shape": [dims.dp_replicate, dims.dp_shard * dims.cp],
                     "dim_names": ["dp_replicate", "dp_shard" if dims.cp == 1 else "dp_shard_cp"],
                     "hybrid_sharding": dims.dp_replicate > 1, "parallel": dims.to_dict()},
            "fully_shard": {
                "units": [layer, "root"] if layer else ["root"],
                "reshard_after_forward": s.config.reshard_after_forward,
                "mp_policy": ({"param_dtype": {"bf16-mixed": "bfloat16", "fp16-mixed": "float16"}[c.spec.precision],
                               "reduce_dtype": "float32"} if c.spec.mixed
                              else {"param_dtype": None, "reduce_dtype": None}),
                "offload_policy": "CPUOffloadPolicy(pin_memory=True)" if s.config.offload_params else None,
            },
            "activation_checkpointing": c.spec.activation_checkpointing,
            "train": c.spec.to_dict(),
            "_hybrid": provenance(plan, c),
        }
        return yaml.safe_dump(settings, sort_keys=False)

    def torchtitan_reshard(self, s):
        return "default" if s.config.reshard_after_forward else "never"

    def torchtitan_offload(self, s):
        return s.config.offload_params

    def torchtitan_check(self, c):
        return None

    def accelerate(self, c, layer_class):
        s, d, ac = c.strategy, c.parallel, c.spec.activation_checkpointing
        wrap = ({"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_transformer_layer_cls_to_wrap": layer_class}
                if layer_class else {"fsdp_auto_wrap_policy": "NO_WRAP"})
        keys = {"distributed_type": "FSDP",
                "fsdp_config": {"fsdp_version": 2, **wrap,
                                "fsdp_reshard_after_forward": bool(s.config.reshard_after_forward),
                                "fsdp_offload_params": bool(s.config.offload_params),
                                "fsdp_state_dict_type": "SHARDED_STATE_DICT",
                                "fsdp_cpu_ram_efficient_loading": True, "fsdp_sync_module_states": True,
                                "fsdp_activation_checkpointing": ac != "none"},
                "parallelism_config": {"parallelism_config_dp_replicate_size": d.dp_replicate,
                                       "parallelism_config_dp_shard_size": d.dp_shard,
                                       "parallelism_config_tp_size": d.tp, "parallelism_config_cp_size": d.cp}}
        notes = []
        if d.cp > 1:    # Accelerate's torch CP: all-gather of K/V, as hybrid runs and estimates it
            keys["parallelism_config"]["parallelism_config_cp_comm_strategy"] = "allgather"
            notes.append("context parallelism: run forward and backward inside accelerator.maybe_context_parallel("
                         "buffers=[input_ids, labels, position_ids], buffer_seq_dims=[1, 1, 1]); SDPA attention only")
        if ac == "selective":
            notes.append("Accelerate's fsdp_activation_checkpointing recomputes whole blocks (the plan's "
                         "'selective' keeps matmul outputs): less memory, more compute than estimated")
        return keys, notes


FAMILY = FSDPFamily()
