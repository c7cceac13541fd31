"""Where a family keeps its bytes, per moment of the step (pure): a family's Placement, the
optimizer's state size, and the NotApplicable verdict. Used by hybrid/families/* and estimation/memory/analytic.py."""
from __future__ import annotations

from dataclasses import dataclass, fields
from types import SimpleNamespace

from ..errors import HybridError, NotApplicable  # noqa: F401 - NotApplicable is imported from here
from ..model.profile import ModelProfile
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


def optimizer_elements(profile: ModelProfile, spec: TrainSpec) -> int:
    """State elements the optimizer keeps for the trainable parameters (the one source: memory
    and the cost model's optimizer step both read it)."""
    P = profile.trainable_params
    if spec.optimizer == "adamw":
        return 2 * P                      # exp_avg, exp_avg_sq (torch.optim.AdamW)
    if spec.optimizer == "sgd":
        return P                          # momentum_buffer (torch.optim.SGD, momentum > 0)
    if profile.factored_state is None:
        raise HybridError(f"optimizer 'adafactor' keeps one row and one column vector per matrix, so it "
                          f"needs the parameter shapes; {profile.name} is a bare count. Give a preset, a "
                          "config.json or a module, or use --optimizer adamw/sgd")
    return profile.factored_state         # torch.optim.Adafactor row_var/col_var (no first moment)


def scratch_elements(profile: ModelProfile, spec: TrainSpec) -> int:
    """Optimizer-step temporaries: foreach AdamW's torch._foreach_sqrt(exp_avg_sqs) allocates one
    tensor per parameter; Adafactor builds the full-size variance estimate per parameter; SGD
    updates in place."""
    return {"adamw": profile.trainable_params, "sgd": 0, "adafactor": profile.largest_param}[spec.optimizer]


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
