"""Elastic restarts under torchrun: a rank of 4 SIGKILLed mid-training (right after an async save
began) resumes from the last committed checkpoint with auto_wrap(resume=) and trains every step on
the samples and to the loss of an uninterrupted run (one process, the same global batch); a second
job on 2 ranks continues the same checkpoint to the same loss again; the tracked sampler carries
the sample order: no sample repeated or skipped."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.gloo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join("tests", "scripts", "elastic.py")
N = 48                  # samples: 6 optimizer steps of 8 per epoch


def _torchrun(nproc, *args, restarts=0):
    """torchrun on loopback (nproc 0: the script alone, a world of one)."""
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
              "--max-restarts", str(restarts)] if nproc else []
    cmd = [sys.executable, *launch, SCRIPT, "--samples", str(N), *args]
    # a fresh rendezvous store per restart: the shared one can hand restarted workers their dead
    # peers' addresses (pytorch/pytorch#135712)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "TORCH_CPP_LOG_LEVEL": "FATAL"}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc, timeout=240):
    out, _ = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-4000:]
    return out


def _rows(path):
    return [json.loads(line) for line in open(path)]


def test_killed_rank_resumes_to_the_same_loss_on_4_then_2_ranks_seeing_each_sample_once(tmp_path):
    ref_log, log = str(tmp_path / "ref.jsonl"), str(tmp_path / "run.jsonl")
    ckpt = str(tmp_path / "ck")
    # the reference: one uninterrupted process (the same global batch of 8 in 4 micro-batches)
    ref = _torchrun(0, "--ckpt", str(tmp_path / "ref"), "--step-log", ref_log, "--steps", "12")
    run = _torchrun(4, "--ckpt", ckpt, "--step-log", log, "--steps", "8", "--kill-at", "6", restarts=1)
    _finish(ref)
    out = _finish(run)
    assert "holds no checkpoint yet: starting fresh" in out and "resumed from" in out and "the same world" in out
    out = _finish(_torchrun(2, "--ckpt", ckpt, "--step-log", log, "--steps", "12"))
    assert "the world changed: saved on 4 ranks" in out and "re-planned for 2 ranks" in out
    want = {r["step"]: r for r in _rows(ref_log)}
    rows = _rows(log)
    assert sorted(want) == list(range(1, 13))
    first = [r for r in rows if r["attempt"] == 0 and r["world"] == 4]
    again = [r for r in rows if r["attempt"] == 1]
    on_two = [r for r in rows if r["world"] == 2]
    assert [r["step"] for r in first] == list(range(1, 7))             # killed at step 6, before step 7
    resumed_at = again[0]["step"] - 1
    assert resumed_at in (3, 6) and [r["step"] for r in again] == list(range(resumed_at + 1, 9))
    assert again[0]["resumed"] and f"data-{resumed_at:08d}-" in again[0]["resumed"]
    assert [r["step"] for r in on_two] == list(range(9, 13)) and "data-00000008-" in on_two[0]["resumed"]
    for r in rows:                      # each step trains the samples and loss of the uninterrupted run
        assert r["ids"] == want[r["step"]]["ids"], r["step"]
        assert abs(r["loss"] - want[r["step"]]["loss"]) < 1e-5, (r["step"], r["loss"], want[r["step"]]["loss"])
    final = {r["step"]: r for r in rows}        # the trajectory that counts: each step's last attempt
    assert sorted(final) == list(range(1, 13))
    for epoch in (0, 1):                # every sample once per epoch, none repeated or skipped
        seen = [i for s in range(1 + 6 * epoch, 7 + 6 * epoch) for i in final[s]["ids"]]
        assert sorted(seen) == list(range(N))
        assert all(final[s]["epoch"] == epoch for s in final if (s - 1) // 6 == epoch)


def track_cases(path):
    """w.track: its refusals, state carried by a save, loaded whether tracked before or after the
    load, and the warning when the checkpoint has none for a tracked name."""
    import logging

    from hybrid import auto_wrap
    from hybrid.errors import HybridError
    from hybrid.runtime.data import ResumableSampler
    from tests.ckpt.test_checkpoint import _steps, _wrap
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hybrid").addHandler(handler)
    w = _wrap("ddp")
    errors = []
    for bad in ((object(), "data"), (ResumableSampler(8, 1, 0), "")):
        try:
            w.track(*bad)
        except HybridError as e:
            errors.append(str(e))
    sampler = w.track(ResumableSampler(48, 1, 0, seed=1))
    try:
        w.track(ResumableSampler(48, 1, 0, seed=1))
    except HybridError as e:
        errors.append(str(e))
    _steps(w, 0, 1)
    sampler.set_epoch(2)
    sampler.advance(8)
    w.save(path)
    before = ResumableSampler(48, 1, 0, seed=1)
    w2 = _wrap("ddp", seed=3)
    w2.track(before)                        # tracked before the load
    w2.track(ResumableSampler(48, 1, 0, seed=1), name="other")
    w2.load(path)
    from tests.runtime.test_backends import TINY
    from hybrid.model.decoder import build_decoder
    w3 = auto_wrap(build_decoder(TINY, seed=0), strategy="ddp", precision="fp32", micro_batch=1, seq_len=16,
                   verbose=False, resume=path)
    after = w3.track(ResumableSampler(48, 1, 0, seed=1))      # tracked after the resume
    logging.getLogger("hybrid").removeHandler(handler)
    return errors, (before.epoch, before.position), (after.epoch, after.position), w3.step_count, lines


def test_track_carries_state_and_names_what_it_cannot(tmp_path):
    from hybrid.runtime.launch import run_ranks
    errors, before, after, step, lines = run_ranks(1, track_cases, str(tmp_path / "ck"))[0]
    assert "state_dict() and load_state_dict()" in errors[0] and "non-empty string" in errors[1]
    assert "'data' is tracked already" in errors[2]
    assert before == after == (2, 8) and step == 1
    assert any("no state for tracked 'other'" in x for x in lines)
    assert any("resumed from" in x and "optimizer step 1; the same world" in x for x in lines)
