"""GPU catalogue, memory strings, and detection of this (CPU) machine."""
import pytest

from hybrid.config.cluster import GPUS, Cluster, get_gpu
from hybrid.errors import HybridError
from hybrid.units import GiB, fmt_bytes, parse_bytes, parse_count

pytestmark = pytest.mark.unit


def test_catalogue_has_the_common_gpus():
    assert {"a100-40gb", "a100-80gb", "h100-80gb", "h200-141gb", "l40s-48gb"} <= set(GPUS)
    h100 = get_gpu("H100-80GB")
    assert 79 * GiB < h100.memory_bytes < 80 * GiB and h100.bf16_flops == 989e12
    assert h100.intra_node_bw > h100.inter_node_bw


@pytest.mark.parametrize("text,value", [("80GiB", 80 * GiB), ("80GB", 80e9), ("40960MiB", 40 * GiB),
                                        ("8.5e10", 85e9), (" 1.5 tib ", 1.5 * 1024**4)])
def test_parse_bytes(text, value):
    assert parse_bytes(text) == int(value)


@pytest.mark.parametrize("bad", ["", "GiB", "80 GiBs", "-3GB", "0"])
def test_parse_bytes_rejects(bad):
    with pytest.raises(HybridError, match="memory size"):
        parse_bytes(bad)


def test_counts_and_formatting():
    assert parse_count("7B") == 7_000_000_000 and parse_count("125M") == 125_000_000
    assert fmt_bytes(3 * GiB) == "3.0 GiB" and fmt_bytes(None) == "unknown"


def test_cluster_build_and_errors():
    c = Cluster.build(2, 4, "a100-40gb", gpu_memory="38GiB")
    assert c.world_size == 8 and c.capacity_bytes == 38 * GiB
    with pytest.raises(HybridError, match="nodes must be a positive integer, got 0"):
        Cluster.build(0, 8)


