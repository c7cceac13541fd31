"""Training steps under a MemoryTracker, with phase labels and relabelling by backend roles.
Shared by the traced (fake tensors) and measured (real tensors) estimates."""
from __future__ import annotations

import torch
import torch.utils._pytree

from ..backends.base import Engine, call_with_batch
from ..profile import find_blocks
from .tracker import MemoryTracker


def relabel(tracker: MemoryTracker, engine: Engine) -> None:
    for label, tensors in engine.tensor_roles().items():
        tracker.relabel(tensors, label)


def _mark_phases(tracker: MemoryTracker, last_block):
    """After the last block's forward the head runs ('head'); when the gradient reaches that
    block's output, the loss and head backward are done and the blocks' backward begins."""
    def after_forward(module, args, output):
        tracker.phase = "head"
        first = next((t for t in torch.utils._pytree.tree_flatten(output)[0]
                      if isinstance(t, torch.Tensor) and t.requires_grad), None)
        if first is not None:
            first.register_hook(lambda grad: setattr(tracker, "phase", "blocks"))
    return last_block.register_forward_hook(after_forward)


def tracked_steps(engine: Engine, batch, tracker: MemoryTracker, steps: int = 2, on_step=None) -> None:
    """Phases: forward (the blocks: activations), head (final norm, logits, loss: temporaries),
    loss (its backward), blocks (the blocks' backward), step. Two steps by default: optimizer
    states appear during the first step, so the second one holds the steady-state peak."""
    blocks = find_blocks(engine.model)[1]
    hook = _mark_phases(tracker, blocks[-1]) if blocks else None
    try:
        for i in range(steps):
            tracker.phase = "forward"
            out = call_with_batch(engine.forward, (batch,), {})
            loss = out.loss if hasattr(out, "loss") else out
            tracker.phase = "loss"
            engine.backward(loss)
            del out, loss
            relabel(tracker, engine)           # gradients exist now
            tracker.phase = "step"
            engine.step()
            relabel(tracker, engine)           # optimizer state exists now
            engine.zero_grad()
            if on_step:
                on_step(i)
    finally:
        if hook:
            hook.remove()
