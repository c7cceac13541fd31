"""Pipeline parallelism with torch.distributed.pipelining: the model's blocks cut into stages
(hybrid.layout.pipeline.StageSplit, chosen by the planner), each stage wrapped by the data-parallel
family over the stage's (dp_replicate, dp_shard) ranks with tensor parallelism inside, and one
of torch's schedules (GPipe, 1F1B, interleaved 1F1B) running the micro-batches of a step.

The order (hybrid/runtime/parallelize.py, as torchtitan applies it): split into stages (the model's own
module names kept), then per stage tensor parallelism, activation checkpointing and FSDP2/DDP. A tied
embedding and head on
the first and last stage are one Parameter in the model and two copies here: their gradients are
summed across the two ranks before every step, so the copies stay equal.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import HybridError
from ...model.decoder import causal_lm_loss
from .base import Engine, StepResult, full_state

SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B"}


class PipelineEngine(Engine):
    """One optimizer step at a time through train_step; forward/backward per micro-batch do not
    exist under a pipeline (the schedule interleaves them across ranks)."""

    family = "pipeline"

    def __init__(self, model, chunks, stages, layout, mesh, optimizer, tied_group, renames, tp):
        container = chunks[0] if len(chunks) == 1 else nn.ModuleList(chunks)
        super().__init__(model, None, optimizer, None, tp)
        self.chunks, self.stages, self.layout, self.mesh = chunks, stages, layout, mesh
        self.container = container
        self.pp_size = layout.pp
        self.pp_rank = mesh["pp"].get_local_rank()
        self.tied_group = tied_group          # (group, [param in this rank's chunks]) or None
        self.renames = renames                # optimizer-state FQN -> the model's own (canonical) name
        self.is_first = any(s.is_first for s in stages)
        self.is_last = any(s.is_last for s in stages)
        self._loss = _LossFn()
        self._schedule = None

    # --- the loop ------------------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        raise HybridError(_WHOLE_STEPS)

    def backward(self, loss, accumulation=1, sync=True):
        raise HybridError(_WHOLE_STEPS)

    def train_step(self, input_ids, labels, loss_fn, max_norm) -> tuple[torch.Tensor, StepResult]:
        """Every micro-batch forward and backward through the schedule, the tied gradients summed,
        clipping, the optimizer step (skipped everywhere when a loss or the norm is non-finite).
        Returns (this rank's mean micro-batch loss on the last stage, else zero; the step result)."""
        if self._schedule is None:
            from torch.distributed import pipelining
            cls = getattr(pipelining, SCHEDULE_CLASSES[self.layout.schedule])
            stages = self.stages[0] if self.layout.virtual == 1 else self.stages
            self._schedule = cls(stages, n_microbatches=self.layout.micro_batches, loss_fn=self._loss)
        self._loss.fn = loss_fn or causal_lm_loss
        schedule = self._schedule
        losses: list = []
        args = (input_ids.to(self.stages[0].device),) if self.is_first else ()
        kwargs = {}
        if self.is_last:
            kwargs = {"target": labels.to(self.stages[0].device), "losses": losses}
        if _takes_return_outputs(schedule):
            # the merged outputs are not used: without this the last stage keeps every micro-batch's
            # logits (PipelineStage.output_chunks) through the step and concatenates them at its end
            kwargs["return_outputs"] = False
        with self._tp_context():
            schedule.step(*args, **kwargs)
        self._sum_tied_grads()
        bad = torch.zeros((), dtype=torch.bool)
        for x in losses:                          # the last stage's micro-batch losses
            bad = bad | ~torch.isfinite(_plain(x).detach()).all().cpu()
        result = super().step(True, max_norm, bad)
        self.zero_grad()
        local = (torch.stack([_plain(x).detach().float() for x in losses]).mean() if losses else torch.zeros(()))
        return local, result

    def _sum_tied_grads(self) -> None:
        if self.tied_group is None:
            return
        group, params = self.tied_group
        for p in params:
            if p.grad is not None:
                dist.all_reduce(getattr(p.grad, "_local_tensor", p.grad), group=group)

    def _grad_params(self):
        return [p for c in self.chunks for p in c.parameters() if p.grad is not None]

    def _local_params(self):
        return [getattr(p, "_local_tensor", p) for c in self.chunks for p in c.parameters()]

    def _norm_skip(self) -> set[int]:
        """The tied head's copy on the last stage: the first stage counts it."""
        if self.tied_group is None or self.is_first:
            return set()
        return {id(p) for p in self.tied_group[1]}

    # --- state ---------------------------------------------------------------------------------
    def full_state_dict(self):
        """Every stage's unsharded state, gathered to every rank (a collective)."""
        mine = {}
        for c in self.chunks:
            mine.update(full_state(c))
        gathered = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        out = {}
        for part in gathered:
            out.update(part)
        return {k: out[k] for k in self.model.state_dict() if k in out}

    def checkpoint_state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        from .base import _OPTIONS
        model = {}
        for c in self.chunks:
            model.update(get_model_state_dict(c, options=_OPTIONS()))
        optim = get_optimizer_state_dict(self.container, self.optimizer, options=_OPTIONS())
        return {"model": model, "optim": {self._rename(k): v for k, v in optim.items()}}

    def load_checkpoint_state(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (get_model_state_dict, set_model_state_dict,
                                                             set_optimizer_state_dict)

        from .base import _OPTIONS
        for c in self.chunks:
            mine = get_model_state_dict(c, options=_OPTIONS())
            set_model_state_dict(c, {k: v for k, v in state["model"].items() if k in mine}, options=_OPTIONS())
        back = {v: k for k, v in self.renames.items()}
        optim = {}
        for k, v in state["optim"].items():
            optim[_rename_key(k, back)] = v
        set_optimizer_state_dict(self.container, self.optimizer, optim, options=_OPTIONS())

    def _rename(self, key: str) -> str:
        return _rename_key(key, self.renames)

    def tensor_roles(self):
        params = [p for c in self.chunks for p in c.parameters()]
        from .base import optimizer_tensors
        return {"params": params, "grads": [p.grad for p in params if p.grad is not None],
                "optimizer": optimizer_tensors(self.optimizer, params)}


_WHOLE_STEPS = ("a pipeline runs whole optimizer steps: use loss = w.train_step(batch) (the batch of "
                "gradient_accumulation x micro_batch sequences) instead of w(batch) / backward / step")


class _LossFn:
    """The last stage's loss: the user's loss_fn(logits, labels), else the causal-LM loss the
    models compute from `labels` (next-token cross entropy in fp32, mean over tokens)."""

    fn = staticmethod(causal_lm_loss)

    def __call__(self, output, target):
        return self.fn(getattr(output, "logits", output), target)     # vocab shards: under loss_parallel


def _takes_return_outputs(schedule) -> bool:
    """Whether torch's schedule.step takes return_outputs (torch 2.8 and later; before, every
    keyword argument goes to the model's forward)."""
    import inspect
    return "return_outputs" in inspect.signature(schedule.step).parameters


def _plain(t):
    """A loss computed on vocab shards is a replicated DTensor."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _rename_key(key: str, names: dict[str, str]) -> str:
    """A flattened optimizer-state key ('state.<fqn>.<k>' / 'param_groups.<fqn>.<k>') with its
    parameter name replaced per `names` (container prefixes '<i>.' included)."""
    for head in ("state.", "param_groups."):
        if key.startswith(head):
            fqn, _, field = key[len(head):].rpartition(".")       # state fields have no dots
            return f"{head}{names.get(fqn, fqn)}.{field}"
    return key


def _tied_group(tied, chunks, layout, mesh, pp_rank):
    """The process group joining the first and last stage's ranks of this rank's (dp, tp)
    coordinates, and this rank's copies of the tied parameters (`tied`: groups of names that
    shared one Parameter before the stages were wrapped); None when nothing is tied. Every rank
    creates every pair's group (new_group is collective)."""
    if not tied or layout.pp == 1:
        return None
    ranks = mesh.mesh                                     # (pp, dp_replicate, dp_shard, cp, tp) tensor of ranks
    me = dist.get_rank()
    mine = None
    coords = torch.cartesian_prod(*[torch.arange(n) for n in ranks.shape[1:]]).reshape(-1, ranks.dim() - 1)
    for coord in coords.tolist():
        r0, r1 = int(ranks[(0, *coord)]), int(ranks[(-1, *coord)])
        g = mesh["pp"].get_group() if layout.pp == 2 and me in (r0, r1) else None
        if layout.pp > 2:
            g = dist.new_group([r0, r1])
        if me in (r0, r1):
            mine = g
    if pp_rank not in (0, layout.pp - 1):
        return None
    alias = {n for names in tied for n in names}
    params = [p for c in chunks for n, p in c.named_parameters(remove_duplicate=False) if n in alias]
    return (mine, params) if params else None


def pipeline_engine(parallel, layout, mesh, runtime, optimizer_factory) -> PipelineEngine:
    """The schedule's stages (torch.distributed.pipelining.PipelineStage) over this rank's wrapped
    stage chunks (hybrid.runtime.parallelize split and wrapped them), the optimizer over their parameters,
    and the tied copies' group."""
    from torch.distributed.pipelining import PipelineStage

    chunks = parallel.runners
    stages = [PipelineStage(chunk, index, layout.stages, runtime.device, group=mesh["pp"].get_group())
              for chunk, index in zip(chunks, parallel.indices)]
    _free_others(parallel.model, chunks)
    params = [p for c in chunks for p in c.parameters() if p.requires_grad]
    optimizer = optimizer_factory(params)
    pp_rank = mesh["pp"].get_local_rank()
    return PipelineEngine(parallel.model, chunks, stages, layout, mesh, optimizer,
                          _tied_group(parallel.tied, chunks, layout, mesh, pp_rank), parallel.renames, parallel.tp)


def _free_others(model, chunks) -> None:
    """Parameters of the blocks other ranks run move to the meta device: the model object keeps
    every name and shape (checkpoints describe the whole model) and no memory for them."""
    held = {id(m) for c in chunks for m in c.modules()}
    kept = {id(q) for c in chunks for q in c.parameters()}
    for m in model.modules():
        if id(m) in held:
            continue
        for name, p in list(m._parameters.items()):
            if p is not None and p.device.type != "meta" and id(p) not in kept:
                m._parameters[name] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
