"""Where a family keeps its bytes, per moment of the step (pure): a family's Placement, the
optimizer's state size, and the NotApplicable verdict. Used by hybrid/families/* and estimation/memory/analytic.py."""
from __future__ import annotations

from dataclasses import dataclass, fields
from math import ceil
from types import SimpleNamespace

from ..errors import HybridError, NotApplicable  # noqa: F401 - NotApplicable is imported from here
from ..model.profile import BNB_BLOCK, ModelProfile
from ..config.spec import TrainSpec

FP32 = 4


@dataclass(frozen=True)
class Placement:
    """Where a family keeps things, bytes per GPU, at each moment of the step (built from a draft)."""
    params: float = 0
    optimizer: float = 0
    grads_start: float = 0      # gradients that exist when backward starts (persistent buffers)
    grads_end: float = 0
    grads_step: float = 0       # extra gradient copies made for the step (DeepSpeed fp32 partition)
    accumulated: float = 0      # of grads_start / grads_end: unsharded gradients FSDP2 accumulates in its
                                #     own buffers (no-sync windows, pipeline stages)
    grads_early: bool = False   # grads_end is one buffer made whole at the first gradient reduced into it
                                #     (ZeRO-2's grads_in_partition): the last rank's share, which backward
                                #     reaches first, holds it through the blocks' backward beside grads_start
    buffers_start: float = 0    # communication buffers at the loss backward
    regathered: float = 0       # ... of which gathered in the root's pre-backward, after a loss computed
                                #     outside the model's forward (context parallelism) has run backward
    buffers_mid: float = 0      # ... while a block is in backward
    buffers_end: float = 0      # ... when backward finishes
    buffers_step: float = 0
    scratch: float = 0          # optimizer-step temporaries on the GPU
    cpu: float = 0
    autocast: bool = False
    notes: tuple[str, ...] = ()

    @classmethod
    def of(cls, draft: SimpleNamespace) -> "Placement":
        """The value of a filled-in draft()."""
        return cls(**{**vars(draft), "notes": tuple(draft.notes)})


def draft(**values) -> SimpleNamespace:
    """A Placement's fields to fill in (zero, no notes, unless given), mutable until Placement.of."""
    start = {f.name: f.default for f in fields(Placement)}
    return SimpleNamespace(**{**start, "notes": [], **values})


BF16 = 2
BNB_QMAPS = 2 * 256 * FP32
"""bitsandbytes' two 256-entry fp32 quantisation maps (signed and unsigned dynamic), one pair per
optimizer, shared by every 8-bit tensor's state (F.create_dynamic_map)."""


def _shapes(profile: ModelProfile, spec: TrainSpec):
    if profile.optim_shapes is None:
        raise HybridError(f"optimizer {spec.optimizer!r} keeps state by tensor shape, so it needs the parameter "
                          f"shapes; {profile.name} is a bare count. Give a preset, a config.json or a module, or "
                          "use --optimizer adamw/sgd/lion")
    return profile.optim_shapes


def optimizer_state_bytes(profile: ModelProfile, spec: TrainSpec, state: int | None = None,
                          flat: bool = False) -> float:
    """Bytes the optimizer keeps for the trainable parameters (the one source: the families'
    placements and the cost model's optimizer step read it). `state`: bytes
    per state element the optimizer's parameters carry (default spec.bytes.state); `flat`: the
    optimizer sees flat 1-D partitions (DeepSpeed ZeRO), so bitsandbytes quantises everything."""
    P, s = profile.trainable_params, spec.bytes.state if state is None else state
    kind = spec.optimizer
    sh = profile.optim_shapes
    steps = FP32 * sh.tensors if sh is not None and not flat else 0    # torch's 0-dim fp32 `step` per tensor
    if kind == "adamw":
        return 2 * P * s + steps          # exp_avg, exp_avg_sq (torch.optim.AdamW: zeros_like the parameter)
    if kind == "adamw-bf16":
        return 2 * P * BF16 + steps       # both moments in bf16 (torchtitan; DeepSeek-V3, arXiv 2412.19437 3.3)
    if kind in ("sgd", "lion"):
        return P * s                      # momentum_buffer (torch.optim.SGD, momentum > 0) | Lion's exp_avg
    if kind == "adamw-8bit":
        if flat:                          # one flat partition: all of it 8-bit
            return 2 * P + 2 * FP32 * ceil(P / BNB_BLOCK) + BNB_QMAPS
        sh = _shapes(profile, spec)       # bitsandbytes Optimizer2State.init_state
        big = P - sh.small
        return 2 * big + 2 * FP32 * sh.quant_blocks + 2 * FP32 * sh.small + (BNB_QMAPS if big else 0)
    if kind == "muon":
        m = _shapes(profile, spec).block_matrices    # Muon's momentum_buffer on the matrices; AdamW on the rest
        return m * s + 2 * (P - m) * s + FP32 * (sh.tensors - sh.matrices)
    if flat:                              # Adafactor on a 1-D partition: a full-size variance
        return P * s + steps
    if profile.factored_state is None:
        raise HybridError(f"optimizer 'adafactor' keeps one row and one column vector per matrix, so it "
                          f"needs the parameter shapes; {profile.name} is a bare count. Give a preset, a "
                          "config.json or a module, or use --optimizer adamw/sgd")
    return profile.factored_state * s + steps    # torch.optim.Adafactor row_var/col_var (no first moment)


def newton_schulz_bytes(profile: ModelProfile) -> int:
    """Muon's step transient on the largest block matrix (m x n, r = min): torch.optim.Muon's
    _zeropower_via_newtonschulz holds the bf16 matrix and the next iterate (2 x 2mn) and the r x r
    Gram matrix and its polynomial (2 x 2r^2). Whole, not a shard: orthogonalisation needs the full
    matrix, which FSDP and ZeRO gather at the step."""
    if profile.optim_shapes is None:
        return 0
    m, n = profile.optim_shapes.largest_matrix
    return 2 * BF16 * m * n + 2 * BF16 * min(m, n) ** 2


def step_scratch_bytes(profile: ModelProfile, spec: TrainSpec, state: int | None = None) -> tuple[float, float]:
    """(sharded, whole) bytes of the optimizer step's temporaries: the first is over the ranks'
    shard like the state, the second is per rank whatever the sharding. foreach AdamW's
    torch._foreach_sqrt(exp_avg_sqs) allocates one tensor per parameter (in the states' dtype);
    Adafactor builds the full-size variance estimate per parameter; Lion's sign update is one
    parameter-size pair at a time; bitsandbytes and SGD update in place; Muon: the Nesterov
    update of the largest matrix, its Newton-Schulz work (whole), and AdamW's on the rest."""
    P, s = profile.trainable_params, spec.bytes.state if state is None else state
    kind = spec.optimizer
    if kind == "adamw":
        return P * s, 0
    if kind == "adamw-bf16":
        return P * BF16, 0
    if kind in ("sgd", "adamw-8bit"):
        return 0, 0
    if kind == "adafactor":
        return profile.largest_param * s, 0
    if kind == "lion":                    # exp_avg.clone() and its sum with the gradient, then sign_()
        return 2 * profile.largest_param * s, 0
    sh = _shapes(profile, spec)
    m, n = sh.largest_matrix
    return (P - sh.block_matrices + m * n) * s, newton_schulz_bytes(profile)


def frozen_bytes(profile: ModelProfile, spec: TrainSpec) -> float:
    """Bytes of the frozen parameters (a LoRA base) as trained: spec.frozen_bytes each (the
    compute dtype under the mixed precisions: they have no fp32 master), the quantised ones as
    stored (packed values and their constants, model/lora.py)."""
    frozen = profile.params - profile.trainable_params
    return (frozen - profile.quantized_params) * spec.frozen_bytes + profile.quantized_bytes


def param_bytes(profile: ModelProfile, spec: TrainSpec, trainable: int | None = None) -> float:
    """Bytes of every parameter a rank stores whole: the trainable ones at `trainable` bytes each
    (default the precision's parameter dtype: the fp32 master under the mixed precisions) plus
    the frozen ones (frozen_bytes). The one source for the families' parameter memory."""
    b = spec.bytes.param if trainable is None else trainable
    return profile.trainable_params * b + frozen_bytes(profile, spec)


def gathered_bytes(profile: ModelProfile, spec: TrainSpec, elements: float, blocks: float = 0) -> float:
    """Bytes of `elements` parameters all-gathered in the compute dtype, `blocks` of the model's
    blocks among them: their quantised linears travel and sit gathered packed (QLoRA under FSDP
    gathers the 4-bit storage; each linear is dequantised for its matmul, a transient)."""
    n = max(profile.num_blocks, 1)
    q_elems, q_bytes = profile.quantized_params * blocks / n, profile.quantized_bytes * blocks / n
    return spec.bytes.compute * (elements - q_elems) + q_bytes


def reduce_bytes(spec: TrainSpec) -> int:
    """Bytes per gradient element as FSDP2 reduce-scatters it: MixedPrecisionPolicy(reduce_dtype=
    float32) for the mixed precisions and fp32; pure bf16 reduces in bf16 (the one source)."""
    return FP32 if spec.precision != "bf16" else 2
