"""Training steps under a MemoryTracker, with phase labels and relabelling by backend roles.
Shared by the traced (fake tensors) and measured (real tensors) estimates."""
from __future__ import annotations

import torch
import torch.utils._pytree

from ..runtime.backends.base import Engine, call_with_batch
from ..model.profile import find_blocks
from .tracker import MemoryTracker


def relabel(tracker: MemoryTracker, engine: Engine) -> None:
    for label, tensors in engine.tensor_roles().items():
        tracker.relabel(tensors, label)


def _mark_blocks(tracker: MemoryTracker, blocks) -> list:
    """Set tracker.phase and tracker.position as the blocks run. After the last block's forward
    the head runs ('head'); when the gradient reaches that block's output, the loss and head
    backward are done and the blocks' backward begins ('blocks'). Positions: in forward when each
    block starts, in backward when the gradient reaches each block's output (its backward starts)
    and the first block's input (the blocks are done). Recomputation inside backward is not a
    forward: it is ignored."""
    n, handles = len(blocks), []

    def first_grad(tensors):
        return next((t for t in torch.utils._pytree.tree_flatten(tensors)[0]
                     if isinstance(t, torch.Tensor) and t.requires_grad), None)

    def order(i: int, backward: bool) -> str:
        j = n - 1 - i if backward else i
        return "first" if j == 0 else "last" if j == n - 1 else "mid"

    def on_grad(position, phase=None):
        def hook(grad):
            if phase:
                tracker.phase = phase
            tracker.position = position
        return hook

    for i, block in enumerate(blocks):
        def pre(module, args, i=i):
            if tracker.phase != "forward":
                return
            tracker.position = order(i, False)
            x = first_grad(args) if i == 0 else None
            if x is not None:
                x.register_hook(on_grad("post"))

        def post(module, args, output, i=i):
            if i == n - 1:
                tracker.phase = "head"          # also after the last block's recomputation
            elif tracker.phase != "forward":
                return
            y = first_grad(output)
            if y is not None:
                y.register_hook(on_grad(order(i, True), "blocks" if i == n - 1 else None))
        handles += [block.register_forward_pre_hook(pre), block.register_forward_hook(post)]
    return handles


def prime_optimizer(engine: Engine, tracker: MemoryTracker) -> None:
    """Create the optimizer's state as a first step would, without running one: zero gradients
    shaped like the trainable parameters (sharded as they are), one optimizer step, no gradients.
    The next step is then the steady state a second training step would be."""
    tracker.phase = "step"
    engine.zero_grads()
    relabel(tracker, engine)
    engine.step()
    relabel(tracker, engine)
    engine.zero_grad()


def tracked_steps(engine: Engine, batch, tracker: MemoryTracker, steps: int = 2, on_step=None,
                  accumulation: int = 1) -> None:
    """Phases: forward (the blocks: activations), head (final norm, logits, loss: temporaries),
    loss (its backward), blocks (the blocks' backward), step. Two steps by default: optimizer
    states appear during the first step, so the second one holds the steady-state peak. Each step
    is the job's accumulation window, as the training loop runs it (runtime/wrapped.py):
    `accumulation` micro-batches, gradients reduced across ranks only in the last one's backward."""
    blocks = find_blocks(engine.model)[1]
    hooks = _mark_blocks(tracker, blocks) if blocks else []
    try:
        for i in range(steps):
            for k in range(accumulation):
                sync = k == accumulation - 1
                engine.set_sync(sync)
                tracker.phase = "forward"
                if engine.cp is not None:          # whole sequences in, this rank's chunks run
                    out = engine.cp.forward(engine, (batch,), {})
                else:
                    out = call_with_batch(engine.forward, (batch,), {})
                loss = out.loss if hasattr(out, "loss") else out
                tracker.phase = "loss"
                engine.backward(loss, accumulation, sync=sync)
                del out, loss
                relabel(tracker, engine)           # gradients exist now
                if not sync and engine.owns_accumulation:
                    engine.step(False)             # DeepSpeed counts its micro-batches itself
            tracker.phase = "step"
            engine.step()
            relabel(tracker, engine)           # optimizer state exists now
            engine.zero_grad()
            if on_step:
                on_step(i)
    finally:
        for h in hooks:
            h.remove()


def tracked_schedule_steps(engine, ids, tracker: MemoryTracker, steps: int = 2) -> None:
    """A pipeline's steps under the tracker (runtime/backends/pipeline.PipelineEngine.train_step: the
    schedule runs every micro-batch's forward and backward, then the optimizer step): `ids` is the
    window's micro-batches of token ids, its own labels. The schedule interleaves the phases, so they
    are not labelled: only the peak and what the engine names (relabel) are read."""
    for _ in range(steps):
        tracker.phase = "forward"
        engine.train_step(ids, ids, None, None)
        relabel(tracker, engine)
