"""Where torchft is not installed, fault_tolerant=True is one line naming the extra (before any process group)."""
import sys

import pytest

pytestmark = pytest.mark.torch


def test_without_torchft_fault_tolerant_names_the_extra(monkeypatch):
    from hybrid import auto_wrap
    from hybrid.errors import HybridError
    from hybrid.model.decoder import build_decoder
    from tests.runtime.test_backends import TINY
    monkeypatch.setitem(sys.modules, "torchft", None)           # import torchft now fails as if absent
    with pytest.raises(HybridError, match=r"^fault_tolerant=True needs torchft, which is not installed: "
                                          r"pip install 'hybrid\[ft\]'$"):
        auto_wrap(build_decoder(TINY, seed=0), strategy="fsdp", fault_tolerant=True, verbose=False)
    import torch.distributed as dist
    assert not dist.is_initialized()


def test_fault_tolerant_needs_the_lighthouse_address(monkeypatch):
    from hybrid.errors import HybridError
    from hybrid.runtime.ft import ReplicaEnv
    with pytest.raises(HybridError, match="needs TORCHFT_LIGHTHOUSE"):
        ReplicaEnv.read({})
    with pytest.raises(HybridError, match=r"REPLICA_GROUP_ID=2 must be below NUM_REPLICA_GROUPS=2"):
        ReplicaEnv.read({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1", "REPLICA_GROUP_ID": "2",
                         "NUM_REPLICA_GROUPS": "2"})
    with pytest.raises(HybridError, match=r"NUM_REPLICA_GROUPS='x' must be a non-negative integer"):
        ReplicaEnv.read({"TORCHFT_LIGHTHOUSE": "http://127.0.0.1:1", "NUM_REPLICA_GROUPS": "x"})
    assert ReplicaEnv.read({"TORCHFT_LIGHTHOUSE": "http://h:1", "REPLICA_GROUP_ID": "1",
                            "NUM_REPLICA_GROUPS": "3"}) == ReplicaEnv("http://h:1", 1, 3)
