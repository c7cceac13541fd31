"""Test tiers (ARCHITECTURE.md): every test gets one of the markers unit, torch, fakepg, gloo (or gpu).

    pytest -m unit        pure estimation: no torch, DeepSpeed, transformers or accelerate imported,
                          no process group (the fast subset; it runs where torch is not installed,
                          and `pytest -m unit --no-torch` checks that where torch is)
    pytest -m torch       one process with torch (real or meta modules, tensors, the libraries'
                          own estimators), no process group
    pytest -m fakepg      fake process group + fake tensors
    pytest -m gloo        real CPU ranks
    pytest -m gpu         a CUDA device (skipped without one)
    pytest                everything (the README's test command)

Every test carries exactly one tier (its own mark, or its module's `pytestmark`): collection fails
otherwise, so no test lands in a tier by accident. Where torch cannot be imported, test modules that
hold no unit test are not collected (nothing in them could run); one that does must import no torch.
"""
import functools
import importlib.abc
import os
import sys

import pytest

TIERS = ("unit", "torch", "fakepg", "gloo", "gpu")
# torch and the libraries built on it: the unit tier imports none of them (--no-torch blocks them)
HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "torchao", "torchtitan")


class BlockHeavy(importlib.abc.MetaPathFinder):
    """Imports of HEAVY fail as if they were not installed."""

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in HEAVY:
            raise ModuleNotFoundError(f"No module named {name!r} (blocked by --no-torch)", name=name)
        return None


def pytest_addoption(parser):
    parser.addoption("--no-torch", action="store_true",
                     help="import none of " + ", ".join(HEAVY) + " (as where they are not installed): "
                          "`pytest -m unit --no-torch` checks that the unit tier needs none of them")


def pytest_configure(config):
    if config.getoption("--no-torch"):
        loaded = sorted(m for m in sys.modules if m.split(".")[0] in HEAVY)
        if loaded:
            raise pytest.UsageError(f"--no-torch: {loaded[0]} was imported before the tests (by a plugin?)")
        sys.meta_path.insert(0, BlockHeavy())
    _extension_cache()


def _extension_cache():
    """Every test process, and what it starts (deepspeed, the HF Trainer), builds DeepSpeed's ops in
    this environment's cache, its stale build locks cleared first (a stale lock elsewhere is one line)."""
    from hybrid.errors import HybridError
    from hybrid.runtime.extensions import default_root, extension_cache, is_own, ready
    root = extension_cache(os.environ)
    try:
        ready(root or default_root(), own=is_own(root))
    except HybridError as e:
        raise pytest.UsageError(str(e)) from None


@functools.cache
def _torch() -> bool:
    """torch can be imported here (installed, and not blocked by --no-torch)."""
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _cuda() -> bool:
    if not _torch():
        return False
    import torch
    return torch.cuda.is_available()


def pytest_ignore_collect(collection_path, config):
    """Without torch only unit tests can run: a test module that holds none is not imported."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and not _torch():
        return "mark.unit" not in collection_path.read_text(encoding="utf-8")
    return None


def pytest_report_header(config):
    if not _torch():
        return "torch not importable: only test modules holding unit tests are collected"
    return None


def pytest_collection_modifyitems(config, items):
    wrong = []
    for item in items:
        tiers = {m.name for m in item.iter_markers() if m.name in TIERS}
        if len(tiers) != 1:
            wrong.append(f"{item.nodeid}: {', '.join(sorted(tiers)) or 'no tier'}")
        if "gpu" in tiers and not _cuda():
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
    if wrong:
        raise pytest.UsageError("every test needs exactly one tier marker (" + ", ".join(TIERS) + "):\n  "
                                + "\n  ".join(wrong))
