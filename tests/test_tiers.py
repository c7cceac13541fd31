"""The unit tier needs no torch: collected with torch, DeepSpeed, transformers, accelerate, torchao
and torchtitan blocked (conftest's --no-torch), every unit test module imports, and every module a
unit test (or a test helper it calls) imports in its body imports too. The full proof, the tier run
with the block, is `pytest -m unit --no-torch` (docs/development.md)."""
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Runs under pytest's own collection of the unit tier, with conftest's block in place.
CHECK = r'''
import ast, importlib, inspect, sys, textwrap, types
import pytest

HEAVY = ("torch", "deepspeed", "transformers", "accelerate", "torchao", "torchtitan")


def imports(fn, seen):
    """(module, where) for each import statement in fn's body and in the test helpers it names."""
    if fn in seen:
        return
    seen.add(fn)
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((a.name, fn.__qualname__) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            yield node.module, fn.__qualname__
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "importorskip" and node.args
              and isinstance(node.args[0], ast.Constant) and str(node.args[0].value).split(".")[0] in HEAVY):
            yield node.args[0].value, fn.__qualname__
        elif isinstance(node, ast.Name):
            g = fn.__globals__.get(node.id)
            if isinstance(g, types.FunctionType) and g.__module__.split(".")[0] in (fn.__module__, "tests"):
                yield from imports(g, seen)


class Check:
    def pytest_collection_finish(self, session):
        bad = []
        for item in session.items:
            seen = set()
            for name, where in imports(item.function, seen):
                try:
                    importlib.import_module(name)
                except ImportError as e:
                    bad.append(f"{item.nodeid}: {where} imports {name}: {e}")
        print("\n".join(["unit tests that need torch:"] + sorted(set(bad))) if bad else "no unit test needs torch")
        session.shouldfail = bool(bad) and "unit tests need torch"


sys.exit(pytest.main(["--co", "-q", "-p", "no:cacheprovider", "-m", "unit", "--no-torch"] + sys.argv[1:],
                     plugins=[Check()]))
'''


def check(*args, cwd=ROOT):
    return subprocess.run([sys.executable, "-c", CHECK, *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.mark.slow
def test_the_unit_tier_imports_no_torch():
    r = check()
    assert r.returncode == 0 and "no unit test needs torch" in r.stdout, (r.stdout + r.stderr)[-3000:]
    assert "error" not in r.stdout.splitlines()[-1], r.stdout[-2000:]


BAD_TOP = "import pytest\nimport torch\n\npytestmark = pytest.mark.unit\n\n\ndef test_top():\n    assert torch\n"
BAD_BODY = '''import pytest


def helper():
    from hybrid.model.decoder import build_decoder
    return build_decoder


@pytest.mark.unit
def test_body():
    assert helper()


@pytest.mark.torch
def test_torch_tier_may():
    import torch
    assert torch
'''


@pytest.mark.slow
def test_the_check_names_a_unit_test_that_imports_torch(tmp_path):
    """The check can fail: a unit module importing torch, a unit test whose helper imports a module
    built on torch (and not the torch-tier test beside it)."""
    (tmp_path / "test_bad_top.py").write_text(BAD_TOP)
    (tmp_path / "test_bad_body.py").write_text(BAD_BODY)
    r = check("-p", "tests.conftest", "--rootdir", str(tmp_path), str(tmp_path))
    out = r.stdout + r.stderr
    assert r.returncode != 0, out[-3000:]
    assert "test_bad_top.py" in out and "No module named 'torch' (blocked by --no-torch)" in out, out[-3000:]
    assert "test_bad_body.py::test_body: helper imports hybrid.model.decoder" in out, out[-3000:]
    assert "test_torch_tier_may" not in out, out[-3000:]


@pytest.mark.unit
def test_the_fast_subset_expression_selects_unit_tests_only():
    """`-m "unit and not slow"` (the fast subset) is judged unit-only, so no module of another tier is
    imported for it; an expression that can select a test of another tier is not."""
    from tests.conftest import only_unit
    assert only_unit("unit and not slow") and only_unit("unit") and only_unit("unit and safety")
    assert not only_unit("not slow") and not only_unit("unit or slow") and not only_unit("torch or unit")
