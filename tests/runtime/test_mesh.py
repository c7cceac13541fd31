"""2D meshes: node-local shard groups across two real torchrun launchers, and bad shapes."""
import json
import os
import subprocess
import sys

import pytest
import torch

from hybrid.errors import HybridError
from hybrid.model.decoder import build_decoder
from hybrid.runtime.launch import free_port, run_ranks

pytestmark = pytest.mark.gloo

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_two_torchrun_nodes_have_node_local_shard_groups(tmp_path):
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
         "--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port),
         os.path.join(TESTS, "scripts", "two_nodes.py"), str(tmp_path)],
        env=env, cwd=os.path.dirname(TESTS), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for node in (0, 1)]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), "\n".join(o[-3000:] for o in outs)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r, info in enumerate(ranks):
        assert info["mesh"] == [1, 2, 2, 1, 1]       # (pp, dp_replicate, dp_shard, cp, tp)
        assert info["shard_ranks"] == ([0, 1] if r < 2 else [2, 3])
        assert info["nodes_in_group"] == [info["node"]] * 2  # every peer on my node
        assert info["node"] == r // 2


def bad_inputs():
    from hybrid import auto_wrap
    errors = {}
    cases = {
        "shard": dict(strategy="hsdp", shard_size=3),
        "name": dict(strategy="zero4"),
        "cuda_fsdp": dict(strategy="fsdp-offload"),
        "cuda_ds": dict(strategy="zero3-offload"),
        "optimizer": dict(strategy="ddp", optimizer="adamw"),
        "cluster": dict(strategy="ddp", cluster=__import__("hybrid").Cluster.build(8, 8)),
    }
    for key, kwargs in cases.items():
        try:
            auto_wrap(build_decoder("tiny-llama"), precision="fp32", seq_len=16, verbose=False, **kwargs)
            errors[key] = None
        except HybridError as e:
            errors[key] = str(e)
    return errors


def test_bad_input_is_a_clear_error_on_every_rank_without_hanging():
    results = run_ranks(4, bad_inputs)
    assert all(r == results[0] for r in results)
    e = results[0]
    assert "world size 4 is not divisible by shard size 3" in e["shard"]
    assert "unknown strategy 'zero4'. Available:" in e["name"]
    assert "offloads GPU memory to the host, which needs CUDA" in e["cuda_fsdp"]
    assert "offloads GPU memory to the host, which needs CUDA" in e["cuda_ds"]
    assert "optimizer must be a callable" in e["optimizer"]
    assert "the cluster spec has 64 GPUs (8 x 8) but this job runs 4 ranks" in e["cluster"]


def test_not_a_module():
    from hybrid import auto_wrap
    with pytest.raises(HybridError, match="auto_wrap needs an nn.Module, got dict"):
        auto_wrap({"weights": torch.zeros(2)})


def test_shutdown_of_a_world_of_one_takes_back_the_variables_it_set():
    """A process that trained alone and shut down is no torchrun rank afterwards (hybrid tune and
    auto_wrap read WORLD_SIZE to tell)."""
    from hybrid.runtime.launch import run_ranks
    assert run_ranks(1, _alone_then_shutdown)[0] == (True, False)


def _alone_then_shutdown():
    import os

    from hybrid.runtime.mesh import init_distributed, shutdown
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    init_distributed()
    during = os.environ.get("WORLD_SIZE") == "1"
    shutdown()
    return during, "WORLD_SIZE" in os.environ


def world_and_env():
    import torch.distributed as dist
    dist.init_process_group("gloo")
    out = (dist.get_world_size(), os.environ.get("HYBRID_PROBE"))
    dist.destroy_process_group()
    return out


def test_launch_retries_a_rendezvous_port_taken_before_rank_0_binds_it(monkeypatch):
    """free_port() picks, rank 0 binds later: another program can take the port in between. The
    launch is tried again on a new port; the ranks see the caller's environment as it is now."""
    import socket

    import hybrid.runtime.launch as launch
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or free_port())
    monkeypatch.setenv("HYBRID_PROBE", "now")
    try:
        assert run_ranks(2, world_and_env) == [(2, "now"), (2, "now")]
    finally:
        taken.close()


LISTENING = """
import os
for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(key, None)
from hybrid.runtime.mesh import init_distributed, shutdown
init_distributed()
port = int(os.environ["MASTER_PORT"])
rows = []
for table in ("/proc/net/tcp", "/proc/net/tcp6"):
    for line in open(table).read().splitlines()[1:]:
        local, state = line.split()[1], line.split()[3]
        address, hexport = local.split(":")
        if state == "0A" and int(hexport, 16) == port:      # 0A: TCP_LISTEN
            rows.append(address)
shutdown()
print(" ".join(rows))
"""


@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net/tcp")
def test_a_world_of_one_listens_on_loopback_only():
    """torch's env:// store listens on every interface (0.0.0.0 / ::) whatever MASTER_ADDR says."""
    out = subprocess.run([sys.executable, "-c", LISTENING], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(TESTS))
    assert out.returncode == 0, out.stderr[-2000:]
    addresses = out.stdout.split()
    loopback = {"0100007F", "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"}
    assert addresses and set(addresses) <= loopback, addresses     # 127.0.0.1, ::1, ::ffff:127.0.0.1


def _one_rank_killed():
    import signal

    import torch.distributed as dist

    from tests.test_safety import _train, _wrap
    os.environ["HYBRID_TIMEOUT"] = "20"
    w = _wrap("ddp")
    _train(w, 1)
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    _train(w, 5)
    return "no error"


def test_a_killed_rank_is_named_with_the_time_its_peer_waited():
    """Rank 0 names rank 1 (the dead one), not itself, and the seconds it really waited, not the 20 s bound."""
    import re
    import time
    start = time.monotonic()
    with pytest.raises(HybridError) as e:
        run_ranks(2, _one_rank_killed)
    message = str(e.value)
    assert message.startswith("rank 1 (pid ") and " died: its process ended while rank 0 was in " in message, message
    assert "\n" not in message and "within 20 s" not in message
    waited = float(re.search(r"which failed after ([0-9.]+) s", message).group(1))
    assert waited < 20 and time.monotonic() - start < 60


def _held_after_collectives(n: int = 300):
    """How many of n all-gathers return with gloo's worker thread still holding their tensors, without
    and with mesh.released (the count before it, the count with it)."""
    import torch.distributed as dist

    from hybrid.runtime.mesh import init_distributed, released
    init_distributed()
    held = [0, 0]
    for settle in (False, True):
        for _ in range(n):
            x = torch.randn(2, 2, 16, 16)
            parts = [torch.empty_like(x) for _ in range(2)]
            if settle:
                with released(None, x, *parts):
                    dist.all_gather(parts, x)
            else:
                dist.all_gather(parts, x)
            held[settle] += any(t._use_count() > 1 for t in (x, *parts))
    return held


def test_released_returns_once_gloos_worker_has_dropped_the_tensors():
    """A gloo collective returns before its worker thread drops the work's tensors (ProcessGroupGloo's
    runLoop), so a temporary's free, and a rank's peak, moved with thread timing (a live cp cell 2% over
    its trace on a loaded machine); after mesh.released none is held."""
    before, after = zip(*run_ranks(2, _held_after_collectives))
    assert after == (0, 0), f"held after released: {after} of 300 (without it: {before})"
