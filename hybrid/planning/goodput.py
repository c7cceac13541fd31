"""Goodput at scale (pure, no torch): what a layout's checkpoints, failures and restarts cost.

Per layout: the bytes each rank writes and reads as hybrid/ckpt/store.py saves and loads them,
their seconds at the storage bandwidth, the job's mean time between failures from a per-GPU
failure rate, the checkpoint interval that maximises useful work (Young 1974, with Daly 2006's
higher-order correction) and the fraction of time that is useful work (Daly 2006's model of
exponential failures, with failures also during checkpoints and restarts). docs/goodput.md
derives each step and states what is left out.
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import HybridError
from ..families.placement import FP32, optimizer_state_bytes
from ..units import _BYTE_UNITS, _NUMBER

if TYPE_CHECKING:
    from ..config.cluster import Cluster
    from ..config.spec import TrainSpec
    from ..estimation.cost.step import StepCost
    from ..layout.layout import Layout
    from ..model.profile import ModelProfile

LLAMA3_GPUS, LLAMA3_DAYS, LLAMA3_UNEXPECTED = 16384, 54, 419
"""Llama 3 405B pre-training: 419 unexpected interruptions in a 54-day snapshot on 16,384 H100s
(Llama Team, "The Llama 3 Herd of Models", arXiv 2407.21783, Section 3.3.4, Table 5)."""
MTBF_GPU_HOURS = LLAMA3_GPUS * LLAMA3_DAYS * 24 / LLAMA3_UNEXPECTED
"""GPU-hours between unexpected interruptions (50,677): one every 3.1 hours on 16,384 GPUs."""
LLAMA3_STORAGE_BW, LLAMA3_NODES = 2e12, LLAMA3_GPUS // 8
"""Llama 3's Tectonic storage fabric sustains 2 TB/s (peak 7 TB/s) for 16,384 GPUs on 2,048 nodes
of 8 (arXiv 2407.21783, Section 3.3.1, "Storage")."""
STORAGE_BW_PER_NODE = LLAMA3_STORAGE_BW / LLAMA3_NODES
"""Bytes/s one node writes or reads checkpoints at (0.98 GB/s): Llama 3's sustained figure per node."""
RELAUNCH_S = 600.0
"""Seconds from a failure to the relaunched job loading its checkpoint (detection, rescheduling,
process start, process-group and NCCL set-up): an assumption, stated, not a measurement."""
SAVE_READS_BACK = True
"""hybrid/ckpt/store.py's save reads every byte it wrote back for its CRC32 (the ranks in turn)."""
LOAD_CHECK_PASS = True
"""hybrid/ckpt/store.py's load reads every file once for the CRC check, then DCP reads the rank's share."""

_RATE = re.compile(_NUMBER + r"([A-Za-z]*)\s*/\s*s\s*", re.IGNORECASE)


def parse_bandwidth(text) -> float:
    """'10GB/s' -> 1e10 bytes/s ('GiB/s', 'MB/s', 'TB/s' alike; a bare number is bytes/s);
    HybridError naming the value and the form otherwise."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        m = _RATE.fullmatch(str(text)) or re.fullmatch(_NUMBER + r"()", str(text))
        if not m or m.group(2).lower() not in _BYTE_UNITS:
            raise HybridError(f"--storage-bandwidth {str(text)[:40]!r} is not a bandwidth: give bytes per second per "
                              "node, e.g. 10GB/s, 2.5GiB/s or 800MB/s")
        value = float(m.group(1)) * _BYTE_UNITS[m.group(2).lower()]
    if not (math.isfinite(value) and 1e3 <= value <= 1e15):
        raise HybridError(f"--storage-bandwidth must be between 1 KB/s and 1 PB/s per node, got {str(text)[:40]!r}")
    return value


def fmt_rate(bps: float) -> str:
    """1e10 -> '10 GB/s' (decimal units, as storage vendors quote)."""
    for unit, size in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("KB/s", 1e3)):
        if bps >= size:
            return f"{bps / size:.3g} {unit}"
    return f"{bps:.0f} B/s"


def fmt_duration(s: float) -> str:
    """Seconds as '45s', '12m', '3.1h'."""
    if s < 100:
        return f"{s:.0f}s"
    if s < 6000:
        return f"{s / 60:.0f}m"
    return f"{s / 3600:.1f}h"


@dataclass(frozen=True)
class Reliability:
    """The plan's failure and storage figures."""

    mtbf_gpu_hours: float = MTBF_GPU_HOURS
    """GPU-hours between unexpected interruptions: the job fails every mtbf_gpu_hours / GPUs hours."""
    storage_bandwidth: float = STORAGE_BW_PER_NODE
    """Checkpoint write and read bandwidth of one node, bytes/s; a job of N nodes gets N times it."""
    relaunch_s: float = RELAUNCH_S
    """Seconds from a failure until the new job starts loading (RELAUNCH_S)."""
    async_checkpoint: bool = False
    """The save blocks training only for the staging copy to host memory (DCP async save); the
    write to storage runs behind the next steps. False: training waits for the whole save."""

    def __post_init__(self):
        if not (math.isfinite(self.mtbf_gpu_hours) and self.mtbf_gpu_hours > 0):
            raise HybridError(f"--mtbf-gpu-hours must be a positive number of GPU-hours, got {self.mtbf_gpu_hours}")

    def job_mtbf_s(self, gpus: int) -> float:
        """Seconds between failures of a job on `gpus` GPUs (independent failures: the rates add)."""
        return self.mtbf_gpu_hours * 3600 / gpus

    def describe(self, gpus: int) -> str:
        source = " (Llama 3's 419 unexpected interruptions in 54 days on 16,384 GPUs)" \
            if self.mtbf_gpu_hours == MTBF_GPU_HOURS else ""
        store = " (Llama 3's 2 TB/s over 2,048 nodes)" if self.storage_bandwidth == STORAGE_BW_PER_NODE else ""
        saves = "async saves (training waits for the copy to host memory)" if self.async_checkpoint else \
            "synchronous saves (training waits for the write)"
        every = fmt_duration(self.job_mtbf_s(gpus))
        return (f"goodput: MTBF {self.mtbf_gpu_hours:,.0f} GPU-hours{source} = a failure every {every} on "
                f"{gpus:,} GPUs; storage {fmt_rate(self.storage_bandwidth)} per node{store}; relaunch "
                f"{fmt_duration(self.relaunch_s)}; {saves}; checkpoint every Young/Daly "
                "interval (docs/goodput.md)")

    def to_dict(self) -> dict:
        return {"mtbf_gpu_hours": self.mtbf_gpu_hours, "storage_bandwidth": self.storage_bandwidth,
                "storage_bandwidth_per": "node", "relaunch_s": self.relaunch_s,
                "async_checkpoint": self.async_checkpoint}


@dataclass(frozen=True)
class Goodput:
    """One layout's checkpoints, restarts and the useful work left after failures."""

    write_bytes: int
    """Bytes the busiest rank writes per save (its share of one copy of the state)."""
    read_bytes: int
    """Bytes the busiest rank reads per load (the state it holds, and its part of the CRC pass)."""
    checkpoint_s: float
    """Seconds one save blocks training: the whole save, or with async saves the staging copy."""
    write_s: float
    """Seconds one save takes to reach storage (the write, and the CRC read back)."""
    load_s: float
    restart_s: float
    """Seconds from a failure until training resumes: relaunch + load."""
    interval_s: float
    """Training seconds between two saves (Young/Daly), at least one step and, with async saves, the write."""
    fraction: float
    """Useful training time over wall time (Daly 2006), checkpoints, rework after a failure and restarts aside."""
    tokens_per_s_per_gpu: float
    """Useful tokens/s per GPU: the step's rate times the fraction."""

    def to_dict(self) -> dict:
        return {"checkpoint_s": self.checkpoint_s, "checkpoint_interval_s": self.interval_s,
                "goodput_tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "goodput_fraction": self.fraction,
                "checkpoint_write_s": self.write_s, "checkpoint_load_s": self.load_s, "restart_s": self.restart_s,
                "checkpoint_write_bytes_per_rank": self.write_bytes, "checkpoint_read_bytes_per_rank": self.read_bytes}


def state_bytes(profile: "ModelProfile", spec: "TrainSpec", fp32_master: bool = False) -> int:
    """Bytes of the model and optimizer state the checkpoint holds for `profile` (a whole model, a
    stage, a tp share): each parameter in the dtype the engine keeps it (fp32 masters under mixed
    precision; with `fp32_master`, a family that keeps its own fp32 master copy, DeepSpeed, saves that,
    hybrid/runtime/backends/deepspeed.py) and what the optimizer keeps (placement.optimizer_state_bytes,
    in the state dtype); gradients are not saved."""
    b = spec.bytes
    param, state = (FP32, FP32) if fp32_master else (b.param, b.state)
    return int(profile.params * param + optimizer_state_bytes(profile, spec, state=state))


def checkpoint_bytes(layout: "Layout", profile: "ModelProfile", spec: "TrainSpec") -> tuple[int, int]:
    """(bytes written, bytes held) by the busiest rank per save. Written: torch.distributed.checkpoint
    saves one copy of the state, a replicated tensor by one of the ranks holding it (dedup_save_plans
    gives it to the one with the least planned so far), so each rank writes its pipeline stage's state
    over the stage's ranks. Held: what the rank's state dict holds and load reads into: its stage's tp
    share split over the family's checkpoint_shards (ddp: 1, fsdp: dp_shard x cp, DeepSpeed: the world)."""
    from ..estimation.shares import shares
    dims, family = layout.dims, layout.dp.family_obj
    master = family.keeps_master_copy
    write = held = 0
    for rank in range(dims.pp):
        sh = shares(profile, layout, spec, rank)
        write = max(write, state_bytes(sh.held, spec, master) * dims.pp // dims.world_size)
        held = max(held, state_bytes(sh.profile, spec, master) // family.checkpoint_shards(dims))
    return write, held


def daly_interval(delta: float, mtbf: float) -> float:
    """Compute seconds between checkpoints that minimise the expected wall time: Young's sqrt(2 delta M)
    (J. W. Young, "A first order approximation to the optimum checkpoint interval", CACM 17(9), 1974)
    with Daly's higher-order terms, M when delta >= 2M (J. T. Daly, "A higher order estimate of the
    optimum checkpoint interval for restart dumps", Future Generation Computer Systems 22(3), 2006)."""
    if delta >= 2 * mtbf:
        return mtbf
    x = delta / (2 * mtbf)
    return math.sqrt(2 * delta * mtbf) * (1 + math.sqrt(x) / 3 + x / 9) - delta


def daly_fraction(tau: float, delta: float, restart: float, mtbf: float) -> float:
    """Useful time over wall time with failures at rate 1/M, each costing the restart R and the work
    since the last checkpoint (failures may strike during checkpoints and restarts too): Daly 2006's
    T_wall = M e^(R/M) (e^((tau + delta)/M) - 1) T_solve / tau, as T_solve / T_wall."""
    x = (tau + delta) / mtbf             # in logs: a job that fails far more often than it restarts keeps ~0
    log_expm1 = x + math.log1p(-math.exp(-x)) if x > 1 else math.log(math.expm1(x))
    return math.exp(math.log(tau / mtbf) - restart / mtbf - log_expm1)


def goodput(layout: "Layout", profile: "ModelProfile", spec: "TrainSpec", cluster: "Cluster", cost: "StepCost",
            rel: Reliability) -> Goodput:
    """One layout's checkpoint seconds, interval and goodput on `cluster` under `rel`. A node's ranks
    share its storage bandwidth, so a save takes the busiest rank's bytes x GPUs per node / bandwidth."""
    from ..config.cluster import PCIE_BW
    write, held = checkpoint_bytes(layout, profile, spec)
    per_node = cluster.gpus_per_node / rel.storage_bandwidth
    write_s = write * (1 + SAVE_READS_BACK) * per_node
    read = held + (write if LOAD_CHECK_PASS else 0)
    load_s = read * per_node
    # async: DCP's staging copies the rank's whole state dict to host memory over its PCIe link
    blocking = held / PCIE_BW if rel.async_checkpoint else write_s
    mtbf = rel.job_mtbf_s(cluster.world_size)
    restart = rel.relaunch_s + load_s
    tau = daly_interval(blocking, mtbf)
    if rel.async_checkpoint:
        tau = max(tau, write_s)             # the next save waits for the previous write
    steps = max(1, round(tau / cost.seconds)) if tau > cost.seconds else 1
    if rel.async_checkpoint:
        steps = max(steps, math.ceil(write_s / cost.seconds))
    tau = steps * cost.seconds              # a save lands on a step boundary
    frac = daly_fraction(tau, blocking, restart, mtbf)
    return Goodput(write, read, blocking, write_s, load_s, restart, tau, frac, cost.tokens_per_s_per_gpu * frac)
