"""What a compiled block keeps for backward, read from the compiled graph itself.

Under torch.compile, AOTAutograd traces the block's forward and backward as one joint graph and
its partitioner (`min_cut_rematerialization_partition`, the one inductor uses) decides which
forward values the backward receives: the rest is recomputed inside the fused backward kernels.
Those saved values are the outputs of the forward graph beyond the block's own output. This
module traces one block of a decoder on CPU at small shapes (the partitioner's choice is made op
by op, on values that all scale with the tokens, so it does not change with the batch, the
sequence or the widths: the saved set is the same at llama3-8b's widths), runs the partitioner
as inductor runs it (no code is generated), and counts the saved values' bytes. The CPU trace
takes the attention through SDPA's flash kernel, as CUDA does (the meta device would take the
math path, which saves the s x s softmax). hybrid/estimation/memory/activations.py states the result per
token as a formula;
tests/runtime/test_compile.py holds the two equal, and both to what a block compiled with inductor keeps
on CPU ranks (the project's tracker).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..model.presets import DecoderConfig


@dataclass(frozen=True)
class Saved:
    """The forward values a compiled block hands to its backward."""

    activation_bytes: int
    """Bytes of saved non-parameter values, the block input included where it is saved."""
    names: tuple[tuple[str, tuple[int, ...], str], ...]
    """(graph node, shape, dtype) of each saved activation, for reading."""


def partitioner_saved(cfg: DecoderConfig, dtype: torch.dtype, checkpointing: str = "none", batch: int = 1,
                      seq: int = 16) -> Saved:
    """Trace one block of `cfg` (our decoder's Block, with `checkpointing` applied as the
    backends apply it; a small config: its weights are real CPU tensors) through AOTAutograd at
    (batch, seq) and return what
    the inductor partitioner saves for backward. Parameters and the rotary tables (primal inputs
    whose size does not depend on the batch) are left out; the block input is counted when the
    backward takes it (it is a 3-d primal, the only one)."""

    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch.multiprocessing.reductions import StorageWeakRef

    from ..runtime.activation_checkpoint import apply_activation_checkpointing
    from ..model.decoder import build_decoder

    two = DecoderConfig(**{**cfg.__dict__, "layers": 2})            # checkpointing wants repeated blocks
    model = build_decoder(two, device="cpu", dtype=dtype)
    apply_activation_checkpointing(model, checkpointing)
    block = model.blocks[0]
    found: list = []

    def partition(joint, inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kw)
        out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        primal = {n.name for n in fw.graph.nodes if n.op == "placeholder"}
        seen = set()
        for n in out[kw["num_fwd_outputs"]:]:
            v = n.meta.get("val")
            if not isinstance(v, torch.Tensor) or (n.name in primal and v.dim() != 3):
                continue
            if not all(isinstance(d, int) for d in v.shape):   # the RNG state checkpointing keeps: batch-free
                continue
            # a view of a value already saved (the attention output and its reshape share
            # storage: SDPA's flash kernels lay it out as (b, s, heads, d)) is one storage
            st = StorageWeakRef(v.untyped_storage())
            if st in seen:
                continue
            seen.add(st)
            found.append((n.name, tuple(v.shape), str(v.dtype).replace("torch.", ""),
                          v.untyped_storage().nbytes()))
        return fw, bw

    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g,
                           partition_fn=partition)
    torch._dynamo.reset()
    try:
        x = torch.randn(batch, seq, cfg.hidden, dtype=dtype, requires_grad=True)
        rope = model._rope(seq, dtype, "cpu")
        torch.compile(block, backend=backend, fullgraph=True, dynamic=False)(x, rope, None)
    finally:
        torch._dynamo.reset()
    return Saved(sum(f[3] for f in found), tuple(f[:3] for f in found))


def per_token(cfg: DecoderConfig, dtype: torch.dtype, checkpointing: str = "none") -> float:
    """Saved bytes per token of one compiled block: the difference between two batch sizes,
    so nothing independent of the batch is counted."""
    one = partitioner_saved(cfg, dtype, checkpointing, batch=1)
    three = partitioner_saved(cfg, dtype, checkpointing, batch=3)
    return (three.activation_bytes - one.activation_bytes) / (2 * 16)
