"""What auto_wrap returns: one object, the same training loop whatever the backend."""
from __future__ import annotations

from .backends.base import Engine, call_with_batch
from .planner import Candidate, Plan
from .report import format_plan


class Wrapped:
    """Call it like the model; then backward(loss), step(), zero_grad().

    plan     the decision with every candidate and the reason (print it)
    module   the user's model (sharded in place for FSDP; the inner module for DeepSpeed)
    """

    def __init__(self, engine: Engine, plan: Plan, chosen: Candidate, mesh, runtime):
        self.engine, self.plan, self.chosen = engine, plan, chosen
        self.mesh, self.runtime = mesh, runtime
        self.step_count = 0

    @property
    def strategy(self):
        return self.chosen.strategy

    @property
    def module(self):
        return self.engine.model

    @property
    def optimizer(self):
        return self.engine.optimizer

    def __call__(self, *args, **kwargs):
        return call_with_batch(self.engine.forward, args, kwargs)

    def backward(self, loss) -> None:
        self.engine.backward(loss)

    def step(self) -> None:
        self.engine.step()
        self.step_count += 1

    def zero_grad(self) -> None:
        self.engine.zero_grad()

    def state_dict(self):
        """The full, unsharded model state on every rank (CPU tensors, the model's own names);
        a collective for FSDP and ZeRO: call it on every rank."""
        return self.engine.full_state_dict()

    def save(self, path: str, extra: dict | None = None) -> str:
        """Sharded, resumable checkpoint, loadable under another strategy or world size; the
        previous version at `path` stays valid until this one is complete. Collective."""
        from .checkpoint import save
        return save(self, path, extra)

    def load(self, path: str) -> dict:
        """Restore model, optimizer, step count and RNG; returns the `extra` given to save."""
        from .checkpoint import load
        return load(self, path)

    def describe(self, every_candidate: bool = False) -> str:
        """The plan: one row per strategy, or every candidate (shard sizes x checkpointing)."""
        return format_plan(self.plan, summary=not every_candidate)

    def __repr__(self) -> str:
        return (f"Wrapped({self.strategy.name}, shard_size={self.chosen.shard_size}, "
                f"world={self.runtime.world_size}, device={self.runtime.device})")
