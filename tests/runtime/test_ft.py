"""torchft replica groups (hybrid/runtime/ft.py): a group killed mid-run is dropped, the other keeps
training, the killed one restarts and heals from its peer; both end with the same parameters.

2 replica groups x 2 CPU ranks (FSDP over dp_shard = 2 inside each group), the lighthouse in this
process on 127.0.0.1.
"""
import glob
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from hybrid.runtime.launch import free_port

pytestmark = pytest.mark.gloo

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "ft_replica.py")
STEPS, KILL_AT, GROUP_RANKS, STRATEGY = 12, 3, 2, "fsdp"
WAIT_S = 150.0


def start_group(group: int, lighthouse: str, out) -> list:
    port = free_port()
    procs = []
    for rank in range(GROUP_RANKS):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(GROUP_RANKS), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(GROUP_RANKS), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "TORCHFT_LIGHTHOUSE": lighthouse, "REPLICA_GROUP_ID": str(group), "NUM_REPLICA_GROUPS": "2",
               "HYBRID_TIMEOUT": "20", "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": ROOT}
        log = open(out / f"g{group}r{rank}.{len(glob.glob(str(out / f'g{group}r{rank}.*.log')))}.log", "w")
        procs.append(subprocess.Popen([sys.executable, SCRIPT, str(out), str(STEPS), STRATEGY], cwd=ROOT, env=env,
                                      stdout=log, stderr=subprocess.STDOUT))
    return procs


def rows(out, group: int, rank: int, pid: int) -> list:
    path = out / f"g{group}r{rank}.{pid}.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]


def logs(out) -> str:
    return "\n".join(f"--- {p}\n" + open(p).read()[-3000:] for p in sorted(glob.glob(str(out / "*.log"))))


def wait_all(procs, deadline, out) -> None:
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 1))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a replica group did not finish in time\n" + logs(out))
        assert p.returncode == 0, logs(out)


def test_a_killed_replica_group_is_dropped_and_rejoins_from_its_peer(tmp_path):
    pytest.importorskip("torchft")
    from hybrid.runtime.ft import start_lighthouse
    lighthouse = start_lighthouse(min_replicas=1)
    deadline = time.monotonic() + WAIT_S
    try:
        healthy = start_group(0, lighthouse.address(), tmp_path)
        doomed = start_group(1, lighthouse.address(), tmp_path)
        # group 1 dies once it has committed KILL_AT steps together with group 0
        while sum(r["groups"] == 2 for r in rows(tmp_path, 1, 0, doomed[0].pid)) < KILL_AT:
            assert all(p.poll() is None for p in healthy + doomed), logs(tmp_path)
            assert time.monotonic() < deadline, "group 1 never reached the kill step\n" + logs(tmp_path)
            time.sleep(0.1)
        for p in doomed:                                   # the whole group, mid-step
            os.kill(p.pid, signal.SIGKILL)
        for p in doomed:
            p.wait(timeout=10)
        killed_at = max(r["step"] for r in rows(tmp_path, 1, 0, doomed[0].pid))
        # the healthy group goes on alone: steps committed with one group in the quorum
        while not any(r["groups"] == 1 and r["step"] > killed_at for r in rows(tmp_path, 0, 0, healthy[0].pid)):
            assert all(p.poll() is None for p in healthy), logs(tmp_path)
            assert time.monotonic() < deadline, "the healthy group did not go on alone\n" + logs(tmp_path)
            time.sleep(0.1)
        restarted = start_group(1, lighthouse.address(), tmp_path)
        wait_all(healthy + restarted, deadline, tmp_path)
    finally:
        lighthouse.shutdown()
    alone = [r for r in rows(tmp_path, 0, 0, healthy[0].pid) if r["groups"] == 1 and r["step"] > killed_at]
    assert alone                                            # it kept training while group 1 was gone
    back = rows(tmp_path, 1, 0, restarted[0].pid)
    assert back and back[0]["step"] > killed_at + 1        # it resumed at its peer's step, not at 0
    assert all(r["groups"] == 2 for r in back)
    for g, procs in ((0, healthy), (1, restarted)):
        for r in range(GROUP_RANKS):
            losses = [x["loss"] for x in rows(tmp_path, g, r, procs[r].pid)]
            assert losses and all(torch.isfinite(torch.tensor(losses))), (g, r)
    for r in range(GROUP_RANKS):                            # each shard equal to its replica's
        a = torch.load(tmp_path / f"g0r{r}.final.pt", weights_only=True)
        b = torch.load(tmp_path / f"g1r{r}.final.pt", weights_only=True)
        assert a["step"] == b["step"] >= STEPS
        for k in a["state"]:
            torch.testing.assert_close(a["state"][k], b["state"][k], rtol=0, atol=0, msg=k)


def dead_lighthouse() -> dict:
    import torch

    from hybrid import auto_wrap
    from hybrid.errors import HybridError
    from hybrid.model.decoder import build_decoder
    from tests.runtime.test_backends import TINY
    os.environ.update(TORCHFT_LIGHTHOUSE=f"http://127.0.0.1:{free_port()}", HYBRID_TIMEOUT="3")
    refused = None
    try:                          # a family that reduces inside its own library is refused first
        auto_wrap(build_decoder(TINY, seed=0), strategy="zero1", precision="fp32", micro_batch=1, seq_len=16,
                  verbose=False, fault_tolerant=True)
    except HybridError as e:
        refused = str(e)
    start = time.monotonic()
    try:
        w = auto_wrap(build_decoder(TINY, seed=0), strategy="fsdp", precision="fp32", micro_batch=1, seq_len=16,
                      verbose=False, fault_tolerant=True)
        w.train_step(torch.zeros(1, 16, dtype=torch.long))
    except HybridError as e:
        return {"refused": refused, "error": str(e), "seconds": time.monotonic() - start}
    return {"refused": refused, "error": None}


def test_a_dead_lighthouse_is_one_line_within_the_timeout_and_zero1_is_refused():
    pytest.importorskip("torchft")
    from hybrid.runtime.launch import run_ranks
    out = run_ranks(1, dead_lighthouse)[0]
    assert out["refused"].startswith("fault_tolerant=True runs DDP or FSDP inside each replica group; zero1")
    assert out["error"] is not None and "\n" not in out["error"]
    assert "TORCHFT_LIGHTHOUSE" in out["error"] and "within 3 s" in out["error"]
    assert out["seconds"] < 3 + 15                           # the wait, plus planning and wrapping a tiny model



def save_and_load(path: str) -> dict:
    import torch

    from hybrid import auto_wrap
    from hybrid.model.decoder import build_decoder
    from hybrid.runtime.ft import start_lighthouse
    from tests.runtime.test_backends import TINY
    lighthouse = start_lighthouse(min_replicas=1)
    os.environ.update(TORCHFT_LIGHTHOUSE=lighthouse.address(), HYBRID_TIMEOUT="20")
    w = auto_wrap(build_decoder(TINY, seed=0), strategy="fsdp", precision="fp32", micro_batch=1, seq_len=16,
                  verbose=False, fault_tolerant=True)
    ids = torch.arange(16).reshape(1, 16)
    for _ in range(2):
        w.train_step(ids)
    w.save(path)
    w.train_step(ids)
    at = (w.step_count, w.ft.manager.current_step())
    w.load(path)
    loaded = (w.step_count, w.ft.manager.current_step())
    w.train_step(ids)
    after = (w.step_count, w.ft.manager.current_step())
    w.ft.shutdown()
    lighthouse.shutdown()
    return {"at": at, "loaded": loaded, "after": after}


def test_torchfts_step_follows_a_loaded_checkpoint(tmp_path):
    pytest.importorskip("torchft")
    from hybrid.runtime.launch import run_ranks
    out = run_ranks(1, save_and_load, str(tmp_path / "ck"))[0]
    assert out == {"at": (3, 3), "loaded": (2, 2), "after": (3, 3)}
