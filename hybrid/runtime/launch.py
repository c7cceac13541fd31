"""Run a function on N local ranks (torch.multiprocessing) with torchrun's variables set, and
collect what each returns. Used by measured estimates, `hybrid tune`, benchmarks and the tests."""
from __future__ import annotations

import os
import tempfile
import traceback

from .extensions import extension_cache
from .mesh import free_port

QUIET_CPP_LOGS = {"TORCH_CPP_LOG_LEVEL": "FATAL"}
"""Set for the ranks where the user did not: when rank 0 dies before it hosts the rendezvous store,
every other rank's c10d client logs each failed connection with the C++ stack of the exception
(socket.cpp, TCPStore.cpp: 20+ lines per retry) before the one-line error the ranks report; the
error still reaches Python, whatever the level (it is read once, when torch loads)."""


PRELOAD = ["torch"]
"""What the fork server imports once, so that each rank starts from a process that has torch
loaded instead of importing it again (2-12 s a launch on a busy 2-core machine, 0.1 s forked)."""


def preload(*modules: str) -> None:
    """Have the fork server import `modules` too, when it starts (at this process's first launch):
    a process that launches many times (the test suite, a benchmark) then saves every rank their
    import. Modules that read the environment at import read the one of that first launch."""
    PRELOAD.extend(m for m in modules if m not in PRELOAD)


def _start_method() -> str:
    """forkserver where the platform has it (Linux, macOS): a fresh process forked from a server
    that imported only torch, never initialised CUDA and started no threads, so it is as clean as
    spawn; spawn elsewhere (Windows)."""
    import multiprocessing
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return "spawn"
    multiprocessing.set_forkserver_preload(PRELOAD)
    return "forkserver"


def _entry(rank, world, port, local_world, fn, args, out_dir, quiet, env=None):
    if env is not None:                     # the caller's environment now, not the fork server's
        os.environ.clear()                  # at the time it started
        os.environ.update(env)
    import torch
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank % local_world),
                      LOCAL_WORLD_SIZE=str(local_world), GROUP_RANK=str(rank // local_world))
    if not torch.cuda.is_available():
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    if quiet:
        import warnings
        warnings.filterwarnings("ignore")
    from .mesh import shutdown
    path = os.path.join(out_dir, f"{rank}.pt")

    def report(result: dict) -> None:       # whole or absent: the parent reads it while ranks run
        torch.save(result, path + ".part")
        os.replace(path + ".part", path)
    try:
        report({"ok": fn(*args)})
        shutdown()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        report({"error": f"{type(e).__name__}: {e}", "type": type(e).__name__, "tb": traceback.format_exc()})
        _leave()


def _leave() -> None:
    """After an error: close this rank's process group locally (no collective, no wait for the
    others), so that its peers see an orderly close rather than a vanished process."""
    import torch.distributed as dist
    try:
        if dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving anyway; the error is already reported
        pass


GRACE_S = 15.0
"""Seconds the other ranks get, after one exits with an error or is killed, to report their own
error (a rank naming its dead peer) before they are stopped (torch.multiprocessing's grace_period)."""


PORT_TRIES = 3
"""Launches tried when the rendezvous port picked free was taken before rank 0 bound it (another
program on this host can take it between the two: EADDRINUSE)."""


def run_ranks(world: int, fn, *args, local_world: int | None = None, quiet: bool = True,
              timeout_s: float = 600.0) -> list:
    """fn(*args) on `world` ranks (`local_world` per simulated node); the per-rank results in rank
    order. A HybridError raised on the ranks is raised here with its message; anything else with
    the rank's traceback. Ranks still running after `timeout_s` are killed and reported."""
    from ..errors import HybridError
    for attempt in range(PORT_TRIES):
        results = _launch(world, fn, args, local_world or world, quiet, timeout_s)
        if not _lost_port_in(results[:1]) or attempt == PORT_TRIES - 1:
            break
    for r, res in enumerate(results):
        if res is None:
            continue
        if "error" in res:
            if res["type"] == "HybridError":
                raise HybridError(res["error"].split(": ", 1)[1])
            raise RuntimeError(f"rank {r} failed: {res['error']}\n{res['tb']}")
    return [res["ok"] for res in results]


def _launch(world: int, fn, args: tuple, local_world: int, quiet: bool, timeout_s: float) -> list:
    """One launch on a fresh port: what each rank saved (None where it saved nothing)."""
    import time

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as out:
        added = {k: v for k, v in QUIET_CPP_LOGS.items() if k not in os.environ}
        os.environ.update(added)            # the children inherit it; the caller's environment is restored
        try:
            env = dict(os.environ)
            extension_cache(env)            # ranks that start DeepSpeed themselves build in this environment's cache
            ctx = mp.start_processes(_entry, args=(world, free_port(), local_world, fn, args, out, quiet, env),
                                     nprocs=world, join=False, start_method=_start_method())
        finally:
            for k in added:
                os.environ.pop(k, None)
        deadline = time.monotonic() + timeout_s
        crash = None
        try:
            while not ctx.join(timeout=0.5, grace_period=GRACE_S):
                if _lost_port(out):             # the others wait for a store that never comes: stop them
                    for p in ctx.processes:
                        p.kill()
                        p.join()
                    break
                if time.monotonic() > deadline:
                    alive = [r for r, p in enumerate(ctx.processes) if p.is_alive()]
                    for p in ctx.processes:
                        p.kill()
                    raise RuntimeError(f"rank(s) {alive} still running after {timeout_s:g} s: killed")
        except mp.ProcessExitedException as e:
            crash = e
        results = _results(out, world)
        reported = any("error" in res for res in results if res is not None)
        # a rank killed while a peer that had reported an error tore down (gloo aborts on a
        # vanished peer) is the consequence: the reported error, where there is one, is the cause
        if crash is not None and not reported:
            raise crash
        if _lost_port_in(results[:1]):
            return results
        missing = [r for r, res in enumerate(results) if res is None]
        if missing and not reported:
            raise RuntimeError(f"rank(s) {missing} exited without a result (killed, e.g. out of memory)")
    return results


def _lost_port_in(results: list) -> bool:
    return any(res is not None and "EADDRINUSE" in res.get("error", "") for res in results)


def _lost_port(out: str) -> bool:
    """Rank 0 (which hosts the rendezvous store) reported that its port was taken."""
    return _lost_port_in(_results(out, 1)) if os.path.exists(os.path.join(out, "0.pt")) else False


def _results(out: str, world: int) -> list:
    """What each rank saved (None where it saved nothing)."""
    import torch
    paths = [os.path.join(out, f"{r}.pt") for r in range(world)]
    return [torch.load(p, weights_only=True) if os.path.exists(p) else None for p in paths]
