"""Training data: a synthetic corpus that needs no download (demo, examples, tests), and a
sampler with DistributedSampler's order that resumes at any world size."""
from __future__ import annotations

import torch
from torch.utils.data import TensorDataset


def synthetic_corpus(n: int, seq: int, vocab: int, seed: int = 0, fanout: int = 4) -> TensorDataset:
    """Sequences from a fixed random sparse bigram model (each token has `fanout` likely
    successors): learnable structure, so the loss visibly goes down; identical on every run."""
    g = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, vocab, (vocab, fanout), generator=g)
    tokens = torch.empty(n, seq, dtype=torch.long)
    tokens[:, 0] = torch.randint(0, vocab, (n,), generator=g)
    for t in range(1, seq):
        pick = torch.randint(0, fanout, (n,), generator=g)
        tokens[:, t] = successors[tokens[:, t - 1], pick]
    return TensorDataset(tokens)


class ResumableSampler(torch.utils.data.Sampler):
    """DistributedSampler's order (torch.utils.data.DistributedSampler, torch 2.x: one permutation
    of the dataset per epoch, seeded by seed + epoch; rank r of R reads positions r, r + R, ...)
    that a checkpoint can carry to another world size. Its state is the epoch and the position in
    global samples; on load the rest of the epoch is re-split over the new ranks, so the samples
    continue exactly where they stopped: none seen twice, none skipped. The loop reports what it
    consumed with advance(local samples) after each micro-batch (a DataLoader prefetches, so the
    sampler cannot tell by itself); save state_dict() at a window boundary in Wrapped.save(extra=).

        sampler = ResumableSampler(len(data), w.dp_size, w.dp_rank, seed=0)
        loader = DataLoader(data, batch_size=w.micro_batch, sampler=sampler)
        ...  sampler.advance(len(batch))  ...  w.save(path, extra={"sampler": sampler.state_dict()})
        sampler.load_state_dict(w.load(path)["sampler"])
    """

    def __init__(self, length: int, num_replicas: int, rank: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True):
        from ..errors import HybridError
        for name, v, low in (("length", length, 1), ("num_replicas", num_replicas, 1), ("seed", seed, 0)):
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise HybridError(f"ResumableSampler: {name} must be an integer >= {low}, got {v!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
            raise HybridError(f"ResumableSampler: rank must be in 0..{num_replicas - 1} (num_replicas="
                              f"{num_replicas}), got {rank!r}")
        self.length, self.num_replicas, self.rank = length, num_replicas, rank
        self.shuffle, self.seed, self.drop_last = bool(shuffle), seed, bool(drop_last)
        self.epoch = 0
        self.position = 0
        """Global samples of this epoch consumed (by every rank together)."""

    def set_epoch(self, epoch: int) -> None:
        """As DistributedSampler's; a new epoch starts at its first sample, the same one continues."""
        if epoch != self.epoch:
            self.epoch, self.position = epoch, 0

    def order(self) -> list[int]:
        """This epoch's global order of sample indices."""
        if not self.shuffle:
            return list(range(self.length))
        g = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(self.length, generator=g).tolist()

    def _remaining(self) -> int:
        """Samples each rank reads from the position to the epoch's end (padded by wrapping, as
        DistributedSampler pads, unless drop_last)."""
        left = max(0, self.length - self.position)
        return left // self.num_replicas if self.drop_last else -(-left // self.num_replicas)

    def __len__(self) -> int:
        return self._remaining()

    def __iter__(self):
        order = self.order()
        rest = order[self.position:]
        n = self._remaining()
        if not self.drop_last and len(rest) < n * self.num_replicas:
            pad = n * self.num_replicas - len(rest)
            rest = rest + (order * (pad // len(order) + 1))[:pad]
        return iter(rest[self.rank:n * self.num_replicas:self.num_replicas])

    def advance(self, local_samples: int) -> None:
        """Record that every rank consumed `local_samples` more (call it on every rank alike)."""
        self.position += local_samples * self.num_replicas

    def state_dict(self) -> dict:
        """Plain data (JSON-safe: it goes into the checkpoint's meta.json through extra=)."""
        return {"epoch": self.epoch, "position": self.position, "length": self.length, "seed": self.seed,
                "shuffle": self.shuffle, "drop_last": self.drop_last, "num_replicas": self.num_replicas}

    def load_state_dict(self, state: dict) -> None:
        """Continue at the saved epoch and global position, whatever num_replicas saved it."""
        from ..errors import HybridError, short
        if not isinstance(state, dict):
            raise HybridError(f"ResumableSampler.load_state_dict takes the dict state_dict() returned, got "
                              f"{short(state, 40)}")
        for key, want in (("length", self.length), ("seed", self.seed), ("shuffle", self.shuffle)):
            if state.get(key) != want:
                raise HybridError(f"ResumableSampler: the saved state has {key}={short(state.get(key), 40)} and this "
                                  f"sampler {want!r}; the order would differ: build it with the same {key}")
        epoch, position = state.get("epoch"), state.get("position")
        for name, v in (("epoch", epoch), ("position", position)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise HybridError(f"ResumableSampler: saved {name} must be an integer >= 0, got {short(v, 40)}")
        self.epoch, self.position = epoch, position
