"""torch.compile as torchtitan applies it (hybrid/runtime/compile.py), and what a compiled block keeps."""
import pytest
import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.presets import DecoderConfig

SMALL = DecoderConfig("llama", 256, 64, 2, 4, 176, 64, kv_heads=2, tied=True)
SEQ, STEPS = 16, 3


def _losses(strategy: str, compile: bool) -> list[float]:
    """Three optimizer steps of the loop on this rank's share of fixed global batches."""
    import torch.distributed as dist

    from hybrid import auto_wrap
    from hybrid.model.decoder import build_decoder
    w = auto_wrap(build_decoder(SMALL, seed=0), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                  strategy=strategy, precision="fp32", micro_batch=1, seq_len=SEQ, gradient_accumulation=2,
                  activation_checkpointing="selective", compile=compile, verbose=False)
    g = torch.Generator().manual_seed(3)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, SMALL.vocab, (2 * dist.get_world_size(), SEQ), generator=g)
        out.append(w.train_step(ids[2 * w.dp_rank:2 * w.dp_rank + 2]))
    return out


GEMMA = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, sliding_window=8, layer_types=["sliding_attention", "full_attention"],
             max_position_embeddings=256, pad_token_id=0, eos_token_id=1, bos_token_id=1)
"""A tiny transformers Gemma 3: a sliding layer whose window the sequence outgrows (SDPA gets a mask), a
global one."""


def _gemma():
    from transformers import AutoConfig, AutoModelForCausalLM
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model("gemma3_text", **GEMMA), attn_implementation="sdpa")


def _gemma_batches(world: int):
    g = torch.Generator().manual_seed(5)
    return [torch.randint(2, GEMMA["vocab_size"], (world, SEQ), generator=g) for _ in range(STEPS)]


def _gemma_adamw(ps):
    return torch.optim.AdamW(ps, lr=1e-3)


def _gemma_compiled():
    """Gemma 3 under fsdp with its blocks compiled (inductor), fp32, one sequence a rank a step:
    the state after three AdamW steps and whether the plan knew its activations."""
    import torch.distributed as dist
    from torch._dynamo.utils import counters

    from hybrid import auto_wrap
    before = counters["stats"]["unique_graphs"]
    w = auto_wrap(_gemma(), optimizer=_gemma_adamw, strategy="fsdp", precision="fp32", micro_batch=1, seq_len=SEQ,
                  compile=True, verbose=False)
    for ids in _gemma_batches(dist.get_world_size()):
        w.train_step(ids[w.dp_rank:w.dp_rank + 1])
    return {"state": w.state_dict(), "activations": w.plan.chosen.memory.activations,
            "graphs": counters["stats"]["unique_graphs"] - before}


def _gemma_reference() -> dict:
    """One process, eager, the whole global batch per step."""
    model = _gemma()
    opt = _gemma_adamw(model.parameters())
    for ids in _gemma_batches(2):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


def _eager_and_compiled():
    from hybrid.runtime.mesh import shutdown
    from torch._dynamo.utils import counters
    try:
        out = {(s, c): _losses(s, c) for s in ("ddp", "fsdp") for c in (False, True)}
        out["graphs"] = counters["stats"]["unique_graphs"]          # what dynamo compiled
        out["gemma"] = _gemma_compiled()
        return out
    finally:
        shutdown()


@pytest.mark.gloo
def test_compiled_blocks_train_as_eager_on_two_ranks_under_ddp_and_fsdp():
    """Per-block torch.compile (inductor's C++ backend on CPU ranks) after selective
    checkpointing, under DDP and FSDP2: the same losses as eager within 1e-4 (fp32). In the same
    launch a tiny transformers Gemma 3 (a masked sliding layer and a global one), planned with its
    activations known and compiled under FSDP2, ends three AdamW steps where one eager process ends
    on the same global batch (fp32, 1e-5)."""
    results = run_ranks(2, _eager_and_compiled, timeout_s=900)
    losses = [{k: v for k, v in res.items() if k != "gemma"} for res in results]
    assert losses[0] == losses[1]
    r = results[0]
    for strategy in ("ddp", "fsdp"):
        assert r[(strategy, True)] == pytest.approx(r[(strategy, False)], abs=1e-4)
    assert r[("ddp", False)] == pytest.approx(r[("fsdp", False)], abs=1e-4)
    assert r["graphs"] >= 2                     # the blocks and the loss were compiled, not run eagerly
    ref = _gemma_reference()
    for rank, res in enumerate(results):
        gemma = res["gemma"]
        assert gemma["activations"] is not None and gemma["graphs"] >= 2      # its sliding and global blocks
        diff = max((gemma["state"][k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, f"gemma 3 compiled, rank {rank}: max abs diff {diff:.2e}"


CONFIGS = {"llama": DecoderConfig("llama", 300, 64, 2, 4, 176, 128, kv_heads=2),
           "llama-wide": DecoderConfig("llama", 300, 128, 2, 8, 448, 128, kv_heads=2),
           "gpt2": DecoderConfig("gpt2", 300, 96, 2, 4, 384, 128)}


@pytest.mark.torch
@pytest.mark.parametrize("mode", ["none", "selective", "full", "op"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_compiled_block_formula_is_what_the_partitioner_saves(name, mode):
    """AOTAutograd's partitioner, traced on the block: the saved bytes per token equal the
    analytic formula (bf16, and fp32 for the llama block)."""
    from hybrid.estimation.memory.activations import _layer_compiled
    from hybrid.measure.compiled import per_token
    from hybrid.config.spec import TrainSpec
    cfg = CONFIGS[name]
    if mode == "op" and name == "gpt2":
        pytest.skip("torchtitan's per-op policy keeps aten.mm outputs; gpt2's biased linears run addmm")
    for dtype, precision in ((torch.bfloat16, "bf16"), (torch.float32, "fp32"))[:2 if name == "llama" else 1]:
        spec = TrainSpec(1, 16, precision=precision, activation_checkpointing=mode, compile=True)
        assert per_token(cfg, dtype, mode) == _layer_compiled(cfg, spec, spec.bytes.compute, mode)


def _live_after_forward(model, b: int, seq: int, dtype) -> int:
    """Bytes the blocks keep after their forward (their inputs included, the last output not),
    counted at the CPU allocator."""
    from hybrid.measure.tracker import allocator_net_bytes
    rope = model._rope(seq, dtype, "cpu")
    x = torch.randn(b, seq, model.config.hidden, dtype=dtype, requires_grad=True)

    def forward():
        y = x
        for block in model.blocks:
            y = block(y, rope, None)
        return y
    y, net = allocator_net_bytes(forward)
    return net - y.untyped_storage().nbytes() + x.untyped_storage().nbytes()


@pytest.mark.gloo            # real inductor compiles on this CPU (tens of seconds each)
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
def test_a_compiled_block_keeps_what_the_estimate_says(mode):
    """Blocks compiled by inductor on CPU (fp32), checkpointed as the backends do: what they
    keep after forward, between batch 3 and batch 1, is the estimate within 2%."""
    from hybrid.runtime.activation_checkpoint import apply_activation_checkpointing
    from hybrid.estimation.memory.activations import activation_terms
    from hybrid.model.decoder import build_decoder
    from hybrid.config.spec import TrainSpec
    cfg, seq = CONFIGS["llama"], 48
    model = build_decoder(cfg, device="cpu", dtype=torch.float32)
    apply_activation_checkpointing(model, mode)
    for block in model.blocks:
        block.compile(fullgraph=True, dynamic=False)
    for b in (1, 3):                             # compile both shapes before counting
        _live_after_forward(model, b, seq, torch.float32)
    measured = (_live_after_forward(model, 3, seq, torch.float32)
                - _live_after_forward(model, 1, seq, torch.float32))
    spec = TrainSpec(2, seq, precision="fp32", activation_checkpointing=mode, compile=True)
    terms = activation_terms(cfg, spec, autocast=False)
    assert measured == pytest.approx(terms.per_layer * terms.layers, rel=0.02)
    eager = activation_terms(cfg, TrainSpec(2, seq, precision="fp32", activation_checkpointing=mode), autocast=False)
    if mode != "full":
        assert terms.per_layer < eager.per_layer          # the partitioner keeps less than eager autograd


def _float8_block(emulate: bool):
    pytest.importorskip("torchao", reason="torchao is an optional extra (pip install 'hybrid[float8]')")
    from hybrid.runtime.float8 import apply_float8
    from hybrid.model.decoder import build_decoder
    from hybrid.config.spec import TrainSpec
    cfg = DecoderConfig("llama", 256, 64, 2, 4, 192, 64, kv_heads=2)
    model = build_decoder(cfg, seed=0)
    n = apply_float8(model, TrainSpec(1, 16, compile=True, float8=True), fsdp=False, emulate=emulate)
    return model, n


@pytest.mark.torch
def test_float8_converts_the_block_linears_and_keeps_the_head():
    """torchao's conversion as torchtitan applies it: every block linear (7 per llama block),
    not the head; an emulated step on CPU stays near the bf16 one."""
    model, n = _float8_block(emulate=True)
    assert n == 7 * 2
    assert type(model.lm_head).__name__ == "Linear"
    assert all(type(m).__name__ == "Float8Linear" for m in (model.blocks[0].attn.q_proj, model.blocks[1].mlp.down_proj))
    from hybrid.model.decoder import build_decoder
    ref = build_decoder(model.config, seed=0)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    out, want = model(ids, labels=ids).loss, ref(ids, labels=ids).loss
    out.backward()
    assert out.item() == pytest.approx(want.item(), rel=0.02)
    assert model.blocks[0].attn.q_proj.weight.grad is not None


@pytest.mark.gpu
def test_float8_trains_compiled_on_a_float8_gpu():
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("needs float8 tensor cores (sm_89+)")
    from hybrid import auto_wrap
    from hybrid.runtime.mesh import shutdown
    from hybrid.model.decoder import build_decoder
    cfg = DecoderConfig("llama", 256, 256, 2, 4, 512, 64, kv_heads=2)
    try:
        w = auto_wrap(build_decoder(cfg, seed=0), strategy="fsdp", precision="bf16-mixed", seq_len=64,
                      compile=True, float8=True, verbose=False)
        ids = torch.randint(0, 256, (1, 64), device="cuda")
        losses = [w.train_step(ids) for _ in range(3)]
        assert all(x == x for x in losses) and losses[-1] < losses[0]
    finally:
        shutdown()
