"""The engine every backend returns, and the helpers the backends share (unit discovery, outputs, state)."""
from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, is_dataclass

import torch
import torch.nn as nn

from ...errors import HybridError
from ...model.profile import find_blocks


@dataclass(frozen=True)
class StepResult:
    norm: object = None
    """The pre-clip global gradient norm (a tensor or float), None if the backend has none."""
    skipped: int = 0
    """1 when the optimizer step was skipped (fp16 loss scaling's overflow, or a non-finite step)."""
    nonfinite: bool = False
    """True when a non-finite loss or gradient norm on some rank skipped the step on every rank."""


class Engine(ABC):
    """What Wrapped drives: the same verbs whatever the library underneath. The default
    implementation is the torch one (DDP, FSDP2): autograd accumulates into .grad, a sync
    context decides whether backward reduces, clipping and loss scaling act on .grad."""

    family: str = ""
    pp_size: int = 1
    """Pipeline stages: each holds different parameters, so norms add across them."""
    owns_accumulation: bool = False
    """True when the library counts micro-batches itself (DeepSpeed): step() runs every micro-batch."""

    def __init__(self, model: nn.Module, runner, optimizer, scaler=None, tp=None):
        self.model = model          # the user's module (FSDP2 shards it in place)
        self.runner = runner        # what forward calls: DDP / the FSDP module / the DeepSpeed engine
        self.optimizer = optimizer
        self.scaler = scaler        # torch.amp.GradScaler (fp16-mixed) or None
        self.tp = tp                # backends.tp.TensorParallel when tp > 1, else None
        self.cp = None              # backends.cp.ContextParallel when cp > 1, else None
        self._unscaled = False

    def _tp_context(self):
        return self.tp.context() if self.tp is not None else contextlib.nullcontext()

    def forward(self, *args, **kwargs):
        with self._tp_context():
            out = self.runner(*args, **kwargs)
        if self.tp is not None:      # a loss computed on vocab shards is a replicated DTensor
            loss = getattr(out, "loss", None)
            if hasattr(loss, "full_tensor"):
                out.loss = loss.full_tensor()
        return out

    def set_sync(self, sync: bool) -> None:
        """Before a micro-batch's forward: whether its backward reduces gradients across ranks
        (False inside an accumulation window)."""

    def sync_context(self, sync: bool):
        """Around backward, for libraries that decide there."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, accumulation: int = 1, sync: bool = True) -> None:
        if accumulation > 1:
            loss = loss / accumulation
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        with self.sync_context(sync), self._tp_context():
            loss.backward()

    def _unscale(self) -> None:
        if self.scaler is not None and not self._unscaled:
            self.scaler.unscale_(self.optimizer)
            self._unscaled = True

    def _grad_params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.grad is not None]

    def total_norm(self) -> torch.Tensor:
        """Global L2 norm of every gradient over every rank. Plain gradients (DDP: the same on
        every rank after its all-reduce) need no communication. DTensor gradients (FSDP, TP) are
        summed as local shards' squares over the world in one all-reduce, each divided by how many
        ranks hold a replica of it (its Replicate mesh dimensions, and every rank outside its mesh:
        a tensor sharded over dp_shard alone is replicated across tp and dp_replicate), so nothing
        counts twice. Under a pipeline the replicas are the ranks of one stage, and a parameter
        two stages hold (a tied head's copy, _norm_skip) is left out on one of them."""
        import math

        import torch.distributed as dist
        skip = self._norm_skip()
        grads = [p.grad for p in self._grad_params() if id(p) not in skip]
        sharded = [g for g in grads if hasattr(g, "_local_tensor")]
        if self.pp_size == 1 and not grads:
            return torch.zeros(())
        if self.pp_size == 1 and not sharded:
            return torch.nn.utils.get_total_norm(grads, 2.0)
        stage_world = dist.get_world_size() // self.pp_size
        device = grads[0].device if grads else ("cuda" if dist.get_backend() == "nccl" else "cpu")
        total = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            if hasattr(g, "_local_tensor"):
                mesh = g.device_mesh
                copies = (stage_world // mesh.size()) * math.prod(
                    mesh.size(i) for i, pl in enumerate(g.placements) if pl.is_replicate())
                local = g._local_tensor
            else:
                copies, local = stage_world, g
            total = total + torch.linalg.vector_norm(local, 2.0, dtype=torch.float32) ** 2 / copies
        dist.all_reduce(total)
        return total.sqrt()

    def _norm_skip(self) -> set[int]:
        """ids of parameters this rank leaves out of the global norm (counted on another rank)."""
        return set()

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        self._unscale()
        norm = self.total_norm()
        coef = torch.clamp(max_norm / (norm + 1e-6), max=1.0)    # torch.nn.utils.clip_grad_norm_'s rule
        for p in self._grad_params():
            getattr(p.grad, "_local_tensor", p.grad).mul_(coef.to(p.grad.device))   # each rank scales its shard
        return norm

    def step(self, sync: bool = True, max_norm: float | None = None, loss_bad=None) -> StepResult:
        """The window's optimizer step, skipped on every rank when any rank's loss (`loss_bad`: a
        bool tensor, this rank's micro-batches) or the global gradient norm is non-finite."""
        self._unscale()
        norm = self.clip_grad_norm(max_norm) if max_norm is not None else self.total_norm()
        # under fp16 an inf/nan gradient is the scaler's overflow (it skips and lowers the scale)
        grads_bad = None if self.scaler is not None else ~torch.isfinite(torch.as_tensor(norm))
        if not _is_fake(norm) and agree_any(grads_bad, loss_bad, _device_of(norm)):
            self.zero_grad()
            if self.scaler is not None:
                self.scaler.update()     # ends the iteration unscale_ began (the scale is lowered)
            self._unscaled = False
            return StepResult(norm, 1, nonfinite=True)
        skipped = 0
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.step(self.optimizer)
            self.scaler.update()
            skipped = int(self.scaler.get_scale() < before)
        else:
            self.optimizer.step()
        self._unscaled = False
        return StepResult(norm, skipped)

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def drop_step(self) -> None:
        """The window's gradients thrown away without a step (torchft voted against committing it):
        zeroed, and a loss scaler that unscaled them (clip_grad_norm_) ends its iteration."""
        self.zero_grad()
        if self.scaler is not None and self._unscaled:
            self.scaler.update()
        self._unscaled = False

    def _local_params(self) -> list[torch.Tensor]:
        """This rank's parameter data (its shards of DTensors), for the finiteness check."""
        return [getattr(p, "_local_tensor", p) for p in self.model.parameters()]

    def params_finite(self) -> bool:
        """Whether every parameter on every rank is finite (one all-reduce; a collective)."""
        local = [t.detach() for t in self._local_params() if t.device.type != "meta" and t.numel()]
        device = local[0].device if local else _default_device()
        bad = torch.zeros((), dtype=torch.bool, device=device)
        for t in local:
            bad = bad | ~torch.isfinite(t).all()
        return not agree_any(bad, None, device)

    def zero_grads(self) -> None:
        """Give every trainable parameter a zero gradient where its backward would put one (the
        traced estimate's way to create optimizer state without a training step)."""
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)

    def translate_error(self, e: BaseException) -> HybridError | None:
        """A library error a user can cause, as one line naming the fix (None: not ours)."""
        return None

    def scaler_state(self) -> dict | None:
        return self.scaler.state_dict() if self.scaler is not None else None

    def load_scaler_state(self, state: dict) -> None:
        if self.scaler is not None:
            self.scaler.load_state_dict(state)

    @abstractmethod
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Unsharded model state on every rank, CPU tensors, under the model's own names."""

    # --- checkpoints: one portable layout for every backend (see hybrid/ckpt/store.py) ---------
    def checkpoint_state(self) -> dict:
        """{"model": model state, "optim": optimizer state flattened by parameter name}, as
        torch.distributed.checkpoint saves it (DTensors stay sharded, replicated data once)."""
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict,
                                                             get_optimizer_state_dict)
        return {"model": get_model_state_dict(self.model, options=_OPTIONS()),
                "optim": get_optimizer_state_dict(self.model, self.optimizer, options=_OPTIONS())}

    def checkpoint_template(self) -> dict:
        """Tensors of the right shapes and placements to load into (fresh optimizers get their
        state allocated first)."""
        return self.checkpoint_state()

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict
        set_model_state_dict(self.model, state["model"], options=_OPTIONS())
        set_optimizer_state_dict(self.model, self.optimizer, state["optim"], options=_OPTIONS())

    @property
    def user_optimizer(self):
        """The torch optimizer the user's factory built (DeepSpeed wraps it in its own)."""
        return self.optimizer

    def tensor_roles(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this backend holds, by memory category (for the tracker's relabelling)."""
        params = list(self.model.parameters())
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.optimizer, params)}


def _default_device():
    import torch.distributed as dist
    return "cuda" if dist.is_initialized() and dist.get_backend() == "nccl" else "cpu"


def _is_fake(t) -> bool:
    """A traced estimate's fake tensor: it holds no values to check."""
    from torch._subclasses.fake_tensor import is_fake
    return isinstance(t, torch.Tensor) and is_fake(t)


def _device_of(t):
    return t.device if isinstance(t, torch.Tensor) else _default_device()


def agree_any(a, b, device) -> bool:
    """Whether flag `a` or `b` (bool tensors or None) is set on any rank: one MAX all-reduce over
    the world, so every rank takes the same decision (one host sync)."""
    import torch.distributed as dist
    flag = torch.zeros((), dtype=torch.float32, device=device)
    for f in (a, b):
        if f is not None:
            flag = torch.maximum(flag, torch.as_tensor(f).to(device=device, dtype=torch.float32).reshape(()))
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


@dataclass(frozen=True)
class LoopOptions:
    """How the training loop runs, for the backends that configure it at wrap time (DeepSpeed)."""

    gradient_accumulation: int = 1
    """Micro-batches per optimizer step (1: no accumulation)."""
    max_grad_norm: float | None = None
    """Clip the global gradient L2 norm to this before each optimizer step; None: no clipping."""
    find_unused_parameters: bool = False
    """Let DDP handle parameters that get no gradient in some steps (costs a graph walk per step)."""


class ShardedScaler(torch.amp.GradScaler):
    """torch's GradScaler for DTensor (FSDP2) gradients: each rank checks and unscales its own
    shards, then every rank takes the same decision (an overflow in any shard skips the step
    everywhere), as torch's ShardedGradScaler does for FSDP1."""

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16):
        import torch.distributed as dist
        groups: dict = {}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = getattr(p.grad, "_local_tensor", p.grad)     # the shard itself (in place)
                    groups.setdefault((g.device, g.dtype), []).append(g)
        found = torch.zeros_like(found_inf)
        for (device, _), grads in groups.items():
            f = torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(grads, f, inv_scale.to(device))
            found += f.to(found.device)
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(found, op=dist.ReduceOp.MAX)
        return {found.device: found}


def make_scaler(spec, device_type: str, sharded: bool):
    """Dynamic loss scaling for fp16-mixed (torch defaults: 2^16, x2 every 2000 clean steps, /2
    on overflow); None for the other precisions."""
    if spec.precision != "fp16-mixed":
        return None
    return (ShardedScaler if sharded else torch.amp.GradScaler)(device_type)


def compute_dtype(spec):
    """The dtype forward and backward run in for a mixed precision, else None."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(spec.precision)


def _OPTIONS():
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=True)


def optimizer_tensors(optimizer, model_params) -> list[torch.Tensor]:
    """Optimizer state, plus parameters the optimizer owns that the model does not (fp32 masters)."""
    own = {id(p) for p in model_params}
    out = [t for st in optimizer.state.values() for t in st.values() if isinstance(t, torch.Tensor)]
    for g in optimizer.param_groups:
        out += [p for p in g["params"] if id(p) not in own]
    return out


@dataclass
class _Carrier:
    """A plain output object's attributes, in a form FSDP2 looks into."""
    obj: object
    attrs: dict


class _DictCarrier(dict):
    """The same for ZeRO-3, which walks tuples, lists and dicts only (not dataclasses) and updates
    a dict in place, so the carrier keeps its type through DeepSpeed's hooks."""
    obj: object = None


def _is_opaque(out, dataclasses_too: bool = False) -> bool:
    """An output the wrapper cannot see into (not a tensor or container; with dataclasses_too,
    also a dataclass)."""
    if out is None or isinstance(out, (torch.Tensor, tuple, list, dict, set, str, int, float, bool)):
        return False
    return (dataclasses_too or not is_dataclass(out)) and hasattr(out, "__dict__")


def carry_plain_outputs(model, as_dict: bool = False):
    """FSDP2, DDP (find_unused_parameters) and ZeRO-3 find the output tensors they hook for
    backward by walking tensors and containers (FSDP2 and DDP also dataclasses); an object they
    cannot see into hides them (FSDP2 then reads freed parameters in backward: 'setStorage ...
    storage of size 0'; ZeRO-3 warns that its hooks may not trigger). This forward hook,
    registered before the library wraps `model`, carries such an object's attributes in a
    dataclass (as_dict: a dict, for ZeRO-3); the returned hook, registered on the wrapper after
    the library's, gives the user back the same kind of object."""
    import copy

    def pack(module, args, out):
        if not _is_opaque(out, dataclasses_too=as_dict):
            return None
        if as_dict:
            carrier = _DictCarrier(vars(out))
            carrier.obj = out
            return carrier
        return _Carrier(out, dict(vars(out)))

    def unpack(module, args, out):
        if isinstance(out, (_Carrier, _DictCarrier)):
            new = copy.copy(out.obj)
            new.__dict__.update(out.attrs if isinstance(out, _Carrier) else out)
            return new
        return None
    model.register_forward_hook(pack)                  # before the wrapper's own hooks
    return unpack


def check_optimizer_factory(factory) -> None:
    if not callable(factory):
        raise HybridError(f"optimizer must be a callable that takes the parameters and returns an "
                          f"optimizer, e.g. lambda ps: torch.optim.AdamW(ps, lr=3e-4); got {factory!r}")


def shardable_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated units to wrap/shard one by one. A unit that shares a parameter with anything
    outside it (tied weights across units) is left to the root, so a shared tensor is sharded as
    one group, never split between two."""
    _, blocks = find_blocks(model)
    owners: dict[int, set[int]] = {}
    for m in model.modules():
        for p in m.parameters(recurse=False):
            owners.setdefault(id(p), set()).add(id(m))
    out = []
    for b in blocks:
        inside = {id(m) for m in b.modules()}
        if all(owners[id(p)] <= inside for p in b.parameters()):
            out.append(b)
    return out


def call_with_batch(fn, args, kwargs):
    """w(batch) with a dict batch calls the model with keyword arguments (HF style)."""
    if len(args) == 1 and not kwargs and isinstance(args[0], Mapping):
        return fn(**args[0])
    return fn(*args, **kwargs)


def full_state(module) -> dict[str, torch.Tensor]:
    """The module's state with every DTensor gathered whole, as CPU copies (a collective)."""
    return to_cpu_state((k, v.full_tensor() if hasattr(v, "full_tensor") else v)
                        for k, v in module.state_dict().items())


def to_cpu_state(items) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu", copy=True) for k, v in items}
