"""What a compiled block keeps for backward, read from the compiled graph itself.

Under torch.compile, AOTAutograd traces the block's forward and backward as one joint graph and
its partitioner (`min_cut_rematerialization_partition`, the one inductor uses) decides which
forward values the backward receives: the rest is recomputed inside the fused backward kernels.
Those saved values are the outputs of the forward graph beyond the block's own output. This
module runs the partitioner as inductor runs it (no code is generated) and counts the saved
values' bytes, two ways:
- `partitioner_saved`: one block of our decoder on CPU at small shapes (its values all scale with
  the tokens, so the choice is the same at llama3-8b's widths); hybrid/estimation/memory/activations.py
  states it per token, and tests/runtime/test_compile.py holds the two equal, and both to what a
  block compiled with inductor keeps on CPU ranks.
- `block_saved`: one block of a transformers decoder, checkpointed and compiled as the runtime does,
  on real CPU tensors or on fake tensors at the published widths (where small values are involved,
  an MoE router's, the choice changes with the widths); the reference of the closed forms in
  hybrid/estimation/memory/compiled.py (tests/estimation/test_compiled_blocks.py).
The CPU trace takes the attention through SDPA's flash kernel, as CUDA does (the meta device would
take the math path, which saves the s x s softmax).
"""
from __future__ import annotations

import contextlib
import logging
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

    from ..model.decoder import build_decoder

    two = DecoderConfig(**{**cfg.__dict__, "layers": 2})            # checkpointing wants repeated blocks
    model = build_decoder(two, device="cpu", dtype=dtype)
    _checkpoint(model, checkpointing)
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


@dataclass(frozen=True)
class SavedValue:
    """One storage a compiled block's forward hands to its backward."""

    name: str
    """The forward graph's node (the first one on this storage)."""
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    """The whole storage's bytes (a view saved is its base's storage, counted once)."""
    kind: str
    """'activation' (made by the block), 'input' (the block's hidden-state input, a (batch, seq,
    hidden) primal) or 'shared' (another primal: a weight, the rotary tables, the attention mask,
    alive whatever the block keeps)."""


def block_saved(build, index: int, mode: str, batch: int, seq: int, fake: bool = False) -> tuple[SavedValue, ...]:
    """What AOTAutograd's min-cut partitioner (inductor's) saves for the backward of block `index` of
    a transformers decoder, checkpointed as the backends checkpoint it (`mode`) and compiled as
    runtime/compile.py compiles it, with a backend that partitions and generates no code; one
    forward at (batch, seq). `build()` returns the model: on CPU for real tensors, or, with `fake`,
    built under a FakeTensorMode at any width (nothing is allocated; the CPU kernels are chosen, SDPA's
    flash among them, as on CUDA). The reference the closed forms of compiled read blocks are held to."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import _disable_current_modes

    from ..model.decoder import prepare_for_training
    from ..model.profile import find_blocks
    from ..runtime.compile import compile_block
    from .traced import unpacked_batches
    found: list[tuple] = []

    def partition(joint, inputs, **kw):
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="inductor", **kw)
        out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
        for n in out[kw["num_fwd_outputs"]:]:
            v, base = n.meta.get("val"), _base(n)
            if isinstance(v, torch.Tensor) and all(isinstance(s, int) for s in v.shape):
                found.append((n.name, v, base.name, base.op == "placeholder", base.meta["val"]))
        return fw, bw

    backend = aot_autograd(fw_compiler=lambda g, _: g, bw_compiler=lambda g, _: g, partition_fn=partition)
    modes = (FakeTensorMode(allow_non_fake_inputs=True), unpacked_batches()) if fake else ()
    with _disable_current_modes(), _quiet_context_fn(), contextlib.ExitStack() as stack:
        for m in modes:
            stack.enter_context(m)
        torch._dynamo.reset()
        try:
            model = build()
            prepare_for_training(model)
            _checkpoint(model, mode)
            compile_block(find_blocks(model)[1][index], backend=backend, dynamic=False)
            model(input_ids=torch.zeros(batch, seq, dtype=torch.long))
            hidden = model.get_input_embeddings().weight.shape[1]
        finally:
            torch._dynamo.reset()
    kinds = ("input", "shared", "activation")
    saved: dict = {}
    for name, v, base, primal, whole in found:       # a view is its base's storage, counted once
        kind = ("input" if tuple(whole.shape) == (batch, seq, hidden) else "shared") if primal else "activation"
        if base not in saved or kinds.index(kind) < kinds.index(saved[base].kind):
            saved[base] = SavedValue(name, tuple(v.shape), str(v.dtype).replace("torch.", ""),
                                     whole.untyped_storage().nbytes(), kind)
    return tuple(saved.values())


_VIEWS = ("view", "_unsafe_view", "reshape", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
          "squeeze", "alias", "detach", "split", "split_with_sizes", "unbind", "chunk", "narrow", "view_as_real",
          "view_as_complex")


def _base(node):
    """The node whose storage `node` is a view of (following aten view ops back in the graph)."""
    while node.op == "call_function" and node.args and hasattr(node.args[0], "op"):
        packet = getattr(node.target, "overloadpacket", None)
        if getattr(packet, "__name__", None) not in _VIEWS:
            if node.target.__name__ != "getitem" or not _splits(node.args[0]):
                break
        node = node.args[0]
    return node


def _splits(node) -> bool:
    """Whether `node` is a split whose pieces (taken by getitem) are views of its input."""
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", None)
    return name in ("split", "split_with_sizes", "unbind", "chunk")


def _checkpoint(model, mode: str) -> None:
    from ..runtime.activation_checkpoint import apply_activation_checkpointing
    apply_activation_checkpointing(model, mode)


class _ContextFnNote(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "context_fn is passed to torch.utils.checkpoint" not in record.getMessage()


@contextlib.contextmanager
def _quiet_context_fn():
    """Without torch's note that a checkpoint context_fn (the selective policy) is traced by
    torch.compile: these traces are the reference's own, and the policy's regions hold no in-place
    op (the note's concern); a user's compiled run still shows it."""
    quiet, logger = _ContextFnNote(), logging.getLogger("torch._higher_order_ops.wrap")
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
