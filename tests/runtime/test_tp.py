"""Tensor parallelism as the inner dimension: DDP, FSDP and HSDP over tp groups equal one process."""
import os

import pytest
import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY
from tests.runtime.test_loop import check, train

pytestmark = pytest.mark.gloo


def train_tp(runs, qwen3_runs=()):
    """runs: [(strategy, tp)] -> results keyed like test_loop.check expects (by strategy label);
    qwen3_runs: the same on a tiny transformers Qwen3 (keyed 'qwen3:...')."""
    out = {f"{s}+tp{t}": train(s, tp=t) for s, t in runs}
    out.update({f"qwen3:{s}+tp{t}": train(s, tp=t, model_fn=hf_qwen3) for s, t in qwen3_runs})
    return out


def hf_qwen3():
    """A tiny transformers Qwen3 (q/k norms per head, head_dim 16 beside hidden 64 / 4 heads)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=512, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                        tie_word_embeddings=False, max_position_embeddings=64))


def test_tp2_on_two_ranks_equals_one_process_ours_qwen3_gemma3_and_transformers_llama():
    """Our decoder and a transformers Qwen3 (its own base_model_tp_plan's projections, with sequence
    parallelism and the vocab-parallel loss: refused before for its q/k norms) under fsdp and ddp
    over tp 2; Gemma 3 and transformers' llama with its own tp plan: one launch."""
    from tests.runtime.test_loop import reference
    runs = TP2_RUNS
    launched = run_ranks(2, two_rank_cases, None)
    res = [r["tp"] for r in launched]
    check(res, 1, [f"{s}+tp{t}" for s, t in runs])           # one data-parallel rank: the global batch
    ref = reference(1, model_fn=hf_qwen3)[0]
    for r in res:
        for s, t in runs:
            got = r[f"qwen3:{s}+tp{t}"]["state"]
            diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
            assert diff < 1e-5, (s, diff)
    gemma3_checks([r["gemma3"] for r in launched])
    transformers_llama_checks([r["hf"] for r in launched])


TP2_RUNS = [("fsdp", 2), ("ddp", 2)]


def two_rank_cases(_):
    """The independent two-rank checks of this file in one launch (docs/development.md, "One launch,
    several checks"): ours and Qwen3 over tp 2, Gemma 3 over tp 2, transformers' llama with its plan."""
    return {"tp": train_tp(TP2_RUNS, TP2_RUNS), "gemma3": train_gemma3("fsdp", 2), "hf": train_hf(2)}


def hf_gemma3():
    """A tiny transformers Gemma 3: post-norms feeding the residual sums, (1 + weight) norms, q/k norms,
    a scaled and tied embedding, sliding layers shorter than the sequence (a mask)."""
    from transformers import Gemma3TextConfig, Gemma3ForCausalLM
    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=8,
                           max_position_embeddings=64, pad_token_id=0)
    return Gemma3ForCausalLM(cfg)


def train_gemma3(strategy, tp):
    return {"gemma3": train(strategy, tp=tp, model_fn=hf_gemma3)}


def gemma3_checks(res):
    """Gemma 3's norms after attention and the MLP return this rank's sequence shard as a plain
    tensor (the residual it is added to is one), as its pre-norms and the final norm do."""
    from tests.runtime.test_loop import reference
    ref = reference(1, model_fn=hf_gemma3)[0]
    for r in res:
        diff = max((r["gemma3"]["state"][k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, diff


DP2_TP2_RUNS = [("fsdp", 2), ("ddp", 2), ("hsdp", 2)]


def four_rank_cases(_):
    """The independent four-rank checks in one launch: dp 2 x tp 2 training, and which mesh
    dimensions the parameters' collectives run over."""
    return {"tp": train_tp(DP2_TP2_RUNS), "layout": layout_of_params(None)}


def test_dp2_by_tp2_on_four_ranks_fsdp_and_ddp_outer_and_the_collectives_dims():
    launched = run_ranks(4, four_rank_cases, None, local_world=4)
    check([r["tp"] for r in launched], 2, [f"{s}+tp{t}" for s, t in DP2_TP2_RUNS])
    collectives_checks([r["layout"] for r in launched])


def hf_llama():
    from hybrid.model.decoder import build_hf
    torch.manual_seed(0)
    return build_hf(TINY, device="cpu")


def train_hf(tp):
    return {"hf": train("fsdp", tp=tp, model_fn=hf_llama)}


def transformers_llama_checks(res):
    """transformers' llama under its own tp plan equals one process."""
    from tests.runtime.test_loop import CLIP, adamw, global_batches, warmup
    model = hf_llama()
    opt = adamw(model.parameters())
    sched = warmup(opt)
    for ids in global_batches(1):
        model(input_ids=ids, labels=ids).loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
    ref = model.state_dict()
    for r in res:
        diff = max((r["hf"]["state"][k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, diff


def layout_of_params(_):
    """Which mesh dimensions each kind of collective runs over (by the DTensor placements)."""
    import torch.distributed as dist

    from hybrid import auto_wrap
    w = auto_wrap(build_decoder(TINY, seed=0), strategy="fsdp", tp=2, precision="fp32", micro_batch=1, seq_len=16,
                  verbose=False)
    q = w.module.blocks[0].attn.q_proj.weight
    norm = w.module.blocks[0].norm1.weight
    groups = {name: dist.get_process_group_ranks(w.mesh[name].get_group()) for name in ("tp", "dp_shard")}
    from torch.distributed.tensor import Shard
    kind = lambda t: (t.device_mesh.mesh_dim_names,  # noqa: E731 (FSDP over TP shards dim 0 strided)
                      ["shard" if isinstance(p, Shard) or type(p).__name__ == "_StridedShard" else str(p)
                       for p in t.placements])
    return {"q": kind(q), "norm": kind(norm),
            "groups": groups, "dp": (w.dp_rank, w.dp_size)}


def collectives_checks(res):
    """dp collectives run over the dp dims, tp's inside the tp groups."""
    for rank, r in enumerate(res):
        # sharded over dp_shard (FSDP: all-gather / reduce-scatter there) and over tp (its matmul collectives)
        assert r["q"] == (("dp_shard", "tp"), ["shard", "shard"]), r["q"]
        assert r["norm"] == (("dp_shard", "tp"), ["shard", "R"]), r["norm"]     # replicated across tp
        assert r["groups"]["tp"] == [rank - rank % 2, rank - rank % 2 + 1]           # consecutive: one node
        assert r["groups"]["dp_shard"] == [rank % 2, rank % 2 + 2]
        assert r["dp"] == (rank // 2, 2)                                              # tp peers read one batch


# --- checkpoints across tensor-parallel layouts -----------------------------------------------------
def tp_save(path):
    w = _wrap("fsdp", 2)
    before = _steps(w, 0, 2)
    w.save(path)
    return before + _steps(w, 2, 4)


def tp_resume(strategy, tp, path):
    w = _wrap(strategy, tp, seed=7)
    w.load(path)
    return _steps(w, 2, 4)


def _wrap(strategy, tp, seed=0):
    from hybrid import auto_wrap
    return auto_wrap(build_decoder(TINY, seed=seed), optimizer=lambda ps: torch.optim.AdamW(ps, lr=3e-3),
                     strategy=strategy, tp=tp, precision="fp32", micro_batch=1, seq_len=16, verbose=False)


def _steps(w, start, stop):
    import torch.distributed as dist
    out = []
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, 512, (4, 16), generator=g) for _ in range(4)]
    per = 4 // w.dp_size
    for ids in batches[start:stop]:
        local = ids[w.dp_rank * per:(w.dp_rank + 1) * per]
        loss = w(local, labels=local).loss
        w.backward(loss)
        w.step()
        w.zero_grad()
        t = loss.detach().clone() / dist.get_world_size()      # tp peers hold the same loss
        dist.all_reduce(t)
        out.append(t.item())
    return out


def test_tp2_dp2_checkpoint_resumes_under_dp4_and_tp2_on_two_ranks(tmp_path):
    path = str(tmp_path / "tp")
    full = run_ranks(4, tp_save, path, local_world=4)[0]
    dp4 = run_ranks(4, tp_resume, "fsdp", 1, path, local_world=4)[0]
    tp2 = run_ranks(2, tp_resume, "fsdp", 2, path)[0]
    for got in (dp4, tp2):
        assert max(abs(a - b) for a, b in zip(got, full[2:])) < 1e-5, (got, full[2:])
    assert os.path.isdir(path)


def test_gqa_degree_and_fused_qkv_are_clear_errors():
    from hybrid.runtime.backends.tp import check_tensor_parallel
    from hybrid.errors import HybridError
    from hybrid.model.presets import DecoderConfig
    with pytest.raises(HybridError, match=r"tp 4 does not divide the 2 key/value heads .* valid tp: 1, 2"):
        check_tensor_parallel(build_decoder(TINY, device="meta"), 4)
    gpt = DecoderConfig("gpt2", 512, 64, 2, 4, 256, 64, tied=True)
    with pytest.raises(HybridError, match="fuses them"):
        check_tensor_parallel(build_decoder(gpt, device="meta"), 2)

