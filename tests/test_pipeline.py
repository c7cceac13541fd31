"""Pipeline parallelism as the outer dimension: stages on CPU ranks equal one process (fp32)."""
import pytest
import torch

from hybrid.launch import run_ranks
from hybrid.models import build_decoder
from tests.test_backends import TINY

pytestmark = pytest.mark.gloo

MB, SEQ, GA, STEPS, CLIP = 1, 16, 4, 3, 0.05


def adamw(ps):
    return torch.optim.AdamW(ps, lr=3e-3)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)


def batches(dp, steps=STEPS, seed=7):
    """Global batches: dp x GA x MB sequences per step (dp rank r reads rows r*GA*MB...)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (dp * GA * MB, SEQ), generator=g) for _ in range(steps)]


def tiny():
    return build_decoder(TINY, seed=0)


def hf_llama():
    from hybrid.models import build_hf
    torch.manual_seed(0)
    return build_hf(TINY, device="cpu")


MODELS = {"tiny": tiny, "hf": hf_llama}


def reference(model_name, dp):
    """One process: each step the global batch's dp x GA micro-batches, mean loss, clip, step."""
    model = MODELS[model_name]()
    opt = adamw(model.parameters())
    sched = warmup(opt)
    losses = []
    for ids in batches(dp):
        chunks = ids.chunk(dp * GA)
        step_loss = 0.0
        for mb in chunks:
            loss = model(input_ids=mb, labels=mb).loss / len(chunks)
            loss.backward()
            step_loss += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        opt.zero_grad()
        losses.append(step_loss)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def train_pp(runs):
    """runs: [(model, strategy, pp, schedule)] on this world; every rank's final full state."""
    import torch.distributed as dist

    from hybrid import auto_wrap
    out = {}
    for model_name, strategy, pp, schedule in runs:
        w = auto_wrap(MODELS[model_name](), optimizer=adamw, scheduler=warmup, strategy=strategy, pp=pp,
                      schedule=schedule, gradient_accumulation=GA, max_grad_norm=CLIP, precision="fp32",
                      micro_batch=MB, seq_len=SEQ, verbose=False)
        dp, rank = w.dp_size, w.dp_rank
        losses = []
        for ids in batches(dp):
            losses.append(w.train_step(ids[rank * GA * MB:(rank + 1) * GA * MB]))
        out[f"{model_name}/{strategy}/pp{pp}/{schedule}"] = {"state": w.state_dict(), "losses": losses,
                                                            "dp": dp, "world": dist.get_world_size()}
    return out


def check(results, runs, dp):
    for model_name, *_ in runs:
        ref, ref_losses = reference(model_name, dp)
        for r in results:
            for key, res in r.items():
                if not key.startswith(model_name + "/"):
                    continue
                diff = max((res["state"][k] - ref[k]).abs().max().item() for k in ref)
                assert diff < 1e-5, (key, diff)
                assert max(abs(a - b) for a, b in zip(res["losses"], ref_losses)) < 1e-5, (key, res["losses"])


def test_pp2_on_two_ranks_gpipe_and_1f1b_tied_model_and_transformers_llama():
    runs = [("tiny", "fsdp", 2, "1f1b"), ("tiny", "ddp", 2, "gpipe"), ("hf", "fsdp", 2, "gpipe"),
            ("hf", "ddp", 2, "1f1b")]
    res = run_ranks(2, train_pp, runs)
    check(res, runs, 1)


def test_pp2_by_dp2_on_four_ranks():
    runs = [("tiny", "fsdp", 2, "1f1b"), ("tiny", "ddp", 2, "gpipe"), ("hf", "fsdp", 2, "1f1b")]
    res = run_ranks(4, train_pp, runs, local_world=4)
    check(res, runs, 2)
