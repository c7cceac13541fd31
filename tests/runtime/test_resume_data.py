"""A job resumed at another world size continues its sample order exactly, at the same global batch."""
import logging

import pytest
import torch

from hybrid.runtime.launch import run_ranks
from hybrid.model.decoder import build_decoder
from tests.runtime.test_backends import TINY

pytestmark = pytest.mark.gloo

N, SEQ, GB, MB, SEED = 48, 16, 8, 2, 3


def phase(path, steps, resume):
    """`steps` optimizer steps of the loop users write, fed by ResumableSampler; the sample ids of
    each step over every rank, the global batch and accumulation, and the RNG log line."""
    import torch.distributed as dist
    from torch.utils.data import DataLoader, TensorDataset

    from hybrid import auto_wrap
    from hybrid.runtime.data import ResumableSampler
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hybrid").addHandler(handler)
    w = auto_wrap(build_decoder(TINY, seed=0), optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3),
                  strategy="ddp", precision="fp32", micro_batch=MB, seq_len=SEQ, global_batch=GB, verbose=False)
    tokens = torch.randint(0, 512, (N, SEQ), generator=torch.Generator().manual_seed(0))
    data = TensorDataset(torch.arange(N), tokens)
    sampler = ResumableSampler(N, w.dp_size, w.dp_rank, seed=SEED)
    if resume:
        sampler.load_state_dict(w.load(path)["sampler"])
    loader = DataLoader(data, batch_size=w.micro_batch, sampler=sampler, drop_last=True)
    seen, window, epoch = [], [], sampler.epoch
    while len(seen) < steps:
        sampler.set_epoch(epoch)
        for idx, ids in loader:
            end = w.sync_gradients
            w.backward(w(ids, labels=ids).loss)
            w.step()
            w.zero_grad()
            sampler.advance(len(idx))
            window += idx.tolist()
            if end:
                everyone = [None] * dist.get_world_size()
                dist.all_gather_object(everyone, window)
                seen.append((epoch, sorted(i for part in everyone for i in part)))
                window = []
                if len(seen) == steps:
                    break
        else:
            epoch += 1
    w.save(path, extra={"sampler": sampler.state_dict()})
    logging.getLogger("hybrid").removeHandler(handler)
    return {"seen": seen, "global_batch": w.global_batch, "ga": w.gradient_accumulation,
            "rng": [x for x in lines if "RNG" in x]}


def test_samples_continue_exactly_across_two_one_two_ranks(tmp_path):
    path = str(tmp_path / "ck")
    a = run_ranks(2, phase, path, 4, False)[0]
    b = run_ranks(1, phase, path, 5, True)[0]
    c = run_ranks(2, phase, path, 5, True)[0]
    assert (a["ga"], b["ga"], c["ga"]) == (2, 4, 2)
    assert a["global_batch"] == b["global_batch"] == c["global_batch"] == GB
    steps = a["seen"] + b["seen"] + c["seen"]
    assert all(len(ids) == GB for _, ids in steps)
    by_epoch: dict = {}
    for epoch, ids in steps:
        by_epoch.setdefault(epoch, []).extend(ids)
    assert sorted(by_epoch) == [0, 1, 2]
    for epoch in (0, 1):                    # each whole epoch: every sample once
        assert sorted(by_epoch[epoch]) == list(range(N)), epoch
    perm = torch.randperm(N, generator=torch.Generator().manual_seed(SEED + 2)).tolist()
    assert sorted(by_epoch[2]) == sorted(perm[:2 * GB])           # DistributedSampler's order, continued
    assert b["rng"] and "reseeded" in b["rng"][0] and "saved on 2 ranks and this job runs 1" in b["rng"][0]
    assert c["rng"] and "reseeded" in c["rng"][0]


def same_world_rng(path):
    from hybrid import auto_wrap
    w = auto_wrap(build_decoder(TINY, seed=0), strategy="ddp", precision="fp32", micro_batch=1, seq_len=SEQ,
                  verbose=False)
    w.save(path)
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())
    logging.getLogger("hybrid").addHandler(handler)
    w.load(path)
    return [x for x in lines if "RNG" in x]


def test_a_load_at_the_same_world_size_says_the_rng_was_restored(tmp_path):
    lines = run_ranks(2, same_world_rng, str(tmp_path / "ck"))[0]
    assert len(lines) == 1 and "RNG state restored" in lines[0]
