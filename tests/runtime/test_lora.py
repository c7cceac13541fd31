"""auto_wrap trains a PEFT LoRA model: the plan reads its LoraConfig, and FSDP2 and DDP end where
one process ends on the same global batch (fp32, 1e-5); a bitsandbytes base is refused on CPU."""
import os

import pytest
import torch

from hybrid.runtime.launch import run_ranks

peft = pytest.importorskip("peft", reason="peft is not installed: pip install 'hybrid[lora]'")

SEQ, STEPS = 16, 3


def peft_llama():
    from hybrid.model.decoder import build_hf
    from hybrid.model.presets import DecoderConfig
    torch.manual_seed(0)
    cfg = DecoderConfig("llama", 300, 64, 2, 4, 176, 128, kv_heads=2, hf_model_type="llama")
    return peft.get_peft_model(build_hf(cfg, device="cpu"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj",
                                                                                                 "down_proj"]))


def peft_gemma3():
    """A tiny transformers Gemma 3, read from its module (a sliding layer, window 8 < SEQ, then a global one)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           layer_types=["sliding_attention", "full_attention"], max_position_embeddings=64,
                           pad_token_id=0, eos_token_id=1, bos_token_id=1)
    return peft.get_peft_model(Gemma3ForCausalLM(cfg), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj",
                                                                                            "down_proj"]))


MODELS = {"llama": peft_llama, "gemma3": peft_gemma3}


def batches():
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, 300, (2, SEQ), generator=g) for _ in range(STEPS)]


def adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-2)


def reference(name="llama"):
    model = MODELS[name]()
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    losses = []
    for ids in batches():
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def wrapped_losses():
    import torch.distributed as dist

    from hybrid import auto_wrap
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out = {}
    for name, strategy in (("llama", "fsdp"), ("llama", "ddp"), ("gemma3", "fsdp")):
        w = auto_wrap(MODELS[name](), optimizer=adamw, strategy=strategy, precision="fp32", micro_batch=2 // world,
                      seq_len=SEQ, verbose=False)
        lora = w.plan.spec.lora
        assert lora is not None and lora.rank == 4 and set(lora.targets) == {"q_proj", "v_proj", "down_proj"}
        losses = []
        for ids in batches():
            local = ids[rank * (2 // world):(rank + 1) * (2 // world)]
            loss = w(local, labels=local).loss
            w.backward(loss)
            w.step()
            w.zero_grad()
            g = loss.detach().clone()
            dist.all_reduce(g)
            losses.append(g.item() / world)
        out[(name, strategy)] = losses
    return out


@pytest.mark.gloo
def test_auto_wrap_trains_a_peft_model_as_one_process_does():
    """A PEFT Llama (closed form) under fsdp and ddp, and a PEFT Gemma 3 (its anatomy read from the
    module: planned with lora_read_delta) under fsdp."""
    refs = {name: reference(name) for name in MODELS}
    got = run_ranks(2, wrapped_losses)[0]
    for (name, strategy), losses in got.items():
        assert losses == pytest.approx(refs[name], abs=1e-5), (name, strategy)
    assert all(ref[-1] < ref[0] for ref in refs.values())


@pytest.mark.torch
def test_a_bitsandbytes_base_is_refused_on_cpu_in_one_line():
    bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed: pip install 'hybrid[lora]'")
    if torch.cuda.is_available():
        pytest.skip("the refusal is for CPU ranks")
    from hybrid.errors import HybridError
    from hybrid.runtime.parallelize import check_quantized_base
    model = torch.nn.Sequential(bnb.nn.Linear4bit(64, 64, quant_type="nf4"), torch.nn.Linear(64, 8))
    with pytest.raises(HybridError, match=r"bitsandbytes-quantised \(nf4\), which trains on CUDA only; plan it "
                                          "anywhere with `hybrid plan MODEL --lora-rank R --quantize-base nf4`"):
        check_quantized_base(model, None)


@pytest.mark.torch
def test_frozen_parameters_are_held_in_the_compute_dtype_under_mixed_precision():
    """What the estimate counts (TrainSpec.frozen_bytes): no fp32 master for what nothing updates."""
    from hybrid.config.spec import TrainSpec
    from hybrid.runtime.parallelize import frozen_to_compute_dtype
    layer = torch.nn.Linear(8, 8)
    layer.weight.requires_grad_(False)
    frozen_to_compute_dtype(layer, TrainSpec(precision="fp32"))
    assert layer.weight.dtype == torch.float32
    frozen_to_compute_dtype(layer, TrainSpec(precision="bf16-mixed"))
    assert layer.weight.dtype == torch.bfloat16 and layer.bias.dtype == torch.float32
    assert TrainSpec(precision="bf16-mixed").frozen_bytes == 2 and TrainSpec(precision="fp32").frozen_bytes == 4
