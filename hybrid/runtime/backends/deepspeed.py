"""DeepSpeed ZeRO stage 1/2/3 through deepspeed.initialize, with the user's optimizer."""
from __future__ import annotations

import contextlib
import io
import logging
import os
import warnings

import torch

from ...errors import HybridError
from ...model.profile import decoder_of, names_by_param
from .base import Engine, LoopOptions, carry_plain_outputs, optimizer_tensors
from ..materialize import materialize
from ..extensions import extension_cache
from ...families.deepspeed import ds_config

log = logging.getLogger(__name__)


_SCALER_KEYS = ("cur_scale", "cur_iter", "last_overflow_iter", "cur_hysteresis")


class DeepSpeedEngine(Engine):
    """DeepSpeed counts micro-batches itself (gradient_accumulation_steps in its config): backward
    and step run on every micro-batch, the engine reduces, clips (gradient_clipping), scales
    (fp16) and steps at the window's end."""

    family = "deepspeed"
    owns_accumulation = True

    def backward(self, loss, accumulation=1, sync=True):
        self.runner.backward(loss)          # divides by gradient_accumulation_steps itself

    def step(self, sync=True, max_norm=None, loss_bad=None):
        from .base import StepResult, agree_any
        # under fp16 a non-finite loss makes non-finite gradients: DeepSpeed's loss scaler skips that step
        if sync and not self.runner.fp16_enabled() and agree_any(loss_bad, None, self.runner.device):
            raise HybridError("a non-finite loss (NaN/inf) on some rank in this window, and DeepSpeed ZeRO cannot "
                              "skip a step from outside its optimizer: the step was not taken (parameters "
                              "unchanged); load the last checkpoint, or train with fsdp, which skips such steps")
        skipped_before = getattr(self.runner, "skipped_steps", 0)
        self.runner.step()
        if not sync:
            return StepResult()
        norm = self.runner.get_global_grad_norm()
        return StepResult(norm, int(getattr(self.runner, "skipped_steps", 0) > skipped_before))

    def clip_grad_norm(self, max_norm):
        raise HybridError("DeepSpeed ZeRO clips inside its optimizer step, over gradients partitioned across "
                          "ranks: pass max_grad_norm= to auto_wrap instead of calling clip_grad_norm_")

    def zero_grad(self):
        # DeepSpeed clears gradients inside engine.step(); nothing is left to clear here.
        pass

    def scaler_state(self):
        scaler = getattr(self.runner.optimizer, "loss_scaler", None)
        if scaler is None or not self.runner.fp16_enabled():
            return None
        return {k: float(getattr(scaler, k)) for k in _SCALER_KEYS if hasattr(scaler, k)}

    def load_scaler_state(self, state):
        scaler = getattr(self.runner.optimizer, "loss_scaler", None)
        for k, v in state.items():
            if scaler is not None and k in _SCALER_KEYS and hasattr(scaler, k):
                setattr(scaler, k, type(getattr(scaler, k))(v))

    def _local_params(self):
        """The fp32 master partitions (ZeRO keeps the values there) and the module's own copies."""
        zo = self.runner.optimizer
        masters = [t for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                   for t in getattr(zo, attr, None) or []]
        return masters + [getattr(p, "ds_tensor", p) for p in self.model.parameters()]

    def _frozen(self):
        return [(n, p) for n, p in self.model.named_parameters() if not p.requires_grad]

    def _module_value(self, p) -> torch.Tensor:
        """The full value of a parameter DeepSpeed keeps no fp32 master of (frozen ones)."""
        import deepspeed
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p]):
                return p.data.detach().float().clone()
        return p.data.detach().float().clone()

    def full_state_dict(self):
        """fp32 master values (not the bf16 working copy), gathered on every rank."""
        from deepspeed.utils import safe_get_full_fp32_param

        out = {}
        named = dict(self.model.named_parameters(remove_duplicate=False))
        for name, p in named.items():
            value = safe_get_full_fp32_param(p) if p.requires_grad else self._module_value(p)
            out[name] = value.detach().to("cpu", copy=True)
        for name, b in self.model.named_buffers():
            out[name] = b.detach().to("cpu", copy=True)
        keys = self.model.state_dict().keys()
        return {k: out[k] for k in keys if k in out}

    # --- checkpoints -------------------------------------------------------------------------
    def _params(self):
        """(canonical name, param) of the trainable parameters: the first name of a tied
        parameter, as torch's state-dict helpers name optimizer state."""
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def _sharded(self, full: torch.Tensor):
        """A full tensor (the same on every rank) as a DTensor sharded on dim 0 over the world:
        what the portable checkpoint stores, 1/world of it per rank."""
        from torch.distributed.tensor import DTensor, Shard
        mesh = self.shard_mesh
        if full.dim() == 0:
            return full.detach().clone()
        chunks = full.detach().chunk(mesh.size(), dim=0)
        rank = mesh.get_local_rank()
        local = (chunks[rank] if rank < len(chunks) else full.new_empty((0, *full.shape[1:]))).clone()
        return DTensor.from_local(local, mesh, [Shard(0)], run_check=False, shape=full.shape,
                                  stride=full.stride())

    def _inner(self):
        zo = self.runner.optimizer
        return getattr(zo, "optimizer", zo)

    def _ensure_states(self) -> None:
        """DeepSpeed creates optimizer state lazily at the first step; a checkpoint needs it now.
        One step of the inner optimizer with zero gradients and lr 0 allocates it unchanged.
        ZeRO-3 steps its fp32 sub-groups one at a time through an empty param group."""
        zo, inner = self.runner.optimizer, self._inner()
        subgroups = getattr(zo, "fp32_partitioned_groups_flat", None)
        if subgroups is not None:
            todo = [(zo.sub_group_to_group_id[i], t) for i, t in enumerate(subgroups)]
        else:
            todo = [(gi, p) for gi, g in enumerate(inner.param_groups) for p in g["params"]]
        todo = [(gi, t) for gi, t in todo if not inner.state.get(t)]
        for gi, t in todo:
            group = inner.param_groups[gi]
            saved = group["params"], group["lr"]
            t.grad = torch.zeros_like(t)
            group["params"], group["lr"] = [t], 0.0
            inner.step()
            group["params"], group["lr"] = saved
            t.grad = None
        link = getattr(zo, "_lazy_init_hp_params_optimizer_state", None)
        if todo and link is not None:     # ZeRO-1/2 map each parameter to its state fragments
            link()

    def _state_keys(self) -> list[str]:
        self._ensure_states()
        keys = set()
        for st in self._inner().state.values():
            keys |= {k for k, v in st.items() if isinstance(v, torch.Tensor) and v.dim() > 0}
        return sorted(keys)

    def _step(self) -> float:
        for st in self._inner().state.values():
            if "step" in st:
                return float(st["step"])
        return 0.0

    def checkpoint_state(self, template: bool = False):
        """The portable layout built from DeepSpeed's partitions: every full fp32 master and
        optimizer state gathered one parameter at a time, kept as 1/world shards."""
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
        model, optim = {}, {}
        group = self._inner().param_groups[0]
        keys = self._state_keys()
        aliases = names_by_param(self.model)
        for name, p in self._params():
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            get = (lambda key=None: torch.zeros(shape, dtype=torch.float32, device=p.device)) if template else (
                lambda key=None, p=p: safe_get_full_fp32_param(p) if key is None
                else safe_get_full_optimizer_state(p, key))
            value = self._sharded(get())
            for alias in aliases[id(p)]:          # a tied weight under each of its names
                model[alias] = value
            for key in keys:
                optim[f"state.{name}.{key}"] = self._sharded(get(key))
            optim[f"state.{name}.step"] = torch.tensor(self._step())
            for k, v in group.items():
                if k != "params":
                    optim[f"param_groups.{name}.{k}"] = v
        for name, p in self._frozen():             # no optimizer state; the module's own value
            shape = p.ds_shape if hasattr(p, "ds_shape") else p.shape
            value = self._sharded(torch.zeros(shape, dtype=torch.float32) if template else self._module_value(p))
            for alias in aliases[id(p)]:
                model[alias] = value
        for name, b in self.model.named_buffers():
            if name in self.model.state_dict():
                model[name] = b.detach().clone()
        return {"model": model, "optim": optim}

    def checkpoint_template(self):
        return self.checkpoint_state(template=True)

    def load_checkpoint_state(self, state):
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state
        model, optim = state["model"], state["optim"]
        keys = self._state_keys()
        for name, p in self._params():
            full = model[name].full_tensor()
            safe_set_full_fp32_param(p, full)
            for key in keys:
                safe_set_full_optimizer_state(p, optim[f"state.{name}.{key}"].full_tensor(), key)
            self._set_module_value(p, full)     # the module's own (16-bit or fp32) copy forward reads
        for name, p in self._frozen():
            self._set_module_value(p, model[name].full_tensor())
        first = self._params()[0][0]
        for st in self._inner().state.values():
            if "step" in st:
                st["step"] = optim[f"state.{first}.step"].clone().to(st["step"].device) if isinstance(
                    st["step"], torch.Tensor) else float(optim[f"state.{first}.step"])
        for group in self._inner().param_groups:
            for k in group:
                if k != "params" and f"param_groups.{first}.{k}" in optim:
                    group[k] = optim[f"param_groups.{first}.{k}"]
        for name, b in self.model.named_buffers():
            if name in model:
                b.data.copy_(model[name])

    @property
    def user_optimizer(self):
        return self._inner()

    def _set_module_value(self, p, full: torch.Tensor) -> None:
        import deepspeed
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                if torch.distributed.get_rank() == 0:
                    p.data.copy_(full.to(p.dtype).view_as(p))
        else:
            p.data.copy_(full.to(p.dtype).view_as(p))

    def tensor_roles(self):
        """DeepSpeed's own flat buffers: 16-bit params (or their partitions and hpZ copies),
        gradient partitions, fp32 masters and states; attribute names differ by stage."""
        zo = self.runner.optimizer
        params = []
        for p in self.model.parameters():
            # under stage 3 the module parameter itself is the gathered (temporary) copy
            own = (getattr(p, "ds_tensor", None), getattr(p, "ds_secondary_tensor", None))
            params += [t for t in (own if hasattr(p, "ds_tensor") else (p,)) if isinstance(t, torch.Tensor)]
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        for attr in ("averaged_gradients", "_DeepSpeedZeroOptimizer_Stage3__param_id_to_grad_partition"):
            value = getattr(zo, attr, None) or {}
            for v in value.values():
                grads += v if isinstance(v, list) else [v]
        flat = getattr(zo, "grad_partitions_flat_buffer", None)
        if isinstance(flat, torch.Tensor):
            grads.append(flat)
        inner = getattr(zo, "optimizer", zo)
        masters = [t for attr in ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
                   for t in getattr(zo, attr, None) or []]
        grads += [m.grad for m in masters if m.grad is not None]
        return {"params": params, "grads": [g for g in grads if isinstance(g, torch.Tensor)],
                "optimizer": masters + optimizer_tensors(inner, params)}


def _deepspeed():
    """deepspeed, imported and its communication backend started quietly. What it would print
    otherwise, on every rank, and what is done about each:
    - "Setting accelerator to CPU ... unable to detect it" (a WARNING from auto-detection): we
      name the accelerator ourselves through DS_ACCELERATOR, DeepSpeed's documented override,
      unless the user set it;
    - "DeepSpeed deepspeed.ops.comm.deepspeed_shm_comm_op built successfully" (a bare print when
      its CPU shared-memory op loads): captured and sent to our log at DEBUG;
    - FutureWarnings "`torch.distributed.reduce_scatter_tensor` / `all_gather_into_tensor` is
      deprecated" from DeepSpeed's own collectives (torch 2.13 deprecates them; DeepSpeed
      still calls them): one line per collective, because code that enters
      warnings.catch_warnings() clears the once-per-location registry (2,880 lines in a 40-step
      zero3 run on 4 ranks). Filtered by exact message; other warnings stay."""
    os.environ.setdefault("DS_ACCELERATOR", "cuda" if torch.cuda.is_available() else "cpu")
    extension_cache()
    warnings.filterwarnings("ignore", category=FutureWarning,
                            message=r"`torch\.distributed\.(reduce_scatter_tensor|all_gather_into_tensor)` "
                                    r"is deprecated")
    import deepspeed
    import deepspeed.comm as ds_comm

    logging.getLogger("DeepSpeed").setLevel(logging.WARNING)        # its INFO lines, on every rank

    if not ds_comm.is_initialized():
        captured = io.StringIO()
        with contextlib.redirect_stdout(captured):
            ds_comm.init_distributed(dist_backend=torch.distributed.get_backend(), auto_mpi_discovery=False,
                                     dist_init_required=False, verbose=False)
        for line in captured.getvalue().splitlines():
            log.debug("deepspeed: %s", line)
    return deepspeed


def check(strategy, mesh, spec, runtime) -> None:
    """What DeepSpeed cannot run on this device or mesh, before anything is built."""
    cuda = runtime.device.type == "cuda"
    strategy.family_obj.check_device(strategy, spec, cuda)
    if mesh["dp_shard"].size() != runtime.world_size:
        raise HybridError(f"{strategy.name}: DeepSpeed ZeRO partitions over the whole world ({runtime.world_size} "
                          f"ranks), but the layout shards over {mesh['dp_shard'].size()}; use an fsdp strategy "
                          "(hsdp) for partial sharding")
    if spec.precision == "fp16-mixed" and not cuda:
        raise HybridError(f"{strategy.name}: DeepSpeed's fp16 mode needs CUDA (its CPU accelerator has no fp16); "
                          "use ddp or fsdp for fp16-mixed on CPU ranks, or --precision fp32")


def place(strategy, module, spec, runtime) -> None:
    """ZeRO partitions the model at initialize (deepspeed.zero.Init is not used): it is whole first."""
    materialize(module, runtime.device)


def float8_all_gather(layout, staged: bool) -> bool:
    return False


def wrap(strategy, module, layout, mesh, spec, runtime, options=None, staged: bool = False):
    """DeepSpeed wraps at deepspeed.initialize, which needs the optimizer: see engine()."""
    return module


def engine(strategy, model, runner, optimizer_factory, mesh, spec, runtime, options=None) -> DeepSpeedEngine:
    options = options or LoopOptions()
    deepspeed = _deepspeed()
    decoder = decoder_of(model)
    config = ds_config(strategy, spec, decoder.hidden if decoder else None, runtime.world_size,
                       runtime.local_world_size, runtime.device.type == "cuda", options.gradient_accumulation,
                       options.max_grad_norm)
    optimizer = optimizer_factory([p for p in model.parameters() if p.requires_grad])
    unpack = carry_plain_outputs(model, as_dict=True)
    engine, optimizer, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config,
                                                   dist_init_required=False)
    engine.register_forward_hook(unpack)
    out = DeepSpeedEngine(engine.module, engine, optimizer)
    out.shard_mesh = mesh["dp_shard"]            # the portable checkpoint's shards follow the job's mesh
    return out


def traced_apply(strategy, model, optimizer_factory, mesh, spec, runtime, options=None):
    """DeepSpeed cannot run on fake tensors. Its compute is FSDP2's with bf16 params (the module
    is cast to bf16, like MixedPrecisionPolicy), so the trace runs the FSDP2 equivalent (full
    shard; blocks re-gathered in backward only for stage 3) and measure/traced.py replaces the
    model states and buffers with DeepSpeed's layout (its partitions and bucket sizes)."""
    from . import fsdp
    return fsdp.apply(traced_proxy(strategy), model, optimizer_factory, mesh, spec, runtime)


def traced_proxy(strategy):
    """The FSDP2 strategy traced_apply runs for `strategy` (measure/traced.traced_program: strategies with
    one proxy trace the same program)."""
    from dataclasses import replace

    from ...families.fsdp import FSDPConfig
    return replace(strategy, name=f"{strategy.name}-as-fsdp", family="fsdp",
                   config=FSDPConfig(reshard_after_forward=strategy.config.stage == 3))
