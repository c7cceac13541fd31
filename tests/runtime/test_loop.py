"""The loop users write: accumulation, clipping, schedulers, fp16 loss scaling, frozen parameters.

Every strategy must end where one process ends on the same global batch (fp32, 1e-5).
"""
import functools
import math
import os

import pytest
import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY

pytestmark = pytest.mark.gloo

MB, SEQ, GA, STEPS, CLIP = 1, 16, 3, 3, 0.05


def adamw(ps):
    return torch.optim.AdamW(ps, lr=3e-3)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)


def global_batches(world, steps=STEPS, ga=GA, seed=7):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 512, (ga * world * MB, SEQ), generator=g) for _ in range(steps)]


def micro(ids, world, rank, k):
    """Rank `rank`'s k-th micro-batch of a global batch."""
    start = (k * world + rank) * MB
    return ids[start:start + MB]


@functools.cache    # pure (seeded model and batches, one CPU process), and check() and its callers only read it
def reference(world, steps=STEPS, model_fn=None, frozen=None):
    """One process, the whole global batch per optimizer step, torch's own clipping and scheduler."""
    model = (model_fn or (lambda: build_decoder(TINY, seed=0)))()
    if frozen:
        frozen(model)
    opt = adamw([p for p in model.parameters() if p.requires_grad])
    sched = warmup(opt)
    norms = []
    for ids in global_batches(world, steps):
        model(ids, labels=ids).loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], CLIP).item())
        opt.step()
        sched.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, norms, sched.get_last_lr()


def train(strategy, steps=STEPS, frozen=None, tp=None, model_fn=None, **wrap):
    """The loop as users write it; tensor- and context-parallel ranks of one group read the same
    micro-batch (the data is sharded by w.dp_rank / w.dp_size); `wrap`: more auto_wrap arguments."""
    from hybrid import auto_wrap
    model = (model_fn or (lambda: build_decoder(TINY, seed=0)))()
    if frozen:
        frozen(model)
    w = auto_wrap(model, optimizer=adamw, scheduler=warmup, gradient_accumulation=GA, max_grad_norm=CLIP,
                  strategy=strategy, precision="fp32", micro_batch=MB, seq_len=SEQ, verbose=False, tp=tp, **wrap)
    rank, world = w.dp_rank, w.dp_size
    norms, syncs = [], []
    for ids in global_batches(world, steps):
        for k in range(GA):
            local = micro(ids, world, rank, k)
            loss = w(local, labels=local).loss
            w.backward(loss)
            syncs.append(w.sync_gradients)
            w.step()
            w.zero_grad()
        norms.append(w.grad_norm)
    return {"state": w.state_dict(), "norms": norms, "syncs": syncs, "steps": w.optimizer_steps,
            "lr": w.scheduler.get_last_lr()}


def train_many(strategies):
    return {s: train(s) for s in strategies}


def check(results, world, strategies, model_fn=None, atol=1e-5):
    ref, ref_norms, ref_lr = reference(world, model_fn=model_fn)
    assert ref_norms[0] > CLIP                     # clipping really acts
    for s in strategies:
        for rank, res in enumerate(results):
            r = res[s]
            assert r["steps"] == STEPS and r["syncs"] == [False, False, True] * STEPS, s
            diff = max((r["state"][k] - ref[k]).abs().max().item() for k in ref)
            assert diff < atol, f"{s} rank {rank}: max abs diff {diff:.2e}"
            for a, b in zip(r["norms"], ref_norms):
                assert abs(a - b) <= 1e-5 * b, f"{s}: grad norm {a} vs {b}"
            assert r["lr"] == pytest.approx(ref_lr), s


def test_accumulation_clipping_scheduler_two_ranks():
    strategies = ("ddp", "fsdp", "zero1", "zero2", "zero3")
    check(run_ranks(2, train_many, strategies), 2, strategies)


def test_accumulation_clipping_scheduler_four_ranks_hsdp():
    strategies = ("hsdp", "fsdp", "ddp", "zero3")
    check(run_ranks(4, train_many, strategies, local_world=2), 4, strategies)


# --- no gradient reduction inside a window ----------------------------------------------------
def count_collectives(strategy):
    """Collectives issued during the backward of each micro-batch of one window."""
    from torch.profiler import ProfilerActivity, profile

    from hybrid import auto_wrap
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    w = auto_wrap(build_decoder(TINY, seed=0), optimizer=adamw, gradient_accumulation=GA, strategy=strategy,
                  precision="fp32", micro_batch=MB, seq_len=SEQ, verbose=False)
    ids = global_batches(world, 1)[0]
    counts = []
    for k in range(GA):
        local = micro(ids, world, rank, k)
        loss = w(local, labels=local).loss
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            w.backward(loss)
        names = [e.name for e in prof.events()]
        counts.append(sum(1 for n in names if "allreduce" in n.replace("_", "").lower()
                          or "reduce_scatter" in n.lower() or "reducescatter" in n.replace("_", "").lower()))
        w.step()
        w.zero_grad()
    return counts


def count_each(strategies):
    """count_collectives for each strategy in one launch (docs/development.md, "One launch, several checks")."""
    return {s: count_collectives(s) for s in strategies}


def test_no_gradient_reduction_inside_a_window():
    strategies = ("ddp", "fsdp", "zero1")
    launched = run_ranks(2, count_each, strategies)[0]
    for strategy in strategies:
        counts = launched[strategy]
        assert counts[:-1] == [0] * (GA - 1), (strategy, counts)
        assert counts[-1] > 0, (strategy, counts)          # the counter sees the window's reduction


# --- frozen (LoRA-style) parameters, checkpoints with scheduler state ---------------------------
def freeze_most(model):
    """Only the attention output projections and the final norm train (as LoRA adapters would)."""
    for name, p in model.named_parameters():
        p.requires_grad = ".attn.o_proj." in name or name.startswith("norm.")


def lora_save_then_continue(strategy, path):
    from hybrid import auto_wrap
    world = int(os.environ["WORLD_SIZE"])
    model = build_decoder(TINY, seed=0)
    freeze_most(model)
    w = auto_wrap(model, optimizer=adamw, scheduler=warmup, gradient_accumulation=2, max_grad_norm=CLIP,
                  strategy=strategy, precision="fp32", micro_batch=2 // world, seq_len=SEQ, verbose=False)
    losses = _lora_steps(w, 0, 2)
    w.save(path)
    return losses + _lora_steps(w, 2, 5), w.scheduler.get_last_lr(), w.state_dict()


def _lora_steps(w, start, stop):
    import torch.distributed as dist
    rank, world = dist.get_rank(), dist.get_world_size()
    mb, out = 2 // world, []
    for ids in global_batches(1, 5, ga=2 * 2, seed=3)[start:stop]:
        total = 0.0
        for k in range(2):
            chunk = ids[k * 2:(k + 1) * 2]
            local = chunk[rank * mb:(rank + 1) * mb]
            loss = w(local, labels=local).loss
            w.backward(loss)
            w.step()
            w.zero_grad()
            g = loss.detach().clone()
            if world > 1:
                dist.all_reduce(g)
            total += g.item() / world / 2
        out.append(total)
    return out


def lora_resume(strategy, path):
    from hybrid import auto_wrap
    world = int(os.environ["WORLD_SIZE"])
    model = build_decoder(TINY, seed=5)          # other weights: everything must come from disk
    freeze_most(model)
    w = auto_wrap(model, optimizer=adamw, scheduler=warmup, gradient_accumulation=2, max_grad_norm=CLIP,
                  strategy=strategy, precision="fp32", micro_batch=2 // world, seq_len=SEQ, verbose=False)
    w.load(path)
    assert w.optimizer_steps == 2
    return _lora_steps(w, 2, 5), w.scheduler.get_last_lr()


def lora_zero3_then_fsdp(path):
    full = lora_save_then_continue("zero3", path)
    return full, lora_resume("fsdp", path)


def test_lora_style_model_saves_under_zero3_and_resumes_under_fsdp_and_ddp(tmp_path):
    path = str(tmp_path / "lora")
    (losses, lr, state), (fsdp_losses, fsdp_lr) = run_ranks(2, lora_zero3_then_fsdp, path)[0]
    ddp_losses, ddp_lr = run_ranks(1, lora_resume, "ddp", path)[0]
    for got in (fsdp_losses, ddp_losses):
        assert max(abs(a - b) for a, b in zip(got, losses[2:])) < 1e-5
    assert fsdp_lr == pytest.approx(lr) and ddp_lr == pytest.approx(lr)
    frozen_ref = build_decoder(TINY, seed=0).state_dict()
    assert torch.equal(state["embed.weight"], frozen_ref["embed.weight"])     # frozen stayed frozen


# --- fp16-mixed: dynamic loss scaling ------------------------------------------------------------
FP16_STEPS, OVERFLOW_AT = 4, 1


def sgd(ps):
    return torch.optim.SGD(ps, lr=0.1)


def fp16_reference(world, pure_fp16: bool):
    """One process with torch's GradScaler; compute as the backend does it: autocast (DDP) or
    fp16 copies of the weights (FSDP2's MixedPrecisionPolicy(param_dtype=float16))."""
    model = build_decoder(TINY, seed=0)
    opt = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cpu")
    skipped = 0
    for step, ids in enumerate(global_batches(world, FP16_STEPS, ga=1)):
        if pure_fp16:
            params = {n: p.half() for n, p in model.named_parameters()}
            loss = torch.func.functional_call(model, params, (ids,), {"labels": ids}).loss
        else:
            with torch.autocast("cpu", dtype=torch.float16):
                loss = model(ids, labels=ids).loss
        if step == OVERFLOW_AT:
            loss = loss * 1e30
        before = scaler.get_scale()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        skipped += scaler.get_scale() < before
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, skipped


def train_fp16(strategy):
    from hybrid import auto_wrap
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    w = auto_wrap(build_decoder(TINY, seed=0), optimizer=sgd, strategy=strategy, precision="fp16-mixed",
                  micro_batch=MB, seq_len=SEQ, verbose=False)
    for step, ids in enumerate(global_batches(world, FP16_STEPS, ga=1)):
        local = micro(ids, world, rank, 0)
        loss = w(local, labels=local).loss
        if step == OVERFLOW_AT and rank == world - 1:      # one rank overflows: all must skip
            loss = loss * 1e30
        w.backward(loss)
        w.step()
        w.zero_grad()
    return {"state": w.state_dict(), "skipped": w.skipped_steps, "scale": w.engine.scaler.get_scale()}


def test_fp16_mixed_matches_a_single_process_grad_scaler():
    res = run_ranks(2, lambda_free_fp16, ("ddp", "fsdp"))
    for strategy, pure in (("ddp", False), ("fsdp", True)):
        ref, ref_skipped = fp16_reference(2, pure)
        assert ref_skipped == 1
        for rank in range(2):
            r = res[rank][strategy]
            assert r["skipped"] == 1 and r["scale"] == 2.0**15, (strategy, rank, r["skipped"], r["scale"])
            diff = max((r["state"][k] - ref[k]).abs().max().item() for k in ref)
            assert diff < 1e-4, f"{strategy} rank {rank}: {diff:.2e}"


def lambda_free_fp16(strategies):
    return {s: train_fp16(s) for s in strategies}


def fp16_zero(_):
    from hybrid import auto_wrap
    from hybrid.errors import HybridError
    try:
        auto_wrap(build_decoder(TINY, seed=0), strategy="zero2", precision="fp16-mixed", micro_batch=MB,
                  seq_len=SEQ, verbose=False)
    except HybridError as e:
        return str(e)
    return None


def test_fp16_on_deepspeed_cpu_is_a_clear_not_applicable():
    msg = run_ranks(1, fp16_zero, None)[0]
    assert msg and "needs CUDA" in msg and "ddp or fsdp" in msg


# --- manual clipping ----------------------------------------------------------------------------
def manual_clip(strategy):
    from hybrid import auto_wrap
    from hybrid.errors import HybridError
    w = auto_wrap(build_decoder(TINY, seed=0), optimizer=adamw, strategy=strategy, precision="fp32",
                  micro_batch=MB, seq_len=SEQ, verbose=False)
    ids = global_batches(1, 1, ga=1)[0]
    loss = w(ids, labels=ids).loss
    w.backward(loss)
    try:
        norm = w.clip_grad_norm_(CLIP)
    except HybridError as e:
        return str(e)
    w.step()
    return norm


def manual_clip_each(strategies):
    return {s: manual_clip(s) for s in strategies}


def test_manual_clip_really_clips_or_names_max_grad_norm():
    launched = run_ranks(1, manual_clip_each, ("ddp", "fsdp", "zero3"))[0]       # one launch
    for strategy in ("ddp", "fsdp"):
        got = launched[strategy]
        assert math.isclose(got, reference_norm_ga1(), rel_tol=1e-5), strategy
    msg = launched["zero3"]
    assert isinstance(msg, str) and "max_grad_norm=" in msg


@functools.cache            # pure: seeded model and batch
def reference_norm_ga1():
    model = build_decoder(TINY, seed=0)
    ids = global_batches(1, 1, ga=1)[0]
    model(ids, labels=ids).loss.backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()



# --- odd models: plain-object outputs, unused parameters, nested ModuleLists, DataParallel ----------
class PlainOutput:
    """Not a tensor, tuple, dict, dataclass or ModelOutput: just an object with .loss."""

    def __init__(self, loss, pred):
        self.loss, self.pred = loss, pred


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.fc(x))


class Odd(torch.nn.Module):
    def __init__(self, unused=False, nested=False):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 16)
        if nested:
            self.stages = torch.nn.ModuleList([torch.nn.ModuleList([Layer(), Layer()]) for _ in range(2)])
        else:
            self.stages = torch.nn.ModuleList([Layer() for _ in range(4)])
        self.head = torch.nn.Linear(16, 1)
        self.spare = torch.nn.Linear(16, 16) if unused else None

    def layers(self):
        for s in self.stages:
            yield from (s if isinstance(s, torch.nn.ModuleList) else [s])

    def forward(self, x, y):
        h = self.inp(x)
        for layer in self.layers():
            h = layer(h)
        pred = self.head(h).squeeze(-1)
        return PlainOutput(torch.nn.functional.mse_loss(pred, y), pred)


ODD = {"plain": {}, "unused": {"unused": True}, "nested": {"nested": True}}


def odd_data(world, steps=2):
    g = torch.Generator().manual_seed(11)
    return [(torch.randn(world * 2, 8, generator=g), torch.randn(world * 2, generator=g)) for _ in range(steps)]


def odd_reference(kind, world):
    model = Odd(**ODD[kind])
    opt = sgd([p for p in model.parameters()])
    for x, y in odd_data(world):
        model(x, y).loss.backward()
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def odd_train(runs):
    import torch.distributed as dist

    from hybrid import auto_wrap
    from hybrid.errors import HybridError
    out = {}
    for kind, strategy, wrap_dp, unused_flag in runs:
        model = Odd(**ODD[kind])
        if wrap_dp:
            model = torch.nn.DataParallel(model)
        try:
            w = auto_wrap(model, optimizer=sgd, strategy=strategy, precision="fp32", verbose=False,
                          find_unused_parameters=unused_flag)
            rank, world = dist.get_rank(), dist.get_world_size()
            for x, y in odd_data(world):
                out_ = w(x[rank * 2:(rank + 1) * 2], y[rank * 2:(rank + 1) * 2])
                w.backward(out_.loss)
                w.step()
                w.zero_grad()
            out[(kind, strategy, wrap_dp, unused_flag)] = w.state_dict()
        except HybridError as e:
            out[(kind, strategy, wrap_dp, unused_flag)] = str(e)
    return out


def test_odd_models_train_under_every_strategy_or_name_the_fix():
    runs = [(kind, s, False, None) for kind in ODD for s in ("ddp", "fsdp", "zero1", "zero2", "zero3")]
    runs += [("unused", "ddp", False, True), ("plain", "fsdp", True, None), ("plain", "ddp", True, None)]
    results = run_ranks(2, odd_train, runs)
    for run in runs:
        got = results[0][run]
        if run == ("unused", "ddp", False, None):
            assert isinstance(got, str) and "find_unused_parameters=True" in got, got
            continue
        assert not isinstance(got, str), (run, got)
        ref = odd_reference(run[0], 2)
        diff = max((got[k] - ref[k]).abs().max().item() for k in ref)
        assert diff < 1e-5, (run, diff)


def test_nested_module_lists_shard_each_block():
    from hybrid.model.profile import find_blocks
    cls, blocks = find_blocks(Odd(nested=True))
    assert cls == "Layer" and len(blocks) == 4
