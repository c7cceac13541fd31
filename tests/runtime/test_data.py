"""ResumableSampler: DistributedSampler's order, and a state that carries it to another world size."""
import pytest
from torch.utils.data import DistributedSampler

from hybrid.errors import HybridError
from hybrid.runtime.data import ResumableSampler

pytestmark = pytest.mark.torch

N, SEED = 23, 3


@pytest.mark.parametrize("drop_last", [True, False])
@pytest.mark.parametrize("shuffle", [True, False])
def test_the_order_is_distributed_samplers(drop_last, shuffle):
    for epoch in (0, 4):
        for rank in range(3):
            ours = ResumableSampler(N, 3, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            torchs = DistributedSampler(range(N), 3, rank, shuffle=shuffle, seed=SEED, drop_last=drop_last)
            ours.set_epoch(epoch)
            torchs.set_epoch(epoch)
            assert list(ours) == list(torchs) and len(ours) == len(torchs), (epoch, rank)


def test_a_state_saved_on_two_ranks_continues_on_three():
    two = [ResumableSampler(N, 2, r, seed=SEED) for r in range(2)]
    first = [list(s)[:4] for s in two]          # each rank's first 4 samples
    for s in two:
        s.advance(4)
    three = [ResumableSampler(N, 3, r, seed=SEED) for r in range(3)]
    for s in three:
        s.load_state_dict(two[0].state_dict())
    rest = [i for s in three for i in s]
    seen = sorted(i for part in first for i in part) + sorted(rest)
    assert len(seen) == len(set(seen)) and len(rest) == (N - 8) // 3 * 3


@pytest.mark.parametrize("state, match", [
    ({"epoch": 0, "position": 0, "length": 47, "seed": SEED, "shuffle": True}, "length=47"),
    ({"epoch": 0, "position": 0, "length": N, "seed": 9, "shuffle": True}, "seed=9"),
    ({"epoch": -1, "position": 0, "length": N, "seed": SEED, "shuffle": True}, "epoch must be"),
    ("x", "takes the dict"),
])
def test_a_sampler_state_of_another_order_is_refused(state, match):
    with pytest.raises(HybridError, match=match):
        ResumableSampler(N, 2, 0, seed=SEED).load_state_dict(state)


def test_bad_arguments_are_one_line():
    with pytest.raises(HybridError, match="rank must be in 0..1"):
        ResumableSampler(N, 2, 2)
