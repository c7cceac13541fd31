"""The package's shape: no import cycles, the plan path imports no torch, no family branching."""
import ast
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid")


def _module_imports():
    """module -> the hybrid modules it imports, at import time or inside functions (a lazy import
    is still a dependency); `if TYPE_CHECKING:` blocks are left out (they never run)."""
    graph = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
            mod = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            pkg = mod if f == "__init__.py" else mod.rsplit(".", 1)[0]
            tree = ast.parse(open(path).read())
            deps = set()
            skip = {id(n) for top in tree.body if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
                    for n in ast.walk(top)}
            for node in ast.walk(tree):
                if id(node) in skip:
                    continue
                if isinstance(node, ast.ImportFrom) and node.level:
                    base = pkg.split(".")
                    base = base[:len(base) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                    deps.add(target)
                    deps.update(f"{target}.{a.name}" for a in node.names)
                elif isinstance(node, ast.Import):
                    deps.update(a.name for a in node.names if a.name.startswith("hybrid"))
            graph[mod] = deps
    return {m: {d for d in deps if d in graph and d != m} for m, deps in graph.items()}


def test_no_import_cycles():
    graph = _module_imports()
    state, stack = {}, []

    def visit(m):
        state[m] = "open"
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == "open" and not m.startswith(d + ".") and d != m.rsplit(".", 1)[0]:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = "done"
    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_plan_path_imports_no_torch():
    code = ("import sys, io, contextlib\nfrom hybrid.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            "    assert main(['plan', 'llama2-7b', '--nodes', '8', '--emit', 'deepspeed']) == 0\n"
            "    assert main(['plan', 'llama2-7b', '--nodes', '8', '--emit', 'fsdp']) == 0\n"
            "    assert main(['compare', 'gpt2']) == 0\n"
            "print('torch' in sys.modules, 'deepspeed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "False"], out.stderr[-1000:]


def test_nothing_outside_the_registry_branches_on_a_family_name():
    """`family == "ddp"`-style tests live only in hybrid/families/ (and the YAML)."""
    offenders = []
    for dirpath, _, files in os.walk(ROOT):
        if os.path.basename(dirpath) == "families":
            continue
        for f in files:
            if f.endswith(".py"):
                text = open(os.path.join(dirpath, f)).read()
                for needle in ('family == "', "family != \"", 'family in ("', "_LAYOUTS"):
                    if needle in text:
                        offenders.append(f"{f}: {needle}")
    assert not offenders, offenders


def test_estimators_do_not_import_the_auto_wrap_entry_point():
    """Traced and measured estimation build on the runtime pieces, never on auto_wrap itself."""
    graph = _module_imports()
    for mod in ("hybrid.memory.traced", "hybrid.memory.measured", "hybrid.memory.driver", "hybrid.memory.tracker"):
        seen, todo = set(), [mod]
        while todo:
            m = todo.pop()
            for d in graph.get(m, ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        assert "hybrid.auto" not in seen, f"{mod} reaches hybrid.auto"
