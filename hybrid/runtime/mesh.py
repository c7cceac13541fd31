"""Process group start-up, the named DeviceMesh of a ParallelDims, bounded waits and shutdown.

The mesh is ("pp", "dp_replicate", "dp_shard", "cp", "tp") (hybrid/layout/dims.py says why in that order);
every shape is validated before any collective is called.
"""
from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..errors import HybridError
from ..layout.dims import ParallelDims, validate_shard_size
from ..units import env_seconds


@dataclass(frozen=True)
class Runtime:
    """Where this rank runs: device, backend and the world shape."""

    device: torch.device
    backend: str
    world_size: int
    rank: int
    local_world_size: int
    stands_for: str = ""
    """A traced rank's accelerator software (GPUSpec.software of the planned cluster: CUDA, ROCm, CPU), which
    its CPU device stands for; empty on a live rank (its device's: software)."""

    @property
    def device_type(self) -> str:
        return self.device.type

    @property
    def software(self) -> str:
        """The accelerator software this rank's job runs on, in GPUSpec.software's words (CUDA, ROCm, CPU)."""
        if self.stands_for:
            return self.stands_for
        if self.device.type == "cuda":
            return "ROCm" if torch.version.hip else "CUDA"
        return "CPU" if self.device.type == "cpu" else self.device.type

    @property
    def traced(self) -> bool:
        """A traced estimate's rank (measure/traced.py): fake tensors on a fake process group, standing
        for the GPU job on this CPU."""
        return self.backend == TRACED


TRACED = "fake"
"""The process-group backend of a traced estimate (torch's fake process group)."""


def traced_group(group) -> bool:
    """Whether collectives on `group` run on a traced estimate's fake process group: shapes only,
    no values (routing counts, masks and the like are planned, not computed)."""
    import torch.distributed as dist
    return dist.get_backend(group) == TRACED


RELEASE_S = 1.0
"""The longest `released` waits for gloo's worker thread (microseconds in practice)."""


@contextlib.contextmanager
def released(group, *tensors: torch.Tensor):
    """Around one synchronous collective of `group` over `tensors`: on gloo, wait after it until the
    backend's worker thread has dropped its references to them. ProcessGroupGloo's worker marks a
    work complete, which returns the caller's wait, and only then releases the work and its tensors
    (runLoop): measured on 2 ranks, a quarter of the calls returned with the tensors still held. A
    temporary the caller drops would then be freed at a moment set by thread timing, and a rank's
    memory peak would move between runs (the live cross-check cells, tests/measure). Bounded by
    RELEASE_S; other backends return at once."""
    if dist.get_backend(group) != "gloo":
        yield
        return
    before = [(t, t._use_count()) for t in tensors]
    yield
    deadline = time.monotonic() + RELEASE_S
    while any(t._use_count() > n for t, n in before) and time.monotonic() < deadline:
        time.sleep(0)


def free_port() -> int:
    """A TCP port free on this host now (for a world of one, or locally spawned ranks)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def default_timeout(cuda: bool) -> float:
    """Seconds any collective (and shutdown) may wait for a peer before failing: HYBRID_TIMEOUT,
    else 60 on CPU ranks (gloo) and 600 on GPUs (the first NCCL collectives and large checkpoint
    writes can take minutes)."""
    return env_seconds(os.environ, "HYBRID_TIMEOUT", 600.0 if cuda else 60.0, "60")


def init_distributed(timeout_s: float | None = None) -> Runtime:
    """Join (or start) the default process group: nccl + the local CUDA device when CUDA is there,
    else gloo on the CPU. Without torchrun's variables this is a world of one, with the variables
    set as torchrun would (DeepSpeed reads LOCAL_RANK). Every collective waits at most
    `timeout_s` (default_timeout) for its peers."""
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not dist.is_initialized():
        backend = "nccl" if cuda else "gloo"
        timeout = timeout_s if timeout_s is not None else default_timeout(cuda)
        _STATE["timeout"] = timeout
        wait = datetime.timedelta(seconds=timeout)
        if "WORLD_SIZE" not in os.environ:
            store = loopback_store(wait)
            world_of_one = dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                                MASTER_ADDR="127.0.0.1", MASTER_PORT=str(store.port))
            # shutdown() puts back what was there: nothing later sees a torchrun, the user's values return
            _STATE["env"] = {k: os.environ.get(k) for k in world_of_one}
            os.environ.update(world_of_one)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=wait)
        else:
            dist.init_process_group(backend, timeout=wait)
            _register_peers(timeout)
    backend = dist.get_backend()
    world = dist.get_world_size()
    local = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
    return Runtime(device, backend, world, dist.get_rank(), local)


def loopback_store(timeout: datetime.timedelta):
    """The rendezvous store of a world of one, listening on 127.0.0.1 only: torch's env:// store
    (c10d TCPStore, torch 2.13) listens on every interface whatever MASTER_ADDR says, so we bind
    the socket ourselves and hand it over (master_listen_fd); the port is free by construction."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    return dist.TCPStore("127.0.0.1", port, 1, True, timeout=timeout, wait_for_workers=False,
                         master_listen_fd=sock.detach())


# Where this process is, for error messages about peers: set by Wrapped as it trains.
_STATE: dict = {"timeout": None, "step": 0, "peers": {}}


def _register_peers(timeout: float) -> None:
    """Every rank's host and pid, read once at start-up through the store (rank 0, its host, may be
    the one that dies later), so that a failure can name the rank whose process is gone."""
    store = _store()
    if store is None:
        return
    rank, world = dist.get_rank(), dist.get_world_size()
    store.set(f"hybrid/pid/{rank}", f"{socket.gethostname()} {os.getpid()}")
    keys = [f"hybrid/pid/{r}" for r in range(world)]
    store.wait(keys, datetime.timedelta(seconds=timeout))
    _STATE["peers"] = {r: tuple(store.get(k).decode().split(" ")) for r, k in enumerate(keys)}


def _gone(host: str, pid: str) -> bool:
    """Whether a rank's process on this host has ended (absent from /proc, or a zombie)."""
    if host != socket.gethostname():
        return False
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True
    except OSError:
        return False


def dead_ranks(wait_s: float = 3.0) -> list[int]:
    """Ranks on this host whose process has ended (ranks elsewhere cannot be seen from here), looked
    for during `wait_s` seconds: a killed process closes its sockets before it becomes a zombie."""
    import time
    deadline = time.monotonic() + wait_s
    peers = {r: p for r, p in _STATE["peers"].items() if r != dist.get_rank() and p[0] == socket.gethostname()}
    while peers:
        dead = [r for r, (host, pid) in sorted(peers.items()) if _gone(host, pid)]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)
    return []


def _store():
    from torch.distributed.distributed_c10d import _get_default_store
    try:
        return _get_default_store()
    except (RuntimeError, ValueError):
        return None


def note_step(step: int) -> None:
    _STATE["step"] = step


def departed() -> dict[int, str]:
    """Ranks that called shutdown() (left the job), with the step they left at; {} if unknown."""
    store = _store()
    if store is None:
        return {}
    out = {}
    try:
        for r in range(dist.get_world_size()):
            key = f"hybrid/left/{r}"
            if store.check([key]):
                out[r] = store.get(key).decode()
    except Exception:   # noqa: BLE001 - the store's host may be gone too
        return {}
    return out


_COMM_WORDS = ("timed out", "timeout", "connection closed", "connection reset", "broken pipe",
               "peer", "gloo", "nccl")


def is_peer_failure(e: BaseException) -> bool:
    dist_error = getattr(dist, "DistError", ())
    text = str(e).lower()
    return isinstance(e, dist_error) or (isinstance(e, RuntimeError) and any(w in text for w in _COMM_WORDS))


def peer_failure(e: BaseException, what: str, elapsed_s: float | None = None) -> HybridError:
    """The one-line error for a collective that failed because another rank left or died: it names
    the rank that left or whose process ended, and how long `what` ran before it failed."""
    rank, step = dist.get_rank(), _STATE["step"]
    left = {r: s for r, s in departed().items() if r != rank}
    after = f" after {elapsed_s:.1f} s" if elapsed_s is not None else ""
    if left:
        who = ", ".join(f"rank {r} (after optimizer step {s})" for r, s in sorted(left.items()))
        return HybridError(f"{who} left the job while rank {rank} was in {what} at optimizer step {step}: "
                           "every rank must run the same number of steps (give each rank the same number of "
                           "batches, e.g. DistributedSampler(drop_last=True))")
    first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
    dead = dead_ranks()
    if dead:
        who = ", ".join(f"rank {r} (pid {_STATE['peers'][r][1]})" for r in dead)
        return HybridError(f"{who} died: its process ended while rank {rank} was in {what} at optimizer step "
                           f"{step}, which failed{after}: {first}. Check that rank's output (killed, e.g. out "
                           "of memory?)")
    return HybridError(f"rank {rank}: a peer did not answer during {what} at optimizer step {step}, which failed"
                       f"{after} (it died, hung, or called something else): {first}. Check the other ranks' output; "
                       f"HYBRID_TIMEOUT sets the wait ({_STATE['timeout'] or 0:g} s)")


def build_mesh(dims: ParallelDims | int, runtime: Runtime, gpus_per_node: int | None = None,
               domain: int | None = None) -> DeviceMesh:
    """The named 4D mesh of `dims` (or, given a shard size, of pure data parallelism with that
    shard size). Validated first, identically on every rank; `domain`: the GPUs of one scale-up
    domain (Cluster.domain; None: the node)."""
    per_node = gpus_per_node or runtime.local_world_size
    if runtime.world_size % per_node:
        raise HybridError(f"world size {runtime.world_size} is not a multiple of {per_node} ranks per node")
    if isinstance(dims, int):
        validate_shard_size(dims, runtime.world_size, per_node, domain)
        dims = ParallelDims.data_parallel(runtime.world_size, dims)
    dims.validate(runtime.world_size, per_node, domain)
    mesh = dims.build_mesh(runtime.device_type)
    if dims.cp > 1:       # the flattened dims FSDP and DDP use, made here on every rank alike (collective)
        fsdp_mesh(mesh)
        replica_group(mesh)
    return mesh


def _kept(mesh: DeviceMesh, name: str, make) -> DeviceMesh:
    """A mesh derived from `mesh` (flattened dims), made once on every rank alike and kept on it:
    torch deprecates slicing a flattened dim back out of the root mesh by name."""
    kept = mesh.__dict__.setdefault("_hybrid_derived", {})
    if name not in kept:
        kept[name] = make()
    return kept[name]


def _flat(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The 1D mesh of `names` flattened."""
    name = "_".join(names)
    return _kept(mesh, name, lambda: mesh[names]._flatten(name))


def fsdp_shard_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks FSDP shards parameters over: dp_shard, and with context parallelism dp_shard x cp
    flattened (the cp ranks hold the same parameters, so they share the shards: torchtitan's
    dp_shard_cp)."""
    return mesh["dp_shard"] if mesh["cp"].size() == 1 else _flat(mesh, ("dp_shard", "cp"))


def fsdp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """FSDP2's mesh: (dp_replicate, shard) when replicated (HSDP, 2D), else the shard mesh (1D)."""
    if mesh["dp_replicate"].size() == 1:
        return fsdp_shard_mesh(mesh)
    if mesh["cp"].size() == 1:
        return mesh["dp_replicate", "dp_shard"]
    shape = (mesh["dp_replicate"].size(), mesh["dp_shard"].size() * mesh["cp"].size())
    return _kept(mesh, "dp_replicate,dp_shard_cp", lambda: _flat(mesh, ("dp_replicate", "dp_shard", "cp"))
                 ._unflatten(0, shape, ("dp_replicate", "dp_shard_cp")))


def replica_group(mesh: DeviceMesh):
    """DDP's all-reduce group: every rank holding a whole replica, dp_replicate x dp_shard x cp."""
    if mesh["cp"].size() == 1 and mesh["dp_shard"].size() == 1:
        return mesh["dp_replicate"].get_group()
    return _flat(mesh, ("dp_replicate", "dp_shard", "cp")).get_group()


def dim_size(mesh: DeviceMesh, name: str) -> int:
    """The size of a root mesh dimension, read without slicing it out (a slice builds the
    sub-mesh's rank tensors, which a traced estimate would count as the job's)."""
    return mesh.size(mesh.mesh_dim_names.index(name))


def ep_size(mesh) -> int:
    """The expert-parallel degree of a mesh built by build_mesh (1: every rank holds every expert)."""
    experts = getattr(mesh, "experts", None)
    return dim_size(experts, "ep") if experts is not None else 1


def ep_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ranks one MoE layer's experts are split over, and its tokens exchanged between (ep > 1)."""
    return mesh.experts["ep"]


def expert_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """What FSDP2 shards the experts over (ep > 1): the expert_shard = dp_shard x cp / ep ranks that
    hold the same experts, with dp_replicate in front when replicated (HSDP, 2D)."""
    if mesh["dp_replicate"].size() == 1:
        return mesh.experts["expert_shard"]
    return mesh.experts["dp_replicate", "expert_shard"]


def shard_group_ranks(mesh: DeviceMesh) -> list[int]:
    """Global ranks in this rank's shard group (for checks and printing)."""
    return dist.get_process_group_ranks(mesh["dp_shard"].get_group())


def shutdown(timeout_s: float | None = None) -> None:
    """Leave the job cleanly: wait (through the rendezvous store, never a collective that could
    pair with a peer's training step) until every rank has called shutdown, then destroy the
    process groups; rank 0, which often hosts the store, returns last. Ranks still training see
    that this rank left; if the others do not arrive within `timeout_s` (default: the job's
    collective timeout), this raises a HybridError naming them instead of hanging. An async
    checkpoint save still in flight is waited for first (hybrid/ckpt/background.py)."""
    import time

    from ..ckpt.background import wait_all
    if not dist.is_initialized():
        return
    wait_all()
    world, rank = dist.get_world_size(), dist.get_rank()
    store = _store()
    timeout = timeout_s if timeout_s is not None else (_STATE["timeout"] or default_timeout(torch.cuda.is_available()))
    if store is None or world == 1:
        dist.destroy_process_group()
        for key, value in _STATE.pop("env", {}).items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        return
    try:
        store.set(f"hybrid/left/{rank}", str(_STATE["step"]))
        store.add("hybrid/arrived", 1)
        deadline = time.monotonic() + timeout
        while store.add("hybrid/arrived", 0) < world:
            if time.monotonic() > deadline:
                missing = [r for r in range(world) if not store.check([f"hybrid/left/{r}"])]
                dist.destroy_process_group()
                raise HybridError(f"rank {rank} called shutdown() after optimizer step {_STATE['step']}, but "
                                  f"rank(s) {missing} did not within {timeout:g} s: they are still training or "
                                  "failed; every rank must run the same number of steps")
            time.sleep(0.01)
    except HybridError:
        raise
    except Exception as e:  # noqa: BLE001 - the store's host (rank 0) is gone
        dist.destroy_process_group()
        raise HybridError(f"rank {rank}: shutdown() could not reach the job's rendezvous store ({e}); "
                          "rank 0 has probably exited or died") from None
    dist.destroy_process_group()
    store.add("hybrid/done", 1)
    if rank == 0:       # peers may still be tearing down through rank 0's store
        deadline = time.monotonic() + timeout
        while store.add("hybrid/done", 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)
