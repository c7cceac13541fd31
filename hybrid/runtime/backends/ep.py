"""Expert parallelism: each MoE layer's experts split over the ep ranks, tokens sent to their
experts' ranks and back with two all-to-alls per layer (forward; two more in backward).

Runtime order (hybrid/runtime/backends/base.py `prepare`): tensor parallel -> expert parallel ->
activation checkpointing -> compile -> the data-parallel wrap, which shards the experts over
the ranks holding the same experts (`shard_experts`, before the blocks) and the rest as always.

The experts are found by their interface, the one transformers 5 gives Mixtral, Qwen3-MoE and
OLMoE (`use_experts_implementation`) and our own decoder's MoE blocks: a module with
`num_experts`, stacked `gate_up_proj` (experts x 2 ffn x hidden) and `down_proj` (experts x
hidden x ffn), called as experts(hidden_states, top_k_index, top_k_weights). The router is left
as it is, so the routing (top-k, renormalisation) is the model's own; only where the experts run
changes. Each expert stack becomes a DTensor Shard(0) on the ep mesh: the checkpoint keeps the
model's names and global shapes, so a job saved under ep 2 loads under ep 1 or plain FSDP.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from ...errors import HybridError
from ..activation_checkpoint import routed_experts
from ..mesh import released, traced_group


def expert_modules(model: nn.Module) -> list[nn.Module]:
    """The stacked-experts modules of `model` (see the module docstring), in module order."""
    out = []
    for m in model.modules():
        gu, down = m._parameters.get("gate_up_proj"), m._parameters.get("down_proj")
        if gu is not None and down is not None and gu.dim() == 3 and isinstance(getattr(m, "num_experts", None), int):
            out.append(m)
    return out


def check_expert_parallel(model: nn.Module, ep: int, strategy, pipeline: bool, tp: int) -> list[nn.Module]:
    """The experts modules ep can split, or a one-line HybridError naming what to change."""
    if not strategy.family_obj.supports_ep or pipeline:
        what = "a pipeline" if pipeline else f"{strategy.name} (the {strategy.family} family)"
        raise HybridError(f"ep {ep}: expert parallelism runs under FSDP2 only, not {what}; use strategy fsdp or hsdp "
                          "with ep (and pp 1), or ep 1")
    if tp > 1:
        raise HybridError(f"ep {ep} with tp {tp}: expert and tensor parallelism together are not supported yet; "
                          "use tp 1 with ep, or ep 1 with tp")
    experts = expert_modules(model)
    if not experts:
        raise HybridError(f"ep {ep}: {type(model).__name__} has no stacked experts (a module with num_experts, "
                          "gate_up_proj and down_proj, as transformers' Mixtral/Qwen3-MoE/OLMoE and hybrid's MoE "
                          "decoder have); use ep 1 for a dense model")
    for m in experts:
        if m.num_experts % ep:
            raise HybridError(f"ep {ep} does not divide the {m.num_experts} experts of {type(m).__name__}: each ep "
                              f"rank holds experts / ep of them; use an ep that divides {m.num_experts}")
        layout = {k: getattr(m, k, d) for k, d in (("has_bias", False), ("is_transposed", False),
                                                  ("is_concatenated", True), ("has_gate", True))}
        if layout != {"has_bias": False, "is_transposed": False, "is_concatenated": True, "has_gate": True}:
            raise HybridError(f"ep {ep}: {type(m).__name__} stores its experts as {layout}; expert parallelism "
                              "runs concatenated gate/up stacks without biases (Mixtral, Qwen3-MoE, OLMoE); "
                              "use ep 1 for this model")
    return experts


def apply_expert_parallel(model: nn.Module, mesh, spec=None) -> int:
    """Split every experts module over mesh's "ep" dimension (no-op at ep 1): each rank keeps its
    experts / ep consecutive experts (a DTensor Shard(0) cut from the full stack every rank
    built alike, as fully_shard cuts its shards) and runs them on the tokens all ranks route to
    them. Returns the number of experts modules split."""
    from torch.distributed.tensor import DTensor, Shard

    from ..mesh import ep_mesh, ep_size
    ep = ep_size(mesh)
    if ep == 1:
        return 0
    group_mesh = ep_mesh(mesh)
    rank = group_mesh.get_local_rank()
    experts = expert_modules(model)
    for m in experts:
        n = m.num_experts // ep
        for name in ("gate_up_proj", "down_proj"):
            p = m._parameters[name]
            local = p.detach()[rank * n:(rank + 1) * n].clone()
            dt = DTensor.from_local(local, group_mesh, [Shard(0)], run_check=False)
            m._parameters[name] = nn.Parameter(dt, requires_grad=p.requires_grad)
        m._hybrid_ep = (group_mesh.get_group(), ep)
        m.forward = _ExpertParallelForward(m, getattr(spec, "moe_imbalance", 1.0))
    return len(experts)


def shard_experts(model: nn.Module, mesh, fsdp_kwargs: dict) -> None:
    """fully_shard each split experts module over the ranks holding the same experts (before the
    blocks, so the block's unit leaves them out). Their gradients are divided by the dense
    parts' data-parallel size, not their own group's: each rank's expert gradient already sums
    the tokens of its whole ep group (the backward all-to-all brings them), as torchtitan sets
    the experts' gradient_divide_factor."""
    from torch.distributed.fsdp import fully_shard

    from ..mesh import expert_dp_mesh, fsdp_mesh
    experts = [m for m in expert_modules(model) if hasattr(m, "_hybrid_ep")]
    if not experts:
        return
    dense, edp = fsdp_mesh(mesh), expert_dp_mesh(mesh)
    kwargs = dict(fsdp_kwargs, mesh=edp, shard_placement_fn=lambda p: _expert_placement(p, edp.size(-1)))
    for m in experts:
        fully_shard(m, **kwargs)
        m.set_gradient_divide_factor(float(dense.size()))
        # The factor is a PREMUL_SUM in the reduce-scatter, which only NCCL has: elsewhere FSDP2
        # sums and divides after. Not for a group of one, where FSDP2 (torch 2.13 _fsdp_collectives
        # foreach_reduce) skips the reduce-scatter, divides the copy, and would divide again.
        shard = edp.get_group(edp.ndim - 1)
        if dist.get_backend(shard) != "nccl" and shard.size() > 1:
            m.set_force_sum_reduction_for_comms(True)


def _expert_placement(param, n: int):
    """Where FSDP2 cuts an expert stack it holds experts/ep of: dim 0 when there are at least as
    many local experts as ranks, else the first dimension the group divides (no padding)."""
    from torch.distributed.tensor import Shard
    local = param.to_local().shape if hasattr(param, "to_local") else param.shape
    if local[0] >= n:
        return Shard(0)
    for i in range(1, len(local)):
        if local[i] % n == 0:
            return Shard(i)
    return Shard(0)


class _AllToAll(torch.autograd.Function):
    """all_to_all_single with autograd: the backward sends each gradient row back where its row
    came from (the same exchange with the split sizes swapped)."""

    @staticmethod
    def forward(ctx, x, out_splits, in_splits, group):
        ctx.splits, ctx.group = (out_splits, in_splits), group
        out, x = x.new_empty((sum(out_splits),) + tuple(x.shape[1:])), x.contiguous()
        with released(group, out, x):
            dist.all_to_all_single(out, x, out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        back, grad = grad.new_empty((sum(in_splits),) + tuple(grad.shape[1:])), grad.contiguous()
        with released(ctx.group, back, grad):
            dist.all_to_all_single(back, grad, in_splits, out_splits, group=ctx.group)
        return back, None, None, None


class _ExpertParallelForward:
    """experts(hidden_states, top_k_index, top_k_weights) with this rank's experts only:

    1. sort this rank's (token, choice) pairs by expert; tell every ep rank how many rows it
       gets per expert (an all-to-all of counts);
    2. send the rows to their experts' ranks (all-to-all), regroup them by local expert, run each
       expert (gate/up, activation x up, down) as the model's experts do;
    3. send the outputs back (all-to-all), put each token's k rows side by side, weight them by
       the router's scores and sum them.
    """

    def __init__(self, module: nn.Module, imbalance: float = 1.0):
        self.module = module
        self.imbalance = imbalance
        """Traced estimates only (a fake process group carries no counts): the rows this rank
        receives over the mean, spread evenly over its experts."""

    def __call__(self, hidden_states, top_k_index, top_k_weights):
        m = self.module
        group, ep = m._hybrid_ep
        n = m.num_experts // ep
        k = top_k_index.shape[-1]
        chosen = top_k_index.reshape(-1)
        order = torch.argsort(chosen, stable=True)         # rows grouped by expert, tokens in order
        token = order // k
        if traced_group(group):
            send, recv, sizes = self._planned(chosen.numel(), ep, n)
            perm = torch.arange(sum(recv), device=hidden_states.device)
        else:
            counts = torch.bincount(chosen, minlength=m.num_experts)
            got = torch.empty_like(counts)
            with released(group, got, counts):
                dist.all_to_all_single(got, counts, group=group)   # [source rank, my local expert]
            got = got.view(ep, n)
            send, recv, sizes = counts.view(ep, n).sum(1).tolist(), got.sum(1).tolist(), got.sum(0).tolist()
            # regroup the received rows (by source rank, then local expert) by local expert
            local = torch.repeat_interleave(torch.arange(n, device=got.device).repeat(ep), got.reshape(-1))
            perm = torch.argsort(local, stable=True)
        rows = _AllToAll.apply(hidden_states[token], recv, send, group)
        with routed_experts():                  # recomputed under selective checkpointing, as grouped matmuls are
            out = self._run(rows[perm], sizes)
        inverse = torch.empty_like(perm)
        inverse[perm] = torch.arange(perm.numel(), device=perm.device)
        back = _AllToAll.apply(out[inverse], send, recv, group)        # this rank's rows, by expert
        # each token's k rows side by side, weighted and summed: a gather, not index_add_, which
        # would keep its whole source for backward (one more tokens x k x hidden per layer)
        where = torch.empty_like(order)
        where[order] = torch.arange(order.numel(), device=order.device)
        per_token = back[where].view(-1, k, back.shape[-1])
        return (per_token * top_k_weights[..., None]).to(hidden_states.dtype).sum(dim=1)

    def _planned(self, rows: int, ep: int, n: int):
        """(send, recv, rows per local expert) of a traced step: this rank's rows spread evenly
        over the ep ranks, and imbalance x as many received, spread evenly over its experts."""
        def even(total, parts):
            return [total // parts + (i < total % parts) for i in range(parts)]
        recv = even(round(rows * self.imbalance), ep)
        sizes = [sum(c) for c in zip(*(even(r, n) for r in recv))]
        return even(rows, ep), recv, sizes

    def _run(self, x, sizes):
        m = self.module
        # unbind, not gate_up[e]: indexing makes each expert's weight gradient a zero-filled copy
        # of the whole stack (select_backward) summed into the next (autograd's InputBuffer), up
        # to three stacks at once; unbind's backward stacks the experts' gradients once
        gate_up, down = (_local(m.gate_up_proj).unbind(0), _local(m.down_proj).unbind(0))
        pieces, start = [], 0
        for e, size in enumerate(sizes):
            rows = x[start:start + size]
            start += size
            h = nn.functional.linear(rows, gate_up[e])
            if hasattr(m, "_apply_gate"):
                h = m._apply_gate(h)
            else:
                gate, up = h.chunk(2, dim=-1)
                h = m.act_fn(gate) * up
            pieces.append(nn.functional.linear(h, down[e]))
        return torch.cat(pieces) if pieces else x.new_empty((0, _local(m.down_proj).shape[1]))


def _local(p):
    return p.to_local() if hasattr(p, "to_local") else p
