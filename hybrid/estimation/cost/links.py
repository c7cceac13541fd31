"""How long collectives and host transfers take on a cluster's links (pure).

Ring collectives (Patarasuk & Yuan 2009; NCCL's ring): all-reduce moves 2(n-1)/n x S bytes per
GPU, all-gather and reduce-scatter (n-1)/n x S each, at the group's bus bandwidth, plus a latency
of alpha x log2(n) per collective (NCCL's tree/ring start-up).

Bus bandwidth: NVLink inside a node. A group spanning nodes with k of its ranks on each node runs
k rings side by side (NCCL's channels, one per NIC on rail-optimised clusters), each crossing a
node boundary through a different NIC, while the rest of every ring rides NVLink; so each rank's
share moves at min(NVLink, k x NIC). With k = 8 that is 8 x 25 GB/s = 200 GB/s on HDR A100 nodes
and 8 x 50 = 400 GB/s on NDR H100 nodes. Measured: a 1 GB all-reduce over 2 H100 nodes took
0.27 s with 1 GPU per node, 0.13 s with 2 and 0.067 s with 4 (NVIDIA/nccl issue #1250): the time
halves with each doubling of the ranks per node, as k NICs side by side predict. A group with one
rank per node (replicas) has one NIC per ring: k = 1. The public-runs corpus
(benchmarks/public_runs.py) found this: priced at one NIC, FSDP over 64-128 A100s could not reach
the published tokens/s at any efficiency.
"""
from __future__ import annotations

import math

from ...config.cluster import HOST_STEP_RATE, LATENCY_INTER, LATENCY_INTRA, PCIE_BW  # noqa: F401 - the links' figures


def ring(kind: str, nbytes: float, n: int, bw: float) -> float:
    if n <= 1:
        return 0.0
    factor = 2 * (n - 1) / n if kind == "all_reduce" else (n - 1) / n
    return factor * nbytes / bw


class Links:
    """The links a group of ranks crosses. Groups are consecutive ranks (ParallelDims keeps
    dp_shard x tp blocks inside a scale-up domain or on whole ones); replica groups take one rank
    from each shard group. The scale-up domain (Cluster.domain) is the node on HGX-class machines
    and a rack of 18 trays on NVL72: every link figure below that says "node" means it."""

    def __init__(self, cluster):
        self.c = cluster

    def bw(self, n: int) -> float:
        """A group of n consecutive ranks stays inside a scale-up domain if n <= its GPUs (NVLink);
        else it spans whole domains with all of each domain's ranks in it, k = the domain's GPUs
        rings side by side through as many NICs (bus bandwidth: the module docstring)."""
        g, dom = self.c.gpu, self.c.domain
        if n <= dom:
            return g.intra_node_bw
        return min(g.intra_node_bw, dom * g.inter_node_bw)

    def latency(self, n: int) -> float:
        if n <= 1:
            return 0.0
        g = self.c.gpu
        lat = g.intra_node_latency if n <= self.c.domain else g.inter_node_latency
        return lat * math.log2(n)

    def collective(self, kind: str, nbytes: float, n: int, count: int = 1) -> float:
        """`count` collectives moving `nbytes` in total over groups of n ranks."""
        return ring(kind, nbytes, n, self.bw(n)) + count * self.latency(n)

    def across_replicas(self, kind: str, nbytes: float, replicas: int, count: int = 1) -> float:
        """Replica groups take one rank from each shard group: across the network when the world has
        more than one scale-up domain, else over NVLink."""
        if replicas <= 1:
            return 0.0
        inter = self.c.domains > 1
        bw = self.c.gpu.inter_node_bw if inter else self.c.gpu.intra_node_bw
        lat = self.c.gpu.inter_node_latency if inter else self.c.gpu.intra_node_latency
        return ring(kind, nbytes, replicas, bw) + count * lat * math.log2(replicas)
