"""The per-layer activation formulas against what autograd really saves (saved-tensors hooks)."""
import pytest
import torch

from hybrid.estimation.memory.activations import _layer_full
from hybrid.model.decoder import build_decoder, build_hf
from hybrid.model.presets import DecoderConfig
from hybrid.config.spec import TrainSpec

pytestmark = pytest.mark.torch

S = 48


def saved_bytes(model, block, b: int, dtype, autocast: bool) -> int:
    """Bytes of distinct non-parameter storages one block saves for backward."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    h = model.config.hidden if isinstance(model.config, DecoderConfig) else model.config.hidden_size
    x = torch.randn(b, S, h, dtype=dtype or torch.float32, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        if isinstance(model.config, DecoderConfig):
            block(x, model._rope(S, x.dtype, "cpu"), model._mask(b, S, "cpu"))
        elif model.config.model_type == "gpt2":
            block(x)
        else:
            pos = torch.arange(S)[None]
            block(x, position_embeddings=model.model.rotary_emb(x, pos), attention_mask=None,
                  position_ids=pos)
    return sum(seen.values())


REGIMES = {"bf16": (torch.bfloat16, False, "bf16"), "fp32": (torch.float32, False, "fp32"),
           "autocast": (None, True, "bf16-mixed")}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
@pytest.mark.parametrize("impl", ["ours-llama", "ours-gpt2", "ours-gpt2tanh", "hf-llama", "hf-gpt2", "ours-window"])
def test_layer_formula_matches_autograd(regime, attention, impl):
    dtype, autocast, precision = REGIMES[regime]
    style = "gpt2" if "gpt2" in impl else "llama"
    # "window": a sliding window shorter than the sequence forces a masked attention kernel
    cfg = DecoderConfig(style, 300, 64, 1, 4, 176, 128, kv_heads=2 if style == "llama" else None,
                        sliding_window=32 if impl == "ours-window" else None,
                        gelu="tanh" if impl == "ours-gpt2tanh" else "new")
    build = build_hf if impl.startswith("hf") else build_decoder
    model = build(cfg, device="cpu", attention=attention, dtype=dtype)
    block = (model.model.layers[0] if impl == "hf-llama" else model.transformer.h[0] if impl == "hf-gpt2"
             else model.blocks[0])
    # The difference between batch 3 and batch 1 is 2*S tokens of per-token activations; weight
    # casts and rotary tables (independent of the batch) cancel out.
    measured = (saved_bytes(model, block, 3, dtype, autocast) - saved_bytes(model, block, 1, dtype, autocast))
    spec = TrainSpec(1, S, precision=precision, attention=attention)
    expected = _layer_full(cfg, spec, spec.bytes.compute, autocast) * 2 * S
    assert measured == pytest.approx(expected, rel=0.02)


def live_after_forward(model, blocks, b: int, dtype) -> int:
    """Bytes alive after the blocks' forward (what they keep for backward, the input included,
    the last output excluded), counted storage by storage by the project's dispatch tracker."""
    from hybrid.measure.tracker import MemoryTracker
    tracker = MemoryTracker()
    with tracker:
        x = torch.randn(b, S, model.config.hidden, dtype=dtype, requires_grad=True)
        rope, mask = model._rope(S, x.dtype, "cpu"), model._mask(b, S, "cpu")
        y = x
        for block in blocks:
            y = block(y, rope, mask)
        live = tracker.current - y.untyped_storage().nbytes()
    return live


@pytest.mark.parametrize("mode", ["op", "layer:2", "full", "selective"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_checkpointing_policies_keep_what_the_formulas_say(mode, dtype):
    """torchtitan's per-op policy and layer:N (every N-th block fully recomputed), as the
    backends apply them, keep what hybrid.estimation.memory.activations counts."""
    from hybrid.runtime.activation_checkpoint import apply_activation_checkpointing
    from hybrid.estimation.memory.activations import activation_terms
    cfg = DecoderConfig("llama", 300, 64, 4, 4, 176, 128, kv_heads=2)
    model = build_decoder(cfg, device="cpu", dtype=dtype)
    assert apply_activation_checkpointing(model, mode) == (2 if mode == "layer:2" else 4)
    measured = (live_after_forward(model, list(model.blocks), 3, dtype)
                - live_after_forward(model, list(model.blocks), 1, dtype))
    spec = TrainSpec(2, S, precision="fp32" if dtype == torch.float32 else "bf16", activation_checkpointing=mode)
    terms = activation_terms(cfg, spec, autocast=False)
    assert measured == pytest.approx(terms.per_layer * terms.layers, rel=0.02)


def head_saved_bytes(model, norm, b: int, dtype, autocast: bool) -> int:
    """Bytes of distinct non-parameter storages alive from the final norm's forward to the loss: what the
    norm, the head and the loss save for backward, and the logits the output holds (the traced driver,
    hybrid/measure/driver.py, keeps the output until the loss's backward is done)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params and t.dtype.is_floating_point:      # labels' int copies aside
            seen[st.data_ptr()] = st.nbytes()
        return t

    hooks = torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)
    pre = norm.register_forward_pre_hook(lambda *_: hooks.__enter__())
    vocab = model.config.vocab if isinstance(model.config, DecoderConfig) else model.config.vocab_size
    ids = torch.randint(0, vocab, (b, S))
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(input_ids=ids, labels=ids)
    finally:
        hooks.__exit__(None, None, None)
        pre.remove()
    seen[out.logits.untyped_storage().data_ptr()] = out.logits.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("impl", ["ours-llama", "ours-gpt2", "hf-llama", "hf-gpt2"])
def test_head_formula_matches_autograd(regime, impl):
    """The final norm, the head and the eager loss (loss_terms' head_forward) against what autograd saves and
    the output holds: the norm as a block's pre-norm keeps it (its input, statistics, normalised value and
    the output the head keeps; under autocast in fp32, the head keeping its bf16 cast), the logits and the
    log-softmax's fp32 output."""
    from hybrid.estimation.memory.activations import loss_terms
    from hybrid.model.decoder import prepare_for_training
    dtype, autocast, precision = REGIMES[regime]
    style = "gpt2" if "gpt2" in impl else "llama"
    cfg = DecoderConfig(style, 300, 64, 1, 4, 176, 128, kv_heads=2 if style == "llama" else None, gelu="new")
    model = (build_hf if impl.startswith("hf") else build_decoder)(cfg, device="cpu", dtype=dtype)
    prepare_for_training(model)
    norm = model.model.norm if impl == "hf-llama" else model.transformer.ln_f if impl == "hf-gpt2" else model.norm
    measured = head_saved_bytes(model, norm, 3, dtype, autocast) - head_saved_bytes(model, norm, 1, dtype, autocast)
    expected = loss_terms(cfg, TrainSpec(1, S, precision=precision), autocast)[0] * 2
    assert measured == pytest.approx(expected, rel=0.01)


@pytest.mark.parametrize("mode", ["none", "full", "selective", "op", "layer:2"])
def test_autocast_weight_copies_are_what_kept_matmuls_save(mode):
    """Under autocast over fp32 weights (DDP's bf16-mixed) a matmul saves the bf16 copy of its weight, which
    then outlives autocast's cache: the LM head's and every uncheckpointed block's; a checkpointed block's
    copies are made again when it is recomputed (ActivationTerms.autocast_cache)."""
    from hybrid.estimation.memory.activations import activation_terms
    from hybrid.runtime.activation_checkpoint import apply_activation_checkpointing
    cfg = DecoderConfig("llama", 300, 64, 4, 4, 176, 128, kv_heads=2)
    model = build_decoder(cfg, device="cpu")
    apply_activation_checkpointing(model, mode)
    shapes = {tuple(p.shape) for p in model.parameters() if p.dim() == 2}
    copies = {}

    def pack(t):
        if t.dtype == torch.bfloat16 and (tuple(t.shape) in shapes or tuple(t.shape[::-1]) in shapes):
            copies[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    ids = torch.randint(0, cfg.vocab, (2, S))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids)
    terms = activation_terms(cfg, TrainSpec(2, S, precision="bf16-mixed", activation_checkpointing=mode),
                             autocast=True)
    assert sum(copies.values()) == terms.autocast_cache
