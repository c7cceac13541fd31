"""FSDP2 (`fully_shard`): per-block units plus the root, on a 1D or 2D (HSDP) mesh."""
from __future__ import annotations

from dataclasses import dataclass


from ..errors import HybridError
from ..config.cluster import HOST_STEP_RATE, PCIE_BW
from .placement import (Placement, draft, gathered_bytes, optimizer_state_bytes, param_bytes, reduce_bytes,
                        step_scratch_bytes)
from .base import Comm, Family, HostOffloadConfig


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
    runtime_module = "hybrid.runtime.backends.fsdp"
    handoff_module = "hybrid.handoff.fsdp"
    emits = "fsdp"
    supports_ep = True
    fault_tolerant = True

    def default_complexity(self, s):
        base = 3 if not s.config.reshard_after_forward else (5 if s.shard == "world" else 4)
        return base + 10 * s.config.offload_optimizer + 2 * s.config.offload_params

    def shard_is_free(self, s):
        return s.shard == "node"

    def applied_wrap(self, layout, staged):
        return "fsdp", "blocks+root", layout.dp.config.reshard_after_forward, False

    def states_split(self, layout, n):
        return n, not layout.dp.config.reshard_after_forward

    def placement(self, s, p, spec, n, cl, stage=None) -> Placement:
        b = spec.bytes
        c = b.compute
        rb = reduce_bytes(spec)
        P = p.trainable_params
        place = draft()
        # a bare parameter count has no module tree: its units' sizes are unknown (not the whole
        # model as one unit), so only what holds for any units is counted: with
        # reshard_after_forward off every parameter stays gathered from forward to backward
        bare = p.source == "params"
        unit = 0 if bare else (p.block_params if p.num_blocks else p.params)
        root = p.root_params if p.num_blocks else 0
        every_block = p.params if bare else p.num_blocks * unit
        if bare:
            place.notes.append("FSDP's gathered units are unknown for a bare parameter count: not counted")
        # the head's (or embedding's) unsharded gradient: its tensor-parallel share, none on a
        # middle pipeline stage (the root holds it, as tp_share and stage_share count it)
        head = min(p.decoder.vocab * p.decoder.hidden, root) if p.decoder else root
        # what of a block and of the root trains (and so makes gradients): a LoRA model's adapters
        # all sit in its blocks; other partly frozen models are taken as evenly frozen
        if spec.lora is not None and p.num_blocks:
            unit_frac, root_frac = min(1.0, P / max(p.num_blocks * unit, 1)), 0.0
        else:
            unit_frac = root_frac = P / p.params
        blocks = p.num_blocks if p.num_blocks else 0
        scratch, whole = step_scratch_bytes(p, spec)     # whole: Muon's gathered matrix
        sharded = dict(params=param_bytes(p, spec) / n, optimizer=optimizer_state_bytes(p, spec) / n,
                       grads=P * b.grad / n, scratch=scratch / n + whole)
        if s.config.offload_params:
            place.cpu = sharded["params"] + sharded["optimizer"] + sharded["grads"] + sharded["scratch"]
            place.notes.append("CPUOffloadPolicy: sharded params, grads and the optimizer step live in host memory")
        else:
            place.params, place.optimizer = sharded["params"], sharded["optimizer"]
            place.grads_end, place.scratch = sharded["grads"], sharded["scratch"]
        # The root (embeddings, final norm, head) is not resharded after forward (FSDP2 keeps the root
        # gathered for backward); blocks are gathered one at a time plus one prefetched.
        gathered_unit = gathered_bytes(p, spec, unit, 1 if blocks else 0)
        gathered_all = gathered_bytes(p, spec, every_block, blocks)
        place.buffers_start = c * root + (gathered_unit if s.config.reshard_after_forward else gathered_all)
        # resharded after forward (reshard_after_forward=True is passed explicitly, so FSDP2 reshards
        # the root too), the root and the last block are gathered again by the root's pre-backward
        # hook on its outputs: after the loss backward when the loss is computed outside (traced)
        place.regathered = place.buffers_start if s.config.reshard_after_forward else 0
        # in a block's backward: root params + the head's unsharded grad, two blocks gathered (the
        # block and the prefetched one, whose all-gather output and copy-out overlap it), and the
        # block's reduce-scatter input in the reduce dtype (its grads themselves: unit_grads)
        gathered_blocks = 2 * gathered_unit if s.config.reshard_after_forward else gathered_all + gathered_unit
        place.buffers_mid = c * (root + head * root_frac) + gathered_blocks + rb * unit * unit_frac
        place.buffers_end = c * root + (c + rb) * root * root_frac
        if stage is not None:
            # a stage's block in backward: its root gathered (the head's unsharded gradient only on
            # the last stage: the first stage's embedding is differentiated after its blocks), the
            # block and the one prefetched before it (the root on the first stage; none on a
            # stage of one block), and no reduce-scatter input: the gradients accumulate unsharded
            if not s.config.reshard_after_forward:
                held = gathered_all
            elif stage.last:
                held = min(2, blocks) * gathered_unit
            else:
                held = gathered_unit + max(c * root, gathered_unit if blocks > 1 else 0) - c * root
            place.buffers_mid = c * (root + head * root_frac * stage.last) + held
            # a pipeline stage reduce-scatters once, after its last micro-batch (perform_reduce_grad):
            # until then only the accumulated unsharded gradients exist, then only the shards
            acc = P * rb
            place.grads_step = place.grads_end - acc
            place.grads_start = place.grads_end = place.accumulated = acc
        if spec.gradient_accumulation > 1 and stage is None:
            # no-sync keeps every unsharded gradient in the reduce dtype over the window
            # (docs/estimation.md, FSDP2 gradient accumulation)
            place.grads_start += P * rb
            place.grads_end += P * rb
            place.accumulated = P * rb
            place.notes.append(f"gradient accumulation: unsharded {('bf16' if rb == 2 else 'fp32')} gradients are kept "
                             "between micro-batches (reduce-scatter once per window)")
        if stage is not None:
            # ... and with set_reshard_after_backward(False): a unit's parameters stay gathered from
            # its backward until its next forward reshards them: every block's, and the stage root's
            # (gathered by its pre-backward hook as each backward starts), at the end of a backward,
            # with on the last stage the head's unsharded gradient, which waits for the root's
            # post-backward at the end of the backward (traced: tests/measure/test_matrix.py)
            place.buffers_end = gathered_all + c * (root + head * root_frac * stage.last)
            place.notes.append("pipeline stage: FSDP keeps the stage's parameters gathered after their backward "
                             "until the step's reduce-scatter (torch.distributed.pipelining)")
        return Placement.of(place)



    def comm(self, s, p, spec, cl, n, links):
        # all-gather every param (frozen ones too) in every forward and again in backward (unless
        # kept), reduce-scatter the trainable ones' grads in the shard group at the window's end;
        # HSDP adds an all-reduce across replicas
        rb, P, A = reduce_bytes(spec), p.trainable_params, p.params
        units = max(p.num_blocks, 1) + 1
        unit_bytes = gathered_bytes(p, spec, p.block_params or p.params, 1 if p.num_blocks else 0)
        everything = gathered_bytes(p, spec, A, p.num_blocks)       # a quantised base travels packed
        ag = links.collective("all_gather", everything, n, units)
        sync = links.collective("reduce_scatter", rb * P, n, units)
        sync += links.across_replicas("all_reduce", rb * P / n, cl.world_size // n, units)
        tail = links.collective("all_gather", unit_bytes, n) + links.collective("reduce_scatter", unit_bytes, n)
        gathers = 2 if s.config.reshard_after_forward else 1
        offload = 0.0
        if s.config.offload_params:
            offload = spec.bytes.param * (A + P) / n / PCIE_BW + (P / n) / HOST_STEP_RATE
        return Comm(fwd=ag, bwd=ag if s.config.reshard_after_forward else 0.0, sync_bwd=sync, tail=tail,
                    offload=offload,
                    copied_micro=gathers * 2 * everything,   # copy-out of each gather
                    copied_sync=2 * rb * P)             # chunk_cat per reduce-scatter

    def host(self, s, p, spec, cl, n, stage=None):
        from .host import Host, param_tensors
        # the calls and per-tensor work FSDP2 issues (docs/estimation.md, host work per step)
        units = max(p.num_blocks, 1) + 1
        if n <= 1 and cl.world_size <= 1:
            return Host(tensors=len(param_tensors(p, stage)))
        gathers = units * (2 if s.config.reshard_after_forward else 1) if n > 1 else 0
        window = (units if n > 1 else 0) + (units if cl.world_size // n > 1 else 0)
        return Host(calls=spec.gradient_accumulation * gathers + window, tensors=len(param_tensors(p, stage)))

FAMILY = FSDPFamily()
