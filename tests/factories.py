"""Model factories addressed as `tests.factories:NAME` in tests."""
import torch.nn as nn


def small_mlp():
    return nn.Sequential(nn.Linear(10, 20), nn.ReLU(), nn.Linear(20, 2))


def frozen():
    m = nn.Linear(4, 4)
    m.requires_grad_(False)
    return m
