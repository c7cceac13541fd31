"""What auto_wrap returns: one object, the same training loop whatever the backend.

    for batch in loader:                 # one micro-batch per iteration
        loss = w(batch).loss
        w.backward(loss)                 # loss / accumulation; reduced only on the window's last
        w.step()                         # clip, optimizer, scheduler: on the window's last only
        w.zero_grad()                    # likewise

Every backend does accumulation, clipping, loss scaling and scheduling the same way from the
user's point of view; which library call does it is the engine's business (runtime/backends/base.py).
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping

import torch
import torch.distributed as dist

from .backends.base import Engine, call_with_batch
from ..errors import HybridError
from ..log import get_logger
from ..planning.planner import Candidate, Plan
from ..planning.report import format_plan

log = get_logger(__name__)


class Wrapped:
    """Call it like the model; then backward(loss), step(), zero_grad().

    plan              the decision with every candidate and the reason (print it)
    module            the user's model (sharded in place for FSDP; the inner module for DeepSpeed)
    sync_gradients    True on the micro-batch that ends an accumulation window
    grad_norm         the last pre-clip global gradient norm (float), None before the first step
    optimizer_steps   optimizer steps taken (accumulation windows completed), skipped steps included
    skipped_steps     of those, how many were skipped: fp16 loss scaling's overflows, and steps with a
                      non-finite loss or gradient norm on any rank (skipped on every rank)
    max_bad_steps     non-finite steps in a row that stop training (a HybridError on every rank)
    scheduler         the LR scheduler built from scheduler=, stepped after each optimizer step
    ft                fault_tolerant=True: this rank's torchft replica group (hybrid/runtime/ft.py), else None
    """

    def __init__(self, engine: Engine, plan: Plan, chosen: Candidate, mesh, runtime,
                 gradient_accumulation: int = 1, max_grad_norm: float | None = None, scheduler=None,
                 max_bad_steps: int = 3):
        check_max_bad_steps(max_bad_steps)
        self.engine, self.plan, self.chosen = engine, plan, chosen
        self.mesh, self.runtime = mesh, runtime
        self.gradient_accumulation = gradient_accumulation
        self.max_grad_norm = max_grad_norm
        self.scheduler = scheduler
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self.max_bad_steps = max_bad_steps
        self._bad_in_row = 0         # non-finite steps in a row
        self._loss_bad = None        # bool tensor: a non-finite loss among this window's micro-batches
        self._micro = 0              # index of the current micro-batch in its window
        self._backward_done = False  # backward() called since the last step()
        self._norm = None            # tensor or float; read lazily (no host sync per step)
        self._clipped = False        # clip_grad_norm_ already ran in this window
        self._saver = None           # hybrid.ckpt.background.AsyncSaver of the async saves
        self._tracked: dict = {}     # name -> object whose state every checkpoint carries (track)
        self._restored: dict = {}    # name -> state loaded before its object was tracked
        self._loaded = False        # a checkpoint was loaded (track then names what it lacks)
        self.resumed_from = None     # the checkpoint folder auto_wrap(resume=) loaded, else None
        self.ft = None               # FaultTolerantReplicas under fault_tolerant=True

    # --- the loop ------------------------------------------------------------------------------
    @property
    def strategy(self):
        return self.chosen.strategy

    @property
    def micro_batch(self) -> int:
        """Sequences each data-parallel rank feeds per forward: the plan's (chosen at a global batch)."""
        return self.chosen.spec.micro_batch

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step over all ranks: micro_batch x gradient_accumulation x dp_size."""
        return self.micro_batch * self.gradient_accumulation * self.chosen.parallel.dp_size

    @property
    def module(self):
        return self.engine.model

    @property
    def optimizer(self):
        return self.engine.optimizer

    @property
    def step_count(self) -> int:
        """Alias of optimizer_steps (the name checkpoints and earlier versions use)."""
        return self.optimizer_steps

    @step_count.setter
    def step_count(self, value: int) -> None:
        self.optimizer_steps = value

    @property
    def sync_gradients(self) -> bool:
        return self._micro == self.gradient_accumulation - 1

    @property
    def grad_norm(self) -> float | None:
        if self._norm is not None and not isinstance(self._norm, float):
            self._norm = float(self._norm)
        return self._norm

    @property
    def parallel(self):
        """The layout (ParallelDims) this job runs on."""
        return self.chosen.parallel

    @property
    def dp_size(self) -> int:
        """Data-parallel ranks: each reads a different shard of the data
        (DistributedSampler(num_replicas=w.dp_size, rank=w.dp_rank))."""
        return self.parallel.dp_size

    @property
    def dp_rank(self) -> int:
        """This rank's index among the data-parallel ranks (equal to the rank when cp = tp = pp = 1)."""
        return self.mesh["dp_replicate"].get_local_rank() * self.parallel.dp_shard + \
            self.mesh["dp_shard"].get_local_rank()

    def __call__(self, *args, **kwargs):
        """The model's forward. With cp > 1 pass whole sequences (the same on every rank of a cp
        group): each rank runs its chunks, the loss is the whole sequences' mean, the logits
        this rank's chunks (hybrid.runtime.backends.cp.rank_positions says which)."""
        self.engine.set_sync(self.sync_gradients)
        if self.ft is not None and self._micro == 0:
            self.ft.begin()          # the step's quorum; a group behind heals from a peer here
        with self._guard("forward"):
            if self.engine.cp is not None:
                return self.engine.cp.forward(self.engine, args, kwargs)
            return call_with_batch(self.engine.forward, args, kwargs)

    def backward(self, loss) -> None:
        """Accumulate this micro-batch's gradients (loss / gradient_accumulation); gradients are
        reduced across ranks only on the window's last micro-batch."""
        if isinstance(loss, torch.Tensor):
            value = loss.detach()
            bad = ~torch.isfinite(value.full_tensor() if hasattr(value, "full_tensor") else value).all()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        with self._guard("backward"):
            self.engine.backward(loss, self.gradient_accumulation, sync=self.sync_gradients)
            if self.ft is not None and self.sync_gradients:
                self.ft.reduce_gradients()      # averaged across the replica groups in the quorum
        self._backward_done = True

    def clip_grad_norm_(self, max_norm: float) -> float:
        """Clip the accumulated gradients to `max_norm` (global L2 norm over every rank) and
        return the pre-clip norm. Call it after backward() on the window's last micro-batch."""
        if not self.sync_gradients or not self._backward_done:
            raise HybridError("clip_grad_norm_ needs the window's complete gradients: call it after backward() on "
                              "the micro-batch where w.sync_gradients is True, or pass max_grad_norm= to auto_wrap")
        with self._guard("clip_grad_norm_"):
            self._norm = self.engine.clip_grad_norm(float(max_norm))
        self._clipped = True
        return self.grad_norm

    def step(self) -> None:
        """On the window's last micro-batch: unscale (fp16), clip (max_grad_norm), optimizer step,
        scheduler step. On the others: only advance the window. A non-finite loss or gradient norm on
        any rank skips the step on every rank (gradients zeroed; parameters, optimizer state and
        scheduler untouched) with one warning; max_bad_steps of them in a row raise HybridError."""
        if not self._backward_done:
            raise HybridError("step() was called before backward(): call w.backward(loss) on every micro-batch "
                              "first")
        sync = self.sync_gradients
        if sync and self.ft is not None and not self.ft.commit():
            self.engine.drop_step()             # a group failed this step: nothing steps, the step is retried
            self._loss_bad, self._backward_done, self._clipped, self._micro = None, False, False, 0
            return
        if sync or self.engine.owns_accumulation:
            with self._guard("step"):
                result = self.engine.step(sync, None if self._clipped else self.max_grad_norm,
                                          self._loss_bad if sync else None)
            if sync:
                self._loss_bad = None
                self._after_step(result)
        self._backward_done = False
        self._clipped = False
        self._micro = (self._micro + 1) % self.gradient_accumulation

    def train_step(self, batch, loss_fn=None) -> float:
        """One optimizer step: forward and backward of every micro-batch, clipping, the optimizer
        and scheduler step. `batch` is this data-parallel rank's share of the step:
        gradient_accumulation x micro_batch sequences, a tensor of token ids or a dict with
        `input_ids` (and `labels`, default: the ids; the loss shifts them). The loss is the
        model's own (labels=) or loss_fn(logits, labels). Returns the step's mean loss over its
        micro-batches and the data-parallel ranks, the same float on every rank. The one loop
        that works for every layout, pipelines included."""
        if self._micro != 0:
            raise HybridError(f"train_step() in the middle of an accumulation window (micro-batch {self._micro} of "
                              f"{self.gradient_accumulation}): finish the window with step() first")
        ids, labels = _ids_and_labels(batch)
        ga = self.gradient_accumulation
        if ids.dim() < 2 or ids.shape[0] % ga:
            raise HybridError(f"train_step needs a batch of gradient_accumulation ({ga}) x micro_batch sequences "
                              f"(batch, seq); got shape {tuple(ids.shape)}")
        if loss_fn is not None and self.engine.cp is not None:
            raise HybridError("train_step(loss_fn=) with cp > 1: each rank holds only its chunks of the logits; "
                              "use the model's own loss (labels in the batch) or cp 1")
        from .backends.pipeline import PipelineEngine
        if isinstance(self.engine, PipelineEngine):
            with self._guard("train_step"):
                local, result = self.engine.train_step(ids, labels, loss_fn, self.max_grad_norm)
            self._after_step(result)
            return _mean_over_ranks(local, self.parallel.pp)
        losses = []
        for mb_ids, mb_labels in zip(ids.chunk(ga), labels.chunk(ga)):
            if loss_fn is None:
                loss = self({"input_ids": mb_ids, "labels": mb_labels}).loss
            else:
                out = self(mb_ids)
                loss = loss_fn(getattr(out, "logits", out), mb_labels)
            self.backward(loss)
            self.step()
            self.zero_grad()
            losses.append(loss.detach().float())
        return _mean_over_ranks(torch.stack(losses).mean(), 1)

    def _after_step(self, result) -> None:
        if result.norm is not None:
            self._norm = result.norm
        self.optimizer_steps += 1
        self.skipped_steps += result.skipped
        if self.scheduler is not None and not result.skipped:
            self.scheduler.step()
        from .mesh import note_step
        note_step(self.optimizer_steps)
        self._bad_in_row = self._bad_in_row + 1 if result.nonfinite else 0
        if not result.nonfinite:
            return
        if self._bad_in_row >= self.max_bad_steps:
            raise HybridError(f"{self._bad_in_row} optimizer steps in a row had a non-finite loss or gradient norm "
                              f"(NaN/inf; max_bad_steps={self.max_bad_steps}), all skipped: training stopped at "
                              f"step {self.optimizer_steps}; load the last checkpoint and lower the learning rate, "
                              "clip (max_grad_norm=) or check the data")
        if self.runtime.rank == 0:
            log.warning("hybrid: step %d skipped on every rank: non-finite loss or gradient norm (NaN/inf) on some "
                        "rank (%d in a row; %d stop training)", self.optimizer_steps, self._bad_in_row,
                        self.max_bad_steps)

    def zero_grad(self) -> None:
        """Clear gradients after an optimizer step; inside a window it keeps them (accumulating)."""
        if self._micro == 0:
            self.engine.zero_grad()

    @contextlib.contextmanager
    def _guard(self, what: str):
        """Collectives that fail because a peer left or died become one HybridError line."""
        from .mesh import is_peer_failure, peer_failure
        start = time.monotonic()
        try:
            yield
        except HybridError:
            raise
        except Exception as e:  # noqa: BLE001
            translated = self.engine.translate_error(e)
            if translated is not None:
                raise translated from None
            if self.runtime.world_size > 1 and is_peer_failure(e):
                raise peer_failure(e, what, time.monotonic() - start) from None
            raise

    # --- state ---------------------------------------------------------------------------------
    def state_dict(self):
        """The full, unsharded model state on every rank (CPU tensors, the model's own names);
        a collective for FSDP and ZeRO: call it on every rank."""
        return self.engine.full_state_dict()

    def save(self, path: str, extra: dict | None = None, overwrite: bool = False, async_: bool = False) -> str:
        """Sharded, resumable checkpoint, loadable under another strategy or world size; the
        previous version at `path` stays valid until this one is complete. Collective. Call it at
        an accumulation boundary (after step() on the window's last micro-batch).
        With async_=True it returns once the state is copied into host memory (DCP's staging) and
        writes and commits it in the background; the next save, load, wait_for_checkpoint() and
        close() wait for it (a failure in the background is raised there, on every rank).
        A directory holding files hybrid did not write is refused unless overwrite=True (which
        writes beside them; nothing foreign is ever deleted). Refused (one line, every rank) after a
        backward() whose step() has not run, and when any parameter on any rank is non-finite (the
        last good version stays). Returns the version folder (for async_: once committed)."""
        from ..ckpt.store import save
        if self._micro != 0 or self._backward_done:
            where = ", after backward() and before step()" if self._backward_done else ""
            raise HybridError(f"save() in the middle of an accumulation window (micro-batch {self._micro + 1} of "
                              f"{self.gradient_accumulation}{where}): its gradients would not be in the checkpoint; "
                              "save after step() on the window's last micro-batch")
        self.wait_for_checkpoint()
        with self._guard("save"):
            if not self.engine.params_finite():
                raise HybridError(f"save({path!r}) refused: the parameters hold non-finite values (NaN/inf) on some "
                                  "rank, and the checkpoint's last good version is kept; load it (w.load) and lower "
                                  "the learning rate or clip (max_grad_norm=)")
            if async_ and self._saver is None:
                from ..ckpt.background import AsyncSaver
                self._saver = AsyncSaver()
            return save(self, path, extra, overwrite, self._saver if async_ else None)

    def wait_for_checkpoint(self, timeout: float | None = None) -> str | None:
        """Wait until the async save in flight is committed (at most `timeout` seconds, default
        HYBRID_CKPT_TIMEOUT, 1800) and return its version folder; None when none is in flight.
        Raises the save's failure (HybridError, the same on every rank)."""
        return self._saver.wait(timeout) if self._saver is not None else None

    def close(self, timeout: float | None = None) -> None:
        """End of training: wait for the async save in flight (as wait_for_checkpoint) and free
        its host staging buffers. The model stays usable; a later async save stages afresh."""
        if self._saver is not None:
            self._saver.close(timeout)

    def track(self, obj, name: str = "data"):
        """Carry `obj`'s state in every checkpoint: anything with state_dict() / load_state_dict()
        whose state is plain data and the same on every rank, such as ResumableSampler (its epoch
        and position in global samples, which it re-splits over any world size). If this job was
        resumed (auto_wrap(resume=) or load), the saved state is loaded into it now. Returns `obj`.

            sampler = w.track(ResumableSampler(len(data), w.dp_size, w.dp_rank, seed=0))
        """
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise HybridError(f"track() takes an object with state_dict() and load_state_dict() (a ResumableSampler, "
                              f"a stateful data loader); got {type(obj).__name__}")
        if not isinstance(name, str) or not name:
            raise HybridError(f"track(name=) must be a non-empty string, got {name!r}")
        if name in self._tracked:
            raise HybridError(f"track(): {name!r} is tracked already; give each tracked object its own name=")
        self._tracked[name] = obj
        if name in self._restored:
            obj.load_state_dict(self._restored.pop(name))
        elif self._loaded:
            _note_untracked(self, name)
        return obj

    def load(self, path: str) -> dict:
        """Restore model, optimizer, scheduler, loss scaler, step counts, RNG and tracked objects'
        state (track); returns the `extra` given to save."""
        return self.load_checkpoint(path)["extra"]

    def load_checkpoint(self, path: str) -> dict:
        """load(path), returning the checkpoint's whole meta.json (step, world_size, strategy, extra...)."""
        from ..ckpt.store import load
        self.wait_for_checkpoint()
        with self._guard("load"):
            meta = load(self, path)
        if self.ft is not None:
            self.ft.loaded()                    # torchft's step follows the checkpoint's
        _note_rng(self, path, meta)
        return meta

    def loop_state(self) -> dict:
        """What the checkpoint keeps besides tensors (plain data: weights_only-loadable)."""
        return {"optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
                "scaler": self.engine.scaler_state(),
                "tracked": {name: obj.state_dict() for name, obj in self._tracked.items()}}

    def load_loop_state(self, state: dict) -> None:
        self.optimizer_steps = int(state.get("optimizer_steps", self.optimizer_steps))
        self.skipped_steps = int(state.get("skipped_steps", 0))
        if self.scheduler is not None and state.get("scheduler") is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler") is not None:
            self.engine.load_scaler_state(state["scaler"])
        self._restored = dict(state.get("tracked") or {})
        self._loaded = True
        for name, obj in self._tracked.items():      # tracked already; the others wait for track()
            if name in self._restored:
                obj.load_state_dict(self._restored.pop(name))
            else:
                _note_untracked(self, name)
        self._micro, self._backward_done, self._loss_bad, self._bad_in_row = 0, False, None, 0

    def describe(self, every_candidate: bool = False) -> str:
        """The plan: one row per strategy, or every candidate (shard sizes x checkpointing)."""
        return format_plan(self.plan, summary=not every_candidate)

    def __repr__(self) -> str:
        return (f"Wrapped({self.strategy.name}, shard_size={self.chosen.shard_size}, "
                f"world={self.runtime.world_size}, device={self.runtime.device}, "
                f"gradient_accumulation={self.gradient_accumulation})")


def check_max_bad_steps(n) -> None:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise HybridError(f"max_bad_steps must be a positive integer (non-finite steps in a row that stop training; "
                          f"default 3), got {n!r}")


def _note_untracked(w, name: str) -> None:
    """A tracked object the loaded checkpoint has no state for keeps its own (said once, rank 0)."""
    if w.runtime.rank == 0:
        log.warning("hybrid: the loaded checkpoint carries no state for tracked %r (saved before it was tracked): it "
                    "keeps its current state; a sampler then starts its epoch from the beginning", name)


def _note_rng(w, path: str, meta: dict) -> None:
    """One line saying whether load restored this rank's RNG state or reseeded it: per-rank states
    map onto ranks only at the world size that wrote them (hybrid.ckpt.store.load)."""
    import random

    world, rank = w.runtime.world_size, w.runtime.rank
    if meta["world_size"] == world and f"rng-{rank}.pt" in meta["files"]:
        if rank == 0:
            log.info("hybrid: RNG state restored from %s (%d ranks, as saved)", path, world)
        return
    seed = (int(meta["step"]) * 1_000_003 + rank) % 2**63      # every rank its own stream, reproducible
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
        np.random.seed(seed % 2**32)
    except ImportError:
        pass
    if rank == 0:
        log.info("hybrid: RNG reseeded (torch, cuda, random, numpy: seed step*1000003 + rank): the checkpoint %s "
                 "was saved on %d ranks and this job runs %d, so its per-rank RNG states do not map",
                 path, meta["world_size"], world)


def _ids_and_labels(batch):
    if isinstance(batch, torch.Tensor):
        return batch, batch
    if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
        ids = batch["input_ids"]
        return ids, batch.get("labels", ids)
    raise HybridError(f"train_step takes a tensor of token ids or a dict with 'input_ids' (and 'labels'); got "
                      f"{type(batch).__name__}")


def _mean_over_ranks(local: torch.Tensor, pp: int) -> float:
    """The mean over data-parallel ranks of a per-rank loss held by one rank per pipeline (the
    last stage; zero elsewhere): a sum over the world divided by the ranks that hold one
    (tensor-parallel ranks hold the same value, so they count as one each)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return float(local)
    t = local.detach().float().reshape(()).clone()
    if dist.get_backend() == "nccl":
        t = t.cuda()
    dist.all_reduce(t)
    return float(t) / (dist.get_world_size() // pp)
