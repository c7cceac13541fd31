"""Test tiers (ARCHITECTURE.md): every test gets one of the markers unit, torch, fakepg, gloo (or gpu).

    pytest -m unit        pure estimation: no torch, DeepSpeed, transformers or accelerate imported,
                          no process group (it runs where torch is not installed, and
                          `pytest -m unit --no-torch` checks that where torch is); without the tests
                          marked `slow`, `-m "unit and not slow"`, it is the fast subset
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
import importlib.util
import itertools
import os
import re
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


WORKERS_ENV = "HYBRID_TEST_WORKERS"
"""Worker processes (pytest-xdist) for a run of the whole suite or a marker selection of it: this
variable, else one more than the CPUs this process may use, at most 4 (the gloo tests' launches and
bounded waits leave a core idle: the whole suite on 2 cores took 827 s with 2 workers, 768 s with 3).
`-n N` on the command line wins (`-n 0`: one process); a run naming files or tests runs in one process
unless it passes `-n`."""


def workers(env=os.environ, cpus=None) -> int:
    if env.get(WORKERS_ENV, "").strip():
        value = env[WORKERS_ENV].strip()
        if not value.isdigit():
            raise pytest.UsageError(f"{WORKERS_ENV}={value!r}: a whole number of worker processes (0: none)")
        return int(value)
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 1
    return min(cpus + 1, 4)


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """The whole suite (or `-m TIER` of it) is spread over worker processes where pytest-xdist is
    installed (the dev extra): on 2 cores the gloo ranks' start-ups and waits overlap the other
    worker's tests. Each worker takes tests as it goes idle (`--dist worksteal`)."""
    if not config.pluginmanager.hasplugin("xdist") or os.environ.get("PYTEST_XDIST_WORKER"):
        return None
    opt = config.option
    if opt.numprocesses is not None or opt.collectonly or opt.usepdb or opt.tx:
        return None
    if config.args_source != pytest.Config.ArgsSource.TESTPATHS:
        return None
    n = workers()
    if n > 1:
        opt.numprocesses = n
        if opt.dist == "no":
            opt.dist = "worksteal"
    return None


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


RANK_PRELOAD = ("deepspeed", "hybrid.auto", "hybrid.ckpt.store", "hybrid.model.decoder", "hybrid.runtime.backends.ddp",
                "hybrid.runtime.backends.fsdp", "hybrid.runtime.backends.deepspeed", "hybrid.runtime.backends.tp",
                "hybrid.runtime.backends.cp", "hybrid.runtime.backends.ep", "hybrid.runtime.backends.pipeline",
                "torch._dynamo", "torch._inductor.compile_fx", "torch._functorch.aot_autograd",
                *(f"transformers.models.{m}.modeling_{m}" for m in (
                    "llama", "qwen3", "qwen2", "mixtral", "qwen3_moe", "qwen2_moe", "gemma3", "deepseek_v3", "gpt2")))
"""What the ranks of run_ranks import in (nearly) every test: imported once by the fork server of each
test process (hybrid.runtime.launch.preload) instead of by every rank of every launch. Measured on the
gloo tier (226 rank runs): torch._dynamo, which FSDP2 and checkpointing import, in 221 of them (0.6 s
of CPU each) and torch._inductor's compile_fx with it (1.3 s more), and transformers' modeling code in
38 (3.2 s each); the transformers decoders the tests build are listed (a module missing from the
installed transformers is skipped by the fork server)."""


def pytest_runtest_setup(item):
    """Before the first test of a tier that launches ranks (torch's import is theirs, not the unit tier's)."""
    if not _PRELOADED and {m.name for m in item.iter_markers()} & {"torch", "fakepg", "gloo", "gpu"}:
        from hybrid.runtime.launch import preload
        preload(*RANK_PRELOAD)
        _PRELOADED.append(True)


_PRELOADED: list = []


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


FREE_MARKERS = ("safety", "slow")
"""Markers beside the tier: `safety` (data loss, code execution, hangs, tracebacks) and `slow` (one test
over ~5 s on 2 cores: plans of thousand-GPU clusters, subprocesses; in the full suite, not in the fast
subset `-m "unit and not slow"`)."""


def only_unit(markexpr: str) -> bool:
    """Whether a `-m` expression can select unit tests only: false for every test of another tier
    (with or without each FREE_MARKERS marker). An expression naming any other marker is not judged (False)."""
    names = set(re.findall(r"[A-Za-z_]\w*", markexpr)) - {"and", "or", "not"}
    if not names or not names <= {*TIERS, *FREE_MARKERS} or re.search(r"[^\w\s()]", markexpr):
        return False
    code = compile(markexpr, "<-m>", "eval")
    free = [dict(zip(FREE_MARKERS, values)) for values in itertools.product((False, True), repeat=len(FREE_MARKERS))]
    return not any(eval(code, {"__builtins__": {}}, {**dict.fromkeys(names, False), tier: True, **f})
                   for tier in TIERS if tier != "unit" for f in free)


def pytest_ignore_collect(collection_path, config):
    """A test module that holds no unit test is not imported where only unit tests can run: without
    torch, and under `-m unit` (so that the fast subset imports no torch, 50 s of collection on 2 cores)."""
    if collection_path.suffix == ".py" and collection_path.name.startswith("test_") and (
            only_unit(config.option.markexpr or "") or not _torch()):
        return "mark.unit" not in collection_path.read_text(encoding="utf-8")
    return None


def pytest_report_header(config):
    try:                                    # found, not imported: the unit tier never imports torch
        found = importlib.util.find_spec("torch") is not None
    except ImportError:                     # blocked by --no-torch
        found = False
    if not found:
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
    if getattr(config.option, "numprocesses", None):
        items[:] = heavy_modules_first(items)


HEAVY_MARKERS = ("gloo", "slow")
"""A test module holding a test with one of these (ranks launched, or over ~5 s) is heavy."""


def heavy_modules_first(items: list) -> list:
    """Spread over workers, the heavy modules run first, each module's tests together (its fixtures are made
    once): pytest-xdist's worksteal hands each worker a contiguous part of the list and lets an idle worker take
    the end of a busy one's, so light tests left for the end keep both cores busy to the last test rather than
    one worker finishing a minute-long test alone."""
    heavy = {item.module.__name__ for item in items if getattr(item, "module", None) is not None
             and any(m.name in HEAVY_MARKERS for m in item.iter_markers())}
    return sorted(items, key=lambda item: getattr(getattr(item, "module", None), "__name__", "") not in heavy)
