"""LoRA on decoders whose anatomy is read from the transformers module (model/anatomy.py): what
each block saves (saved-tensors hooks over a whole PEFT model's forward, block by block), a
training step's activations and live tensors (torch's MemTracker), and the plans of full-size
published configs."""
import pytest
import torch

from hybrid.config.spec import LoRA, TrainSpec
from tests.estimation.test_lora import ALL, lora_step_peak
from tests.model.test_anatomy import B, S
from tests.model.test_lora import read_tiny

pytestmark = pytest.mark.torch
peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'hybrid[lora]'")


def peft_tiny(mt: str, targets, dropout: float = 0.0):
    model = peft.get_peft_model(read_tiny(mt), peft.LoraConfig(r=8, target_modules=targets if isinstance(targets, str)
                                                               else list(targets), lora_dropout=dropout))
    model.train()
    return model


def saved_per_block(model, ids) -> list[int]:
    """Bytes of the distinct non-parameter storages autograd saves during each block's forward."""
    from hybrid.model.profile import find_blocks
    blocks = find_blocks(model)[1]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    where, seen = [None], {}

    def pack(t):
        st = t.untyped_storage()
        if where[0] is not None and st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), (where[0], st.nbytes()))
        return t
    hooks = [h for i, b in enumerate(blocks) for h in (
        b.register_forward_pre_hook(lambda m, a, i=i: where.__setitem__(0, i)),
        b.register_forward_hook(lambda m, a, o: where.__setitem__(0, None)))]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids)
    for h in hooks:
        h.remove()
    return [sum(n for b, n in seen.values() if b == i) for i in range(len(blocks))]


CASES = [(ALL, 0.0), (("q_proj", "v_proj"), 0.0), (("o_proj", "down_proj"), 0.0), (("down_proj",), 0.0),
         (ALL, 0.1), (("o_proj", "down_proj"), 0.1)]


@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("mt", ["gemma3_text", "qwen2", "olmo2"])
def test_each_read_block_saves_what_lora_read_delta_says(mt, case):
    """Gemma 3's sliding (masked: window 32 < 64) and global blocks, Qwen2's and OLMo 2's (post-norms
    only): each block's saved bytes within 3% of layer_read_full + lora_read_delta, the first block
    (whose input, a frozen embedding's output, needs no gradient) and the others. On CPU dropout
    keeps its scaled fp32 noise as the mask (4 bytes)."""
    from hybrid.estimation.memory.activations import layer_read_full, lora_read_delta
    from hybrid.model.profile import profile_module
    targets, dropout = CASES[case]
    d = profile_module(read_tiny(mt)).decoder
    measured = saved_per_block(peft_tiny(mt, targets, dropout), torch.randint(0, 300, (B, S)))
    spec = TrainSpec(B, S, precision="fp32", lora=LoRA(8, targets=targets, dropout=dropout))
    for i, layer in enumerate(d.stack):
        expected = (layer_read_full(layer, d, spec, 4, False) + lora_read_delta(layer, i, d, spec, 4, False, 4)) * B * S
        assert measured[i] == pytest.approx(expected, rel=0.03), (i, layer.attention.window)


@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("o_proj", "down_proj"), "all-linear"])
@pytest.mark.parametrize("mt", ["qwen3", "gemma3_text"])
def test_a_lora_step_of_a_transformers_decoder_is_what_memtracker_sees(mt, targets):
    """Two AdamW steps of a PEFT Qwen3 (closed form) and Gemma 3 (read from the module) on CPU, fp32,
    the loop that keeps the output until backward (tests/estimation/test_lora.py): MemTracker's
    activations at the peak within 10% of the blocks' and the head's estimate, and its whole peak
    within 6% of the analytic ddp estimate of one rank less DDP's buckets."""

    from hybrid.config.cluster import Cluster, cpu_spec
    from hybrid.estimation.memory.activations import activation_terms
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.families.catalogue import load_catalogue
    from hybrid.model.lora import lora_of
    from hybrid.model.profile import build_profile
    model = peft_tiny(mt, targets)
    snapshot = lora_step_peak(model, torch.randint(0, 300, (B, S)))
    peak = {str(k).split(".")[-1].lower(): v for k, v in snapshot.items()}
    profile = build_profile(model)
    assert bool(profile.decoder.stack) == (mt == "gemma3_text")
    spec = TrainSpec(B, S, precision="fp32", lora=lora_of(model))
    t = activation_terms(profile.decoder, spec, autocast=False)
    assert t.layers * t.per_layer + t.head_forward == pytest.approx(peak["act"], rel=0.10)
    m = estimate(load_catalogue()["ddp"], profile, spec, Cluster(1, 1, gpu=cpu_spec(1)))
    assert m.phase == "loss" and m.tensors - m.grads == pytest.approx(peak["total"], rel=0.06)


def test_plans_of_published_read_decoders_fine_tune_with_lora():
    """gemma3-27b (its anatomy read from the published config's module) with LoRA r16 on 8 H100s:
    a layout fits; its adapters are r x (in + out) of the config's seven projections in each of the
    62 blocks; unchecked, LoRA keeps fewer activations than training the whole model (the frozen
    norms' and unread inputs), more than half; a QLoRA base stores its block linears in nf4."""
    import hybrid
    from hybrid.config.cluster import Cluster
    from hybrid.model.published import PUBLISHED
    cfg = PUBLISHED["gemma3-27b"]
    h, q = cfg["hidden_size"], cfg["num_attention_heads"] * cfg["head_dim"]
    kv, f = cfg["num_key_value_heads"] * cfg["head_dim"], cfg["intermediate_size"]
    cluster = Cluster.build(1, 8, "h100-80gb")
    p = hybrid.plan("gemma3-27b", cluster, seq_len=4096, lora=LoRA(16))
    assert p.model.decoder.stack and p.chosen is not None and p.chosen.known_to_fit
    assert p.model.trainable_params == cfg["num_hidden_layers"] * 16 * (2 * (h + q) + 2 * (h + kv) + 3 * (h + f))
    kw = dict(seq_len=4096, micro_batch=1, activation_checkpointing="none")
    lora, full = (hybrid.estimate("gemma3-27b", "fsdp", cluster, **kw, **extra) for extra in ({"lora": LoRA(16)}, {}))
    assert 0.5 * full.activations < lora.activations < full.activations
    nf4 = hybrid.plan("gemma3-27b", cluster, seq_len=4096, lora=LoRA(16, quantize="nf4"))
    assert nf4.model.quantized_bytes / nf4.model.quantized_params == pytest.approx(0.5 + 1 / 64 + 4 / 16384, rel=1e-3)
    assert nf4.model.quantized_params > 0.9 * (p.model.params - p.model.trainable_params)
