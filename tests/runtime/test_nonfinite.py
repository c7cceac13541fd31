"""Non-finite steps are skipped on every rank, and saves happen only at consistent, finite points."""
import os

import pytest
import torch

from hybrid.errors import HybridError
from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY

pytestmark = pytest.mark.gloo

SEQ = 16


def adamw(ps):
    return torch.optim.AdamW(ps, lr=3e-3)


def warmup(opt):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / 4)


def _wrap(strategy, **kw):
    from hybrid import auto_wrap
    return auto_wrap(build_decoder(TINY, seed=0), optimizer=adamw, scheduler=warmup, strategy=strategy,
                     precision="fp32", micro_batch=1, seq_len=SEQ, verbose=False, **kw)


def _ids(step, rank):
    return torch.randint(0, 512, (1, SEQ), generator=torch.Generator().manual_seed(100 * step + rank))


def _one_step(w, step, nan_rank=None):
    """One optimizer step; the loss is NaN on `nan_rank`."""
    ids = _ids(step, w.dp_rank)
    loss = w(ids, labels=ids).loss
    if w.dp_rank == nan_rank:
        loss = loss * float("nan")
    w.backward(loss)
    w.step()
    w.zero_grad()


def _snapshot(w):
    state = {k: v.clone() for k, v in w.state_dict().items()}
    optim = [v.detach().clone() for st in w.optimizer.state.values() for v in st.values()
             if isinstance(v, torch.Tensor)]
    optim = [getattr(v, "_local_tensor", v) for v in optim]
    return state, optim


def nan_steps(strategy):
    """good, NaN on rank 1, good, then NaN three times in a row (the third stops training)."""
    w = _wrap(strategy)
    _one_step(w, 0)
    state, optim = _snapshot(w)
    lr = w.scheduler.get_last_lr()
    _one_step(w, 1, nan_rank=1)
    grads = [p.grad for p in w.module.parameters()]
    after, optim_after = _snapshot(w)
    out = {"lr_kept": w.scheduler.get_last_lr() == lr, "skipped": w.skipped_steps, "steps": w.optimizer_steps,
           "grads_none": all(g is None for g in grads),
           "same": all(torch.equal(state[k], after[k]) for k in state),
           "optim_same": all(torch.equal(a, b) for a, b in zip(optim, optim_after)),
           "finite": all(torch.isfinite(v).all() for v in after.values())}
    _one_step(w, 2)
    out["trained"] = not all(torch.equal(state[k], v) for k, v in w.state_dict().items())
    stops = []
    for s in range(3, 6):
        try:
            _one_step(w, s, nan_rank=1)
        except HybridError as e:
            stops.append((s, str(e)))
    out["stops"] = stops
    out["skipped_end"] = w.skipped_steps
    out["state"] = w.state_dict()
    return out


@pytest.mark.parametrize("strategy, world", [("ddp", 2), ("fsdp", 2), ("hsdp", 4)])
def test_a_nan_loss_on_one_rank_skips_the_step_on_every_rank(strategy, world):
    results = run_ranks(world, nan_steps, strategy, local_world=2)
    for r in results:
        assert r["skipped"] == 1 and r["steps"] == 2, r
        assert r["same"] and r["optim_same"] and r["finite"] and r["lr_kept"] and r["grads_none"], r
        assert r["trained"]                                  # the next good step trains
        assert [s for s, _ in r["stops"]] == [5], r["stops"]  # the third NaN step in a row stops
        assert "3 optimizer steps in a row had a non-finite loss" in r["stops"][0][1]
        assert "\n" not in r["stops"][0][1] and r["skipped_end"] == 4
    a = results[0]["state"]
    for b in (r["state"] for r in results[1:]):
        assert all(torch.equal(a[k], b[k]) and torch.isfinite(a[k]).all() for k in a)


def pipeline_nan(n_bad):
    """pp 2: the last stage's loss_fn returns NaN for `n_bad` steps after a good one."""
    from hybrid import auto_wrap
    from hybrid.model.decoder import causal_lm_loss
    w = auto_wrap(build_decoder(TINY, seed=0), optimizer=adamw, strategy="ddp", pp=2, precision="fp32",
                  micro_batch=1, seq_len=SEQ, gradient_accumulation=2, verbose=False, max_bad_steps=2)
    bad = {"on": False}

    def loss_fn(logits, labels):
        loss = causal_lm_loss(logits, labels)
        return loss * float("nan") if bad["on"] else loss
    ids = torch.randint(0, 512, (2, SEQ), generator=torch.Generator().manual_seed(1))
    w.train_step(ids, loss_fn=loss_fn)
    before = {k: v.clone() for k, v in w.state_dict().items()}
    bad["on"] = True
    error = None
    for _ in range(n_bad):
        try:
            w.train_step(ids, loss_fn=loss_fn)
        except HybridError as e:
            error = str(e)
    after = w.state_dict()
    return {"same": all(torch.equal(before[k], after[k]) for k in before), "skipped": w.skipped_steps,
            "error": error}


def test_a_nan_loss_under_a_pipeline_skips_the_step_on_both_stages():
    for r in run_ranks(2, pipeline_nan, 2):
        assert r["same"] and r["skipped"] == 2, r
        assert r["error"] and "max_bad_steps=2" in r["error"], r


def deepspeed_nan(strategy):
    w = _wrap(strategy)
    _one_step(w, 0)
    before = {k: v.clone() for k, v in w.state_dict().items()}
    try:
        _one_step(w, 1, nan_rank=1)
    except HybridError as e:
        error = str(e)
    else:
        error = None
    return error, all(torch.equal(before[k], v) for k, v in w.state_dict().items())


@pytest.mark.parametrize("strategy", ["zero1", "zero2", "zero3"])
def test_deepspeed_refuses_a_nan_step_on_every_rank_in_one_line(strategy):
    for error, same in run_ranks(2, deepspeed_nan, strategy):
        assert error and "DeepSpeed ZeRO cannot skip a step" in error and "\n" not in error
        assert same


# --- saves at consistent, finite points only -------------------------------------------------
def mid_window_saves(path):
    w = _wrap("ddp", gradient_accumulation=2)
    ids = _ids(0, w.dp_rank)
    errors = []
    for k in range(2):
        loss = w(ids, labels=ids).loss
        w.backward(loss)
        try:
            w.save(path)                        # after backward, before step: micro-batch 1, then 2
        except HybridError as e:
            errors.append(str(e))
        w.step()
        if k == 0:
            try:
                w.save(path)                    # between the window's micro-batches
            except HybridError as e:
                errors.append(str(e))
        w.zero_grad()
    w.save(path)                                # at the boundary
    return errors, os.path.exists(os.path.join(path, "meta.json"))


def test_a_save_after_backward_and_before_step_is_refused(tmp_path):
    errors, saved = run_ranks(2, mid_window_saves, str(tmp_path / "ck"))[0]
    assert len(errors) == 3 and saved, errors
    assert "micro-batch 1 of 2, after backward() and before step()" in errors[0]
    assert "micro-batch 2 of 2" in errors[1] and "micro-batch 2 of 2, after backward()" in errors[2]
    assert all("\n" not in e for e in errors)


def nonfinite_save(strategy, path):
    import json
    w = _wrap(strategy)
    _one_step(w, 0)
    w.save(path)
    with open(os.path.join(path, "meta.json")) as f:
        good = json.load(f)["data"]
    if w.dp_rank == 1:
        with torch.no_grad():
            p = next(iter(w.module.parameters()))
            getattr(p, "_local_tensor", p).view(-1)[0] = float("nan")
    try:
        w.save(path)
    except HybridError as e:
        error = str(e)
    else:
        error = None
    with open(os.path.join(path, "meta.json")) as f:
        kept = json.load(f)["data"]
    fresh = _wrap(strategy)
    fresh.load(path)
    finite = all(torch.isfinite(v).all() for v in fresh.state_dict().values())
    return error, kept == good and os.path.isdir(os.path.join(path, good)), finite


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_save_of_non_finite_weights_is_refused_and_keeps_the_good_version(tmp_path, strategy):
    for error, kept, finite in run_ranks(2, nonfinite_save, strategy, str(tmp_path / "ck")):
        assert error and "non-finite values" in error and "\n" not in error
        assert kept and finite
