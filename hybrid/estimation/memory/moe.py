"""Expert parallelism's memory terms (pure): what a rank holds and keeps when each MoE layer's
experts are split over `ep` ranks (ParallelDims.ep, taken from dp_shard x cp as torchtitan does).

    states    the dense parts FSDP-sharded over dp_shard x cp as today; each rank's experts/ep
              experts FSDP-sharded over the expert_shard = dp_shard x cp / ep ranks of its
              expert group (torchtitan's apply_fsdp: fully_shard(experts, mesh=dp_shard_mod_ep)):
              per rank the same shard of every state, but the gathered expert unit of a block is
              experts/ep experts, not the whole stack, and the unsharded gradients gradient
              accumulation keeps are the rank's experts only;
    routed    the busiest rank's experts receive imbalance x the mean (tokens x top_k: each of the
              ep ranks sends it tokens x top_k / ep pairs): its routed activations (moe_pair per
              pair) grow by (imbalance - 1) x that;
    buffers   one MoE layer's all-to-alls in flight in the block being differentiated: dispatch
              (send tokens x top_k x hidden, receive imbalance x that) and combine (the reverse),
              in the compute dtype.
At ep 1 nothing here applies: a rank computes its own tokens with every expert (FSDP gathers
the whole stack), as estimation/memory/analytic.py counts it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...errors import HybridError, NotApplicable
from ...layout.dims import divisors
from ...model.profile import ModelProfile, OptimShapes
from ...config.spec import TrainSpec
from .activations import F32, ActivationTerms, _moe_mlp, checkpointed_blocks, moe_pair
from ...families.placement import Placement, draft, reduce_bytes

_SUMMED = ("params", "optimizer", "grads_start", "grads_end", "grads_step", "buffers_start", "regathered",
           "buffers_mid", "buffers_end", "buffers_step", "scratch", "cpu")


def check_ep(profile: ModelProfile, ep: int | None, catalogue=None, names=None) -> None:
    """A pinned ep > 1 needs an MoE decoder whose expert count it divides and, among the presets
    `names` of `catalogue`, one whose family splits experts (HybridError: the user's input)."""
    d = profile.decoder
    if ep is None or ep == 1:
        return
    if d is None or not d.moe:
        raise HybridError(f"--ep {ep}: {profile.name} is a dense model (no experts to split); expert parallelism "
                          "applies to mixture-of-experts models: leave --ep out (or use --ep 1)")
    if d.experts % ep:
        valid = [e for e in range(1, d.experts + 1) if d.experts % e == 0]
        raise HybridError(f"--ep {ep} does not divide {profile.name}'s {d.experts} experts per layer, so ranks "
                          f"would hold different numbers of experts; valid ep: {', '.join(map(str, valid))}")
    if catalogue is not None and not any(catalogue[n].family_obj.supports_ep for n in names):
        raise HybridError(f"--ep {ep}: {', '.join(names)} cannot split experts; expert parallelism runs on "
                          f"{', '.join(n for n in catalogue if catalogue[n].family_obj.supports_ep)}: use one of them "
                          "with --ep, or leave --ep out")


def check_ep_layouts(ep: int | None, layouts: list, cluster) -> None:
    """A pinned ep > 1 that no enumerated layout takes (HybridError, with the rule)."""
    if ep is not None and ep > 1 and not layouts:
        raise HybridError(f"--ep {ep}: no layout on {cluster.describe()} has dp_shard x cp divisible by {ep} (expert-"
                          f"parallel ranks are taken from them): use an --ep that divides {cluster.world_size}, or "
                          "leave --ep out")


def ep_cluster(cluster, ep: int):
    """The cluster whose 'GPUs' are ep groups (consecutive ranks, the innermost mesh dimension
    after cp and tp): an expert-shard group takes one rank from each of its ep groups, so it
    is priced and laid out as a group of these (as estimation/cost/step.py prices tp groups). An
    ep group stays inside a scale-up domain (on NVL72 across trays of one rack) or takes whole ones."""
    if ep_fits(cluster, ep):
        return cluster.grouped(ep)
    per, word = cluster.domain, cluster.domain_word
    raise NotApplicable(f"ep {ep} neither divides the {per} GPUs per {word} nor is a whole number of {word}s (of "
                        f"whole {cluster.gpus_per_node}-GPU nodes), so an expert-parallel group would straddle "
                        f"{word}s")


def ep_fits(cluster, ep: int) -> bool:
    """Whether ep consecutive ranks lie inside one scale-up domain or on whole ones, and on whole
    nodes or inside one (so Cluster.grouped can price them)."""
    per, dom, world = cluster.gpus_per_node, cluster.domain, cluster.world_size
    in_domain = dom % ep == 0 or (ep % dom == 0 and world % ep == 0)
    in_nodes = per % ep == 0 or (ep % per == 0 and cluster.nodes % (ep // per) == 0)
    return in_domain and in_nodes


def expert_split(profile: ModelProfile, ep: int) -> tuple[ModelProfile, ModelProfile]:
    """(dense parts, the rank's experts): the two FSDP groups of one rank under expert parallelism.
    The experts' profile holds experts/ep experts of every block, as one unit per block."""
    d = profile.decoder
    L, local = d.moe_layers, d.experts // ep
    whole = L * d.experts * d.expert_params
    mine = L * local * d.expert_params
    frac = profile.trainable_params / profile.params
    # Adafactor: one row and one column vector per expert matrix (gate_up 2m x h, down h x m)
    fact = L * (3 * d.hidden + 3 * d.moe_ffn)
    experts = dataclasses.replace(
        profile, name=f"{profile.name} [experts, ep {ep}]", params=mine, trainable_params=round(mine * frac),
        param_bytes=round(profile.param_bytes * mine / profile.params),
        dtype_bytes=tuple((k, round(v * mine / profile.params)) for k, v in profile.dtype_bytes),
        buffer_bytes=0, block_params=local * d.expert_params, root_params=0,
        largest_layer_params=local * d.expert_params, largest_param=local * 2 * d.moe_ffn * d.hidden,
        factored_state=None if profile.factored_state is None else local * fact, tied_groups=(),
        optim_shapes=None if profile.optim_shapes is None else _expert_shapes(L, local, d))
    rest = profile.params - whole
    dense = dataclasses.replace(
        profile, name=f"{profile.name} [dense]", params=rest, trainable_params=round(rest * frac),
        param_bytes=round(profile.param_bytes * rest / profile.params),
        dtype_bytes=tuple((k, round(v * rest / profile.params)) for k, v in profile.dtype_bytes),
        block_params=profile.block_params - d.experts * d.expert_params,
        largest_layer_params=d.vocab * d.hidden, largest_param=d.vocab * d.hidden,
        factored_state=None if profile.factored_state is None else profile.factored_state - d.experts * fact,
        optim_shapes=None if profile.optim_shapes is None else _without(profile.optim_shapes,
                                                                         _expert_shapes(L, d.experts, d)))
    return dense, experts


def _expert_shapes(layers: int, experts: int, d) -> OptimShapes:
    """OptimShapes of `experts` stacked experts per block (gate_up e x 2m x h, down e x h x m):
    3-D tensors, so AdamW's under Muon and 8-bit under bitsandbytes."""
    one = OptimShapes.of([(experts, 2 * d.moe_ffn, d.hidden), (experts, d.hidden, d.moe_ffn)], [True, True])
    return OptimShapes(0, (0, 0), layers * one.small, layers * one.quant_blocks, layers * one.tensors, 0)


def _without(whole: OptimShapes, part: OptimShapes) -> OptimShapes:
    return dataclasses.replace(whole, small=whole.small - part.small, tensors=whole.tensors - part.tensors,
                               quant_blocks=whole.quant_blocks - part.quant_blocks)


def alternating_units(summed_mid: float, D: int, E: int, spec: TrainSpec, last: int = 0,
                      routed: int = 0) -> tuple[tuple[float, int, int], ...]:
    """(buffers, parameters whose gradients are alive, recomputed activations already freed) at
    each moment of a block's backward when its experts are an FSDP unit of their own (E
    parameters) inside the block's dense unit (D).
    The two placements summed count each unit as FSDP's dense-model terms do, both at once:
    gathered, its successor prefetched (2 x c) and a reduce-scatter input (rb). FSDP2 runs
    them one after the other. post_forward_order is [.., experts_i, block_i, ..] (the nested
    experts finish forward first), and a unit's pre-backward prefetches the one before it
    (torch 2.13 _fsdp_param_group.py _backward_prefetch: post_forward_order[curr_index - 1]);
    post_backward reshards the unit, then keeps its reduce-scatter input alive until the next
    unit's post_backward ("Recycle prior modules' reduce-scatter input buffers"). So:
      experts_i backward: block_i and experts_i gathered, block_{i-1} prefetched, block_{i+1}'s
                          reduce-scatter input: c (2D + E) + rb D; the experts' gradients made;
      experts_i reduced:  block_i gathered, block_{i-1} prefetched, the experts' reduce-scatter
                          input beside their gradients (foreach_reduce copies them in; the
                          previous input is let go first: reduce_scatter_max_input_buffers 1):
                          c 2D + rb E + c E; a stack cut along dim 1 is first copied whole
                          (_fsdp_collectives.foreach_reduce: torch.cat(torch.chunk(grad, world,
                          dim)), replacing its gradient) while the loop variable still holds the
                          last one's original: + c `last`;
      block_i's dense backward: block_i gathered, block_{i-1} prefetched, experts_i's input:
                          c 2D + rb E; the dense gradients made.
    They replace the summed terms (2c (D + E) + rb (D + E)); analytic.step_moments takes the
    largest. `routed`: the recomputed activations the experts' backward has freed by their reduce."""
    c, rb = spec.bytes.compute, reduce_bytes(spec)
    rest = summed_mid - (2 * c + rb) * (D + E)   # the root's and the head's terms
    return ((rest + c * (2 * D + E) + rb * D, E, 0), (rest + c * 2 * D + rb * E + c * last, E, routed),
            (rest + c * 2 * D + rb * E, D, routed))


@dataclass(frozen=True)
class ExpertParallel:
    """What ep > 1 changes in one rank's estimate (memory/analytic.estimate applies it)."""

    ep: int
    imbalance: float
    """The busiest rank's tokens over the mean: spec.moe_imbalance, at most ep."""
    placement: Placement
    """The family's placement: the dense parts' and the experts' FSDP groups summed."""
    unit: int
    """Parameters of one block as this rank gathers and differentiates it: its dense parts and
    its experts/ep experts."""
    routed_extra: int
    """Bytes per micro-batch one MoE block keeps beyond the mean for the busiest rank's pairs."""
    a2a_buffers: int
    """Bytes of one MoE layer's dispatch and combine buffers (send and receive)."""
    block_moments: tuple[tuple[float, int, int], ...] = ()
    """(buffers, unit, recomputed bytes freed) of each moment of a block's backward
    (alternating_units); empty: the placement's buffers_mid and `unit`."""

    def activations(self, act: ActivationTerms, spec: TrainSpec, layers: int) -> ActivationTerms:
        """The busiest rank's extra routed activations where the block keeps them (no
        checkpointing; the blocks layer:N leaves alone), and in the recomputed block otherwise
        (full, selective and op recompute the experts' grouped matmuls: activations.py)."""
        mode, extra = spec.activation_checkpointing, self.routed_extra
        if mode == "none":
            return dataclasses.replace(act, per_layer=act.per_layer + extra)
        if mode.startswith("layer:"):
            kept = layers - checkpointed_blocks(layers, int(mode.split(":", 1)[1]))
            return dataclasses.replace(act, per_layer=int(act.per_layer + extra * kept / layers),
                                       recompute=act.recompute + extra)
        return dataclasses.replace(act, recompute=act.recompute + extra)


def expert_parallel(strategy, profile: ModelProfile, spec: TrainSpec, cluster, n: int, cp: int, ep: int,
                    placement_of, staged: bool = False) -> ExpertParallel | None:
    """The ep > 1 terms of one rank (None at ep 1). `spec` is the rank's (a cp rank's S / cp
    tokens); `placement_of(strategy, profile, spec, cluster, n)` is the family's placement;
    `staged`: the rank is a pipeline stage."""
    if ep == 1:
        return None
    check_ep(profile, ep)
    if not strategy.family_obj.supports_ep:
        raise NotApplicable(f"expert parallelism is applied with fsdp strategies here (torchtitan's layout: experts "
                            f"split over ep, each FSDP-sharded over the rest); {strategy.family} runs ep 1")
    if staged:
        raise NotApplicable("expert parallelism with pipeline stages is not modelled; use pp 1 with ep")
    if spec.compile:
        raise NotApplicable("compiled MoE blocks with ep > 1 are not modelled (the all-to-all's dynamic shapes); "
                            "use eager with ep, or ep 1")
    if (n * cp) % ep:
        raise NotApplicable(f"ep {ep} does not divide dp_shard({n}) x cp({cp}) = {n * cp}")
    d = profile.decoder
    dense, experts = expert_split(profile, ep)
    a = placement_of(strategy, dense, spec, cluster, n * cp)
    b = placement_of(strategy, experts, spec, ep_cluster(cluster, ep), n * cp // ep)
    place = draft(**{k: getattr(a, k) + getattr(b, k) for k in _SUMMED}, autocast=a.autocast,
                  notes=list(a.notes) + [x for x in b.notes if x not in a.notes])
    unit, moments = dense.block_params + experts.block_params, ()
    if getattr(strategy.config, "reshard_after_forward", True):
        local = d.experts // ep
        # the last expert stack FSDP2 reduces (down_proj, registered after gate_up_proj) when it
        # is cut along dim 1 (fewer local experts than expert_shard ranks: ep._expert_placement)
        last = 0 if local >= n * cp // ep else local * d.hidden * d.moe_ffn
        # by the experts' reduce their backward is done: the block's recomputed routed
        # activations (activations.py _moe_mlp, and the busiest rank's extra) are gone
        routed = int(spec.tokens * _moe_mlp(d, F32 if place.autocast else spec.bytes.compute)
                     + (min(spec.moe_imbalance, ep) - 1) * spec.tokens * d.top_k * moe_pair(d, spec.bytes.compute))
        moments = alternating_units(place.buffers_mid, dense.block_params, experts.block_params, spec, last, routed)
        place.buffers_mid, unit, _ = moments[0]
        # in the loss backward the root's pre-backward prefetches the unit before it in
        # post_forward_order, the last block's dense unit: its experts are gathered later, in
        # their own pre-backward (the summed placements count them gathered with the root)
        gathered = spec.bytes.compute * experts.block_params
        place.buffers_start -= gathered
        place.regathered = max(0, place.regathered - gathered)
    imb = min(spec.moe_imbalance, ep)          # every pair on one rank at most
    c = spec.bytes.compute
    pairs = spec.tokens * d.top_k               # the mean a rank receives: ep ranks x tokens x top_k / ep
    shard = n * cp // ep
    where = f"FSDP-sharded over {shard} ranks" if shard > 1 else "whole on each rank (expert_shard 1)"
    place.notes.append(f"expert parallel {ep}: {d.experts // ep} of {d.experts} experts per rank, {where}; the busiest "
                     f"rank receives {imb:g}x the mean routed tokens (--moe-imbalance)")
    return ExpertParallel(
        ep=ep, imbalance=imb, placement=Placement.of(place), unit=unit,
        routed_extra=int((imb - 1) * pairs * moe_pair(d, c)),
        a2a_buffers=int(2 * (1 + imb) * pairs * d.hidden * c), block_moments=moments)


def ep_degrees(profile: ModelProfile, strategy, n: int, cp: int, tp: int, pp: int, cluster,
               ep: int | None) -> list[int]:
    """Expert-parallel degrees of one layout: 1 for a dense model; a pinned ep where it divides
    dp_shard x cp (ParallelDims' rule); else, for an MoE model under an fsdp strategy at pp 1
    (estimation/memory/moe.py models those), 1 and every divisor of the experts that divides dp_shard x cp
    and lies inside a scale-up domain or on whole ones (consecutive ranks, as shard groups do)."""
    d = profile.decoder
    if d is None or not d.moe:
        return [1]
    if ep is not None:
        return [ep] if (n * cp) % ep == 0 else []
    if not strategy.family_obj.supports_ep or pp > 1:
        return [1]
    groups = cluster.grouped(tp)
    return [e for e in divisors(d.experts) if e == 1 or ((n * cp) % e == 0 and ep_fits(groups, e))]
