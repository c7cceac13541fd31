"""Optimizer state bytes: the estimate (hybrid/families/placement.py) against the real optimizer's
state after one step on a small decoder (torch), and the formulas on their own (unit)."""
import importlib.util

import pytest

from hybrid.config.spec import TrainSpec
from hybrid.families.placement import newton_schulz_bytes, optimizer_state_bytes, step_scratch_bytes
from hybrid.model.presets import DecoderConfig
from hybrid.model.profile import OptimShapes, profile_decoder

# vocab x hidden and the MLP matrices pass bitsandbytes' 4096-element threshold, the norms do not;
# 4 x 96 = 384 is not a multiple of the 256-element block (a partial last block)
SHAPE = DecoderConfig(style="llama", vocab=384, hidden=64, layers=2, heads=4, ffn=96, max_positions=64, kv_heads=2)


def _state_bytes(*optimizers) -> int:
    """Bytes of every tensor in the optimizers' state, each storage once (bitsandbytes shares its maps)."""
    import torch
    seen, total = set(), 0
    for opt in optimizers:
        for st in opt.state.values():
            for t in st.values():
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen:
                    seen.add(t.untyped_storage().data_ptr())
                    total += t.untyped_storage().nbytes()
    return total


def _one_step(kind: str, model):
    """The real optimizer(s) of `kind` after one step of a loss over the decoder."""
    import torch
    params = [p for p in model.parameters() if p.requires_grad]
    in_blocks = {id(p) for b in model.blocks for p in b.parameters()}
    if kind == "adamw":
        opts = [torch.optim.AdamW(params, lr=1e-3)]
    elif kind == "sgd":
        opts = [torch.optim.SGD(params, lr=1e-3, momentum=0.9)]
    elif kind == "adafactor":
        opts = [torch.optim.Adafactor(params, lr=1e-3)]
    elif kind == "muon":       # as usually run: Muon on the blocks' matrices, AdamW on the rest
        mats = [p for p in params if id(p) in in_blocks and p.ndim == 2]
        opts = [torch.optim.Muon(mats, lr=1e-3),
                torch.optim.AdamW([p for p in params if all(p is not m for m in mats)], lr=1e-3)]
    elif kind == "adamw-8bit":
        bnb = pytest.importorskip("bitsandbytes")
        opts = [bnb.optim.AdamW8bit(params, lr=1e-3)]
    else:
        raise AssertionError(kind)
    ids = torch.randint(0, SHAPE.vocab, (2, 16))
    out = model(ids)
    logits = out.logits if hasattr(out, "logits") else out
    logits.float().square().mean().backward()
    for o in opts:
        o.step()
    return opts


@pytest.mark.torch
@pytest.mark.parametrize("kind", ["adamw", "sgd", "adafactor", "muon", "adamw-8bit"])
def test_estimate_equals_the_real_state_after_one_step(kind):
    """The estimated optimizer-state bytes of the walked module are the bytes the optimizer holds."""
    from hybrid.model.decoder import build_decoder
    from hybrid.model.profile import profile_module
    model = build_decoder(SHAPE)
    profile = profile_module(model)
    assert profile.optim_shapes == profile_decoder(SHAPE, "x").optim_shapes        # the closed form agrees
    real = _state_bytes(*_one_step(kind, model))
    assert optimizer_state_bytes(profile, TrainSpec(optimizer=kind, precision="fp32")) == real


@pytest.mark.torch
def test_adamw_bf16_is_half_of_adamw_in_bf16_states():
    """AdamW over bf16 parameters keeps bf16 moments: what adamw-bf16 prices (2 x 2 bytes)."""
    import torch
    from hybrid.model.decoder import build_decoder
    from hybrid.model.profile import profile_module
    model = build_decoder(SHAPE, dtype=torch.bfloat16)
    real = _state_bytes(*_one_step("adamw", model))
    assert optimizer_state_bytes(profile_module(model), TrainSpec(optimizer="adamw-bf16")) == real


@pytest.mark.unit
def test_state_formulas():
    """Each optimizer's bytes from what it keeps, fp32 states under bf16-mixed."""
    prof = profile_decoder(SHAPE, "x")
    P, sh = prof.trainable_params, prof.optim_shapes

    def est(kind, **kw):
        return optimizer_state_bytes(prof, TrainSpec(optimizer=kind), **kw)
    steps = 4 * sh.tensors                       # torch's 0-dim fp32 step per tensor (AdamW, Adafactor)
    assert est("adamw") == 8 * P + steps and est("adamw-bf16") == 4 * P + steps
    assert est("sgd") == est("lion") == 4 * P
    assert est("muon") == 4 * sh.block_matrices + 8 * (P - sh.block_matrices) + 4 * (sh.tensors - sh.matrices)
    # bitsandbytes: 1 byte per element per state, an fp32 absmax per 256 elements, fp32 small tensors, two maps
    assert est("adamw-8bit") == 2 * (P - sh.small) + 8 * sh.quant_blocks + 8 * sh.small + 2048
    # a flat ZeRO partition is one big tensor; adafactor on it keeps a full-size variance
    assert est("adamw-8bit", flat=True) == 2 * P + 8 * -(-P // 256) + 2048
    assert est("adafactor", flat=True) == 4 * P


@pytest.mark.unit
def test_shapes_of_a_decoder():
    """Muon's matrices are the blocks' 2-D weights; bitsandbytes' small tensors are the norms."""
    h, f, kv, L = SHAPE.hidden, SHAPE.ffn, SHAPE.kv_dim, SHAPE.layers
    sh = profile_decoder(SHAPE, "x").optim_shapes
    assert sh.block_matrices == L * (2 * h * h + 2 * kv * h + 3 * f * h)
    assert sh.largest_matrix in ((f, h), (h, f))
    assert sh.small == (2 * L + 1) * h + L * 2 * kv * h          # norms, and k/v (2048 elements) stay fp32
    big = [SHAPE.vocab * h] * 2 + [h * h] * 2 * L + [f * h] * 3 * L
    assert sh.quant_blocks == sum(-(-n // 256) for n in big)
    assert OptimShapes.of([(10, 20)], [False]).block_matrices == 0        # a root matrix is AdamW's


@pytest.mark.unit
def test_newton_schulz_transient_is_whole_and_in_bf16():
    """The largest matrix m x n: two bf16 iterates and two bf16 r x r Gram terms, not split by sharding."""
    prof = profile_decoder(SHAPE, "x")
    m, n = prof.optim_shapes.largest_matrix
    assert newton_schulz_bytes(prof) == 4 * m * n + 4 * min(m, n) ** 2
    sharded, whole = step_scratch_bytes(prof, TrainSpec(optimizer="muon"))
    assert whole == newton_schulz_bytes(prof) and sharded > 0
    assert step_scratch_bytes(prof, TrainSpec(optimizer="adamw-8bit")) == (0, 0)


@pytest.mark.unit
def test_shape_optimizers_need_shapes():
    from hybrid.errors import HybridError
    from hybrid.model.profile import profile_params
    for kind in ("muon", "adamw-8bit"):
        with pytest.raises(HybridError, match=f"{kind}.*needs the parameter shapes"):
            optimizer_state_bytes(profile_params("1B"), TrainSpec(optimizer=kind))


@pytest.mark.torch
def test_auto_wrap_reads_the_class():
    """The factory's class decides the state priced; an unknown class is priced as AdamW, out loud."""
    import logging

    import torch
    from hybrid.auto import optimizer_kind
    assert optimizer_kind(lambda ps: torch.optim.Muon(ps, lr=1e-3)) == "muon"
    assert optimizer_kind(lambda ps: torch.optim.Adafactor(ps)) == "adafactor"
    assert optimizer_kind(lambda ps: torch.optim.SGD(ps, lr=1e-3, momentum=0.9)) == "sgd"
    if importlib.util.find_spec("bitsandbytes"):
        import bitsandbytes as bnb
        assert optimizer_kind(lambda ps: bnb.optim.AdamW8bit(ps)) == "adamw-8bit"

    class Mine(torch.optim.SGD):
        pass
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("hybrid").addHandler(handler)
    try:
        assert optimizer_kind(lambda ps: Mine(ps, lr=1e-3)) == "adamw"
    finally:
        logging.getLogger("hybrid").removeHandler(handler)
    assert any("Mine is not one hybrid knows" in r.getMessage() for r in records)
