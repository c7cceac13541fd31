"""Frozen parameters (a LoRA base) are all-gathered like any other: FSDP2 and ZeRO-3 price them."""
import pytest
import torch

from hybrid.runtime.launch import run_ranks

pytestmark = pytest.mark.gloo


def _model(frozen: bool):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    if frozen:                  # LoRA-shaped: every layer's weight frozen, a small trainable part in each
        for layer in m:
            layer.weight.requires_grad_(False)
    return m


def _gathered_bytes(frozen: bool) -> int:
    """Bytes FSDP2 all-gathers over one forward and backward of a 3-unit model on this rank."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    from hybrid.runtime.mesh import init_distributed
    init_distributed()
    m = _model(frozen)
    for block in m:
        fully_shard(block)
    fully_shard(m)
    seen = [0]
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]   # torch 2.13, older
    real = {n: getattr(dist, n) for n in names}

    def counting(name):
        def gather(out, *args, **kwargs):
            seen[0] += out.numel() * out.element_size()
            return real[name](out, *args, **kwargs)
        return gather
    for n in names:
        setattr(dist, n, counting(n))
    try:
        m(torch.randn(4, 64)).sum().backward()
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return seen[0]


def test_frozen_parameters_are_gathered_and_priced():
    torch_full, torch_frozen = (run_ranks(2, _gathered_bytes, f)[0] for f in (False, True))
    assert torch_full == torch_frozen > 0             # torch gathers the frozen weights as any other

    from hybrid.config.cluster import Cluster
    from hybrid.config.spec import TrainSpec
    from hybrid.estimation.cost.links import Links
    from hybrid.families.catalogue import load_catalogue
    from hybrid.model.profile import build_profile
    cluster, spec, cat = Cluster(nodes=1, gpus_per_node=2), TrainSpec(precision="fp32"), load_catalogue()
    full, frozen = build_profile(_model(False)), build_profile(_model(True))
    assert frozen.trainable_params < full.trainable_params / 5
    for name in ("fsdp", "zero3"):
        s = cat[name]
        a, b = (s.family_obj.comm(s, p, spec, cluster, 2, Links(cluster)) for p in (full, frozen))
        assert b.fwd == a.fwd > 0, name                 # the forward's gathers do not shrink with trainable params
        assert b.bwd + b.sync_bwd < a.bwd + a.sync_bwd, name   # the gradients' reduction does
