"""Test tiers (ARCHITECTURE.md): every test gets one of the markers unit, fakepg, gloo (or gpu).

    pytest -m unit        pure estimation, no process group (the fast subset, under a minute)
    pytest -m fakepg      fake process group + fake tensors
    pytest -m gloo        real CPU ranks
    pytest                everything (the README's test command)

A test marked in its file keeps its marker; the others take their module's tier below.
"""
import pytest

TIERS = ("unit", "fakepg", "gloo", "gpu")
MODULE_TIER = {"test_backends": "gloo", "test_checkpoint": "gloo", "test_examples": "gloo", "test_loop": "gloo",
               "test_mesh": "gloo", "test_traced": "fakepg"}


def pytest_collection_modifyitems(config, items):
    for item in items:
        if not any(item.get_closest_marker(t) for t in TIERS):
            item.add_marker(getattr(pytest.mark, MODULE_TIER.get(item.module.__name__.split(".")[-1], "unit")))
        if item.get_closest_marker("gpu"):
            import torch
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
