"""Test tiers (ARCHITECTURE.md): every test gets one of the markers unit, fakepg, gloo (or gpu).

    pytest -m unit        pure estimation, no process group (the fast subset, under a minute)
    pytest -m fakepg      fake process group + fake tensors
    pytest -m gloo        real CPU ranks
    pytest                everything (the README's test command)

Every test carries exactly one tier (its own mark, or its module's `pytestmark`): collection fails
otherwise, so no test lands in a tier by accident.
"""
import pytest

TIERS = ("unit", "fakepg", "gloo", "gpu")


def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {', '.join(sorted(tiers)) or 'no tier'}")
        if "gpu" in tiers:
            import torch
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
    if wrong:
        raise pytest.UsageError("every test needs exactly one tier marker (unit, fakepg, gloo, gpu):\n  "
                                + "\n  ".join(wrong))
