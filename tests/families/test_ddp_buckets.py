"""DDP's gradient buckets as torch makes them (the count the comm and host terms price)."""
import pytest
import torch
import torch.distributed as dist

from hybrid.config.cluster import Cluster
from hybrid.config.spec import TrainSpec
from hybrid.families.catalogue import load_catalogue
from hybrid.model.profile import build_profile
from hybrid.runtime.launch import free_port

pytestmark = pytest.mark.gloo


def test_ddp_buckets_are_counted_as_torch_makes_them():
    """bucket_cap_mb is MiB in torch's DDP: 25.5e6 bytes of fp32 gradients fill one 25 MiB bucket
    (two if a MB were 1e6 bytes), as torch's own reducer reports."""
    m = torch.nn.Module()
    m.a, m.b = torch.nn.Parameter(torch.zeros(3_187_500)), torch.nn.Parameter(torch.zeros(3_187_500))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(m, bucket_cap_mb=25.0)
        sizes = [int(x) for x in str(ddp._get_ddp_logging_data()["bucket_sizes"]).split(",")]
    finally:
        dist.destroy_process_group()
    s = load_catalogue()["ddp"]
    host = s.family_obj.host(s, build_profile(m), TrainSpec(precision="fp32"), Cluster(nodes=1, gpus_per_node=2), 1)
    assert sizes == [25_500_000] and host.calls == len(sizes)
