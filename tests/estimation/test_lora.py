"""The LoRA estimate against real PEFT models: what autograd saves per block (saved-tensors hooks)
and a whole training step's live tensors (torch's MemTracker)."""
import pytest
import torch

from hybrid.config.spec import LoRA, TrainSpec
from hybrid.estimation.memory.activations import _layer_full, lora_layer_delta
from hybrid.model.decoder import build_hf
from hybrid.model.presets import DecoderConfig
from tests.estimation.test_activations import S, saved_bytes

pytestmark = pytest.mark.torch
peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'hybrid[lora]'")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# (base dtype, adapters in the base's dtype, autocast, precision): fp32; bf16 throughout (FSDP2's
# MixedPrecisionPolicy gathers the adapters in bf16); a bf16 base with fp32 adapters under autocast (DDP)
REGIMES = {"fp32": (torch.float32, True, False, "fp32"), "bf16": (torch.bfloat16, True, False, "bf16"),
           "autocast": (torch.bfloat16, False, True, "bf16-mixed")}


@pytest.mark.parametrize("regime", sorted(REGIMES))
@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj"), ("o_proj", "down_proj")])
def test_lora_block_saves_what_the_formula_says(regime, targets):
    dtype, same_dtype, autocast, precision = REGIMES[regime]
    cfg = DecoderConfig("llama", 300, 64, 1, 4, 176, 128, kv_heads=2, hf_model_type="llama")
    base = build_hf(cfg, device="cpu", dtype=dtype)
    model = peft.get_peft_model(base, peft.LoraConfig(r=8, target_modules=list(targets)),
                                autocast_adapter_dtype=not same_dtype)
    hf = model.base_model.model                 # the transformers model, its linears adapted in place
    block = hf.model.layers[0]
    measured = saved_bytes(hf, block, 3, dtype, autocast) - saved_bytes(hf, block, 1, dtype, autocast)
    spec = TrainSpec(1, S, precision=precision, lora=LoRA(8, targets=targets))
    c = spec.bytes.compute
    expected = (_layer_full(cfg, spec, c, False) + lora_layer_delta(cfg, spec, c, autocast)) * 2 * S
    assert measured == pytest.approx(expected, rel=0.02)


def test_lora_dropout_keeps_its_mask_and_output():
    cfg = DecoderConfig("llama", 300, 64, 1, 4, 176, 128, kv_heads=2, hf_model_type="llama")
    model = peft.get_peft_model(build_hf(cfg, device="cpu"), peft.LoraConfig(r=8, target_modules=list(ALL),
                                                                            lora_dropout=0.1))
    model.train()
    hf = model.base_model.model
    block = hf.model.layers[0]
    measured = saved_bytes(hf, block, 3, None, False) - saved_bytes(hf, block, 1, None, False)
    spec = TrainSpec(1, S, precision="fp32", lora=LoRA(8, dropout=0.1))
    # on CPU dropout keeps its scaled fp32 noise as the mask (CUDA's fused kernel: a bool mask)
    expected = (_layer_full(cfg, spec, 4, False) + lora_layer_delta(cfg, spec, 4, False, mask_bytes=4)) * 2 * S
    assert measured == pytest.approx(expected, rel=0.02)


class _NoHook:
    """MemTracker installs a gradient hook on every parameter, which torch refuses on a frozen one
    (torch 2.13 mem_tracker._track_module_params_and_buffers): a handle in its place skips it."""

    def remove(self):
        pass


def lora_step_peak(model, ids) -> dict:
    """MemTracker's peak snapshot (CPU, by category) over two AdamW steps of a PEFT model on `ids`."""
    from torch.distributed._tools.mem_tracker import MemTracker
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3, foreach=True)
    tracker = MemTracker()
    for p in model.parameters():
        if not p.requires_grad:
            tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    tracker.track_external(model, opt, ids)
    with tracker:
        for _ in range(2):
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            del out
            opt.step()
            opt.zero_grad()
            tracker.reset_mod_stats()
    return tracker.get_tracker_snapshot("peak")[torch.device("cpu")]


@pytest.mark.parametrize("targets", [ALL, ("q_proj", "v_proj")])
def test_lora_step_estimate_matches_memtracker(targets):
    """Two AdamW steps of a PEFT transformers Llama on CPU (fp32, one process, the loop that keeps
    the model's output until backward: `out = model(...); out.loss.backward()`), torch's
    MemTracker peak against the analytic ddp estimate of one rank, less DDP's gradient buckets
    (allocated at wrap time, which a plain loop does not make)."""

    from hybrid.config.cluster import Cluster, cpu_spec
    from hybrid.estimation.memory.analytic import estimate
    from hybrid.families.catalogue import load_catalogue
    from hybrid.model.lora import lora_of
    from hybrid.model.profile import build_profile
    cfg = DecoderConfig("llama", 512, 128, 2, 4, 344, 512, kv_heads=2, hf_model_type="llama")
    torch.manual_seed(0)
    model = peft.get_peft_model(build_hf(cfg, device="cpu"), peft.LoraConfig(r=8, target_modules=list(targets)))
    measured = lora_step_peak(model, torch.randint(0, cfg.vocab, (2, 256)))["Total"]
    spec = TrainSpec(2, 256, precision="fp32", lora=lora_of(model))
    assert spec.lora.targets == tuple(sorted(targets))
    m = estimate(load_catalogue()["ddp"], build_profile(model), spec, Cluster(1, 1, gpu=cpu_spec(1)))
    assert m.phase == "loss"
    assert m.tensors - m.grads == pytest.approx(measured, rel=0.05)


@pytest.mark.parametrize("lora", [False, True])
def test_model_flops_count_what_torch_computes(lora):
    """torch's FlopCounterMode over one forward and backward: a frozen base's matmuls run forward
    and input-gradient only (4 per weight), the adapters' all three (6), the attention whole. A
    small vocabulary keeps the embedding (no matmul) out of the way; block 0's frozen q/k/v input
    gradients, which torch skips, are the residue."""
    from torch.utils.flop_counter import FlopCounterMode

    from hybrid.estimation.cost.step import model_flops_per_token
    from hybrid.model.profile import build_profile
    cfg = DecoderConfig("llama", 64, 128, 4, 4, 344, 512, kv_heads=2, hf_model_type="llama")
    model = build_hf(cfg, device="cpu", attention="eager")      # CPU SDPA has no FLOP formula registered
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=8, target_modules=list(ALL)))
    ids = torch.randint(0, cfg.vocab, (1, 128))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    expected = model_flops_per_token(build_profile(model), 128) * 128
    assert counter.get_total_flops() == pytest.approx(expected, rel=0.03)
