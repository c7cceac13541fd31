"""Fault-tolerant replica groups with torchft: the dp_replicate dimension as the failure domain.

Each replica group is its own job (its own torchrun, its own process group for the dp_shard and
inner dimensions); torchft's Manager joins them through a lighthouse (a quorum per step), averages
the gradients across the groups that are alive with its own fault-tolerant all-reduce (outside
FSDP's reduce-scatter and DDP's all-reduce, which stay inside the group), lets a step commit only
where every rank of the group got through, drops a group that dies (the quorum shrinks, the others
keep training) and heals a group that (re)joins from a healthy peer's state. The environment is
torchft's: TORCHFT_LIGHTHOUSE (the lighthouse's address), REPLICA_GROUP_ID (this group's index)
and NUM_REPLICA_GROUPS (the groups the job was planned for). docs/fault_tolerance.md says how to
run it and what it costs.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch

from ..errors import HybridError
from ..log import get_logger

log = get_logger(__name__)

INSTALL = "pip install 'hybrid[ft]'"

QUORUM_RETRIES = 0
"""Quorum requests retried before a group gives up (torchft's default: 0)."""


def require_torchft():
    """torchft, or one line naming the extra that installs it."""
    try:
        import torchft
    except ImportError:
        raise HybridError(f"fault_tolerant=True needs torchft, which is not installed: {INSTALL}") from None
    return torchft


def start_lighthouse(min_replicas: int = 1, bind: str = "127.0.0.1:0", join_timeout_ms: int = 10_000,
                     heartbeat_timeout_ms: int = 2000, quorum_tick_ms: int = 100):
    """torchft's lighthouse in this process (a LighthouseServer), listening on `bind` (loopback by
    default): a quorum forms once `min_replicas` groups asked and every other group that is alive
    (heartbeating) asked too or had join_timeout_ms to; a group silent for heartbeat_timeout_ms is
    dead and dropped, so a failure costs about that long. `.address()` is what TORCHFT_LIGHTHOUSE
    names; `.shutdown()` stops it."""
    require_torchft()
    from torchft.coordination import LighthouseServer
    return LighthouseServer(bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
                            quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


@dataclass(frozen=True)
class ReplicaEnv:
    """Which replica group this process belongs to, read once from torchft's variables."""

    lighthouse: str
    """TORCHFT_LIGHTHOUSE: the lighthouse's address (http://host:port)."""
    replica_id: int
    """REPLICA_GROUP_ID: this group's index, 0 <= id < replicas."""
    replicas: int
    """NUM_REPLICA_GROUPS: how many groups the job was planned for (the quorum may hold fewer)."""

    @staticmethod
    def read(environ=os.environ) -> ReplicaEnv:
        lighthouse = environ.get("TORCHFT_LIGHTHOUSE", "")
        if not lighthouse:
            raise HybridError("fault_tolerant=True needs TORCHFT_LIGHTHOUSE, the address of torchft's lighthouse "
                              "(start one with `torchft_lighthouse --min_replicas 1 --bind 127.0.0.1:29510` or "
                              "hybrid.runtime.ft.start_lighthouse()), e.g. TORCHFT_LIGHTHOUSE=http://127.0.0.1:29510")
        values = {}
        for key, default in (("REPLICA_GROUP_ID", "0"), ("NUM_REPLICA_GROUPS", "1")):
            text = environ.get(key, default)
            if not text.isdigit():
                raise HybridError(f"{key}={text!r} must be a non-negative integer (this replica group's index and "
                                  "the number of groups)")
            values[key] = int(text)
        rid, n = values["REPLICA_GROUP_ID"], values["NUM_REPLICA_GROUPS"]
        if n < 1 or rid >= n:
            raise HybridError(f"REPLICA_GROUP_ID={rid} must be below NUM_REPLICA_GROUPS={n} (>= 1): number the "
                              "replica groups 0 .. NUM_REPLICA_GROUPS - 1")
        return ReplicaEnv(lighthouse, rid, n)


def check_layout(chosen) -> None:
    """A fault-tolerant job's layout inside one replica group: a family that reduces with torch's
    collectives (DDP, FSDP2), no pipeline, and no HSDP of its own (the groups replicate)."""
    fam = chosen.strategy.family_obj
    if not fam.fault_tolerant:
        raise HybridError(f"fault_tolerant=True runs DDP or FSDP inside each replica group; {chosen.name} "
                          f"({fam.name}) reduces gradients inside its own library: pass strategy='fsdp' or 'ddp'")
    dims = chosen.parallel
    stages = chosen.layout.used().get("pp")
    if stages:
        raise HybridError(f"fault_tolerant=True with pp={stages}: a pipeline's stages step inside train_step, "
                          "which torchft's quorum and all-reduce do not wrap here: pass pp=1")
    if dims.dp_replicate > 1 and dims.dp_shard > 1:
        raise HybridError(f"fault_tolerant=True: {chosen.label} is HSDP inside one replica group (dp_replicate="
                          f"{dims.dp_replicate} x dp_shard={dims.dp_shard}); the replica groups are the replicate "
                          "dimension: pass strategy='fsdp' (dp_shard over the group) or 'ddp'")


class FaultTolerantReplicas:
    """One rank's torchft Manager and what Wrapped asks of it: a quorum before a window's first
    forward (healing from a peer when behind), the gradients averaged across the groups after the
    window's last backward, and whether the step may commit."""

    def __init__(self, wrapped, env: ReplicaEnv, timeout_s: float):
        require_torchft()
        from torchft import Manager
        from torchft.process_group import ProcessGroupGloo

        self.w, self.env = wrapped, env
        rt = wrapped.runtime
        wait = datetime.timedelta(seconds=timeout_s)
        if rt.device.type == "cuda":
            from torchft.process_group import ProcessGroupNCCL
            pg = ProcessGroupNCCL(timeout=wait)
        else:
            pg = ProcessGroupGloo(timeout=wait)
        self.timeout_s = timeout_s
        try:
            self.manager = Manager(pg=pg, load_state_dict=self._load, state_dict=self._state, min_replica_size=1,
                                   use_async_quorum=False, timeout=wait, quorum_timeout=wait, connect_timeout=wait,
                                   rank=rt.rank, world_size=rt.world_size, replica_id=f"hybrid_{env.replica_id}",
                                   lighthouse_addr=env.lighthouse, checkpoint_transport=_transport(wait),
                                   quorum_retries=QUORUM_RETRIES)
        except RuntimeError as e:
            raise self._unreachable(e, "start") from None
        self._open = False        # a quorum was taken for the current window

    def _unreachable(self, e: BaseException, what: str) -> HybridError:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        return HybridError(f"replica group {self.env.replica_id} rank {self.w.runtime.rank}: torchft could not {what} "
                           f"within {self.timeout_s:g} s ({first}); is the lighthouse at {self.env.lighthouse} "
                           "(TORCHFT_LIGHTHOUSE) running? HYBRID_TIMEOUT sets the wait")

    @property
    def participants(self) -> int:
        """Replica groups in the current step's quorum."""
        return self.manager.num_participants()

    def begin(self) -> None:
        """Before a window's first forward: join the step's quorum; a group behind the others loads
        a healthy peer's model, optimizer and loop state here."""
        if not self._open:
            try:
                self.manager.start_quorum()
            except RuntimeError as e:           # the lighthouse or this group's manager is gone
                raise self._unreachable(e, "form the step's quorum") from None
            self._open = True

    def reduce_gradients(self) -> None:
        """After the window's last backward: every local gradient (a DTensor's shard) averaged over
        the groups in the quorum, one flat all-reduce per dtype. A failed all-reduce is torchft's to
        report (the step then does not commit)."""
        grads = [p.grad for p in self.w.engine.model.parameters() if p.grad is not None]
        by_dtype: dict = {}
        for g in grads:
            local = getattr(g, "_local_tensor", g)
            by_dtype.setdefault(local.dtype, []).append(local)
        for locals_ in by_dtype.values():
            flat = torch.cat([t.reshape(-1) for t in locals_])
            self.manager.allreduce(flat).wait()      # the average, or an error torchft keeps for should_commit
            offset = 0
            for t in locals_:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()

    def commit(self) -> bool:
        """Whether the step may run: every rank of this group got through it, its all-reduce across
        the groups included (torchft's should_commit, a vote inside the group; a group that does
        not commit falls behind and heals at the next quorum). False: nothing steps."""
        self._open = False
        try:
            return self.manager.should_commit()
        except RuntimeError as e:               # this group's manager (its rank 0) is gone
            raise self._unreachable(e, "vote on the step") from None

    def loaded(self) -> None:
        """After Wrapped.load: torchft's step is the checkpoint's optimizer step (a group resumed
        behind the others heals from them at the next quorum; torchft's Manager docs ask for its
        state to follow checkpoints)."""
        m = self.manager
        m.load_state_dict({"step": self.w.optimizer_steps, "batches_committed": m.batches_committed()})
        self._open = False

    def shutdown(self) -> None:
        self.manager.shutdown(wait=False)

    # --- what a healing peer receives --------------------------------------------------------
    def _state(self) -> dict:
        eng = self.w.engine
        return {"model": {k: _local(v) for k, v in eng.model.state_dict().items()},
                "optimizer": _tree(eng.optimizer.state_dict(), _local),
                "loop": self.w.loop_state()}

    def _load(self, state: dict) -> None:
        eng = self.w.engine
        with torch.no_grad():
            for k, v in eng.model.state_dict().items():
                _local(v).copy_(state["model"][k])
        params = [p for group in eng.optimizer.param_groups for p in group["params"]]
        optim = state["optimizer"]
        optim["state"] = {i: {k: _like(v, params[int(i)]) for k, v in s.items()} for i, s in optim["state"].items()}
        eng.optimizer.load_state_dict(optim)
        self.w.load_loop_state(state["loop"])
        if self.w.runtime.rank == 0:
            log.info("hybrid: replica group %d healed from a peer at optimizer step %d", self.env.replica_id,
                     self.w.optimizer_steps)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _like(value, param):
    """An optimizer state tensor received as a local shard, made a DTensor like its parameter."""
    if not isinstance(value, torch.Tensor) or not hasattr(param, "device_mesh") or value.shape != _local(param).shape:
        return value
    from torch.distributed.tensor import DTensor
    return DTensor.from_local(value, param.device_mesh, param.placements, run_check=False, shape=param.shape,
                              stride=param.stride())


def _tree(obj, fn):
    if isinstance(obj, dict):
        return {k: _tree(v, fn) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_tree(v, fn) for v in obj)
    return fn(obj) if isinstance(obj, torch.Tensor) else obj


def _transport(wait):
    """torchft's HTTP checkpoint transport, reading what a peer sends with weights_only=True
    (tensors and plain containers: a peer's bytes never run code here)."""
    from torchft.checkpointing._serialization import _streaming_load
    from torchft.checkpointing.http_transport import HTTPTransport

    class _Safe(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout) -> object:
            import urllib.request
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    return _Safe(timeout=wait, num_chunks=0)
