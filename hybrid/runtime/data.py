"""Synthetic training data that needs no download (demo, examples, tests)."""
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
