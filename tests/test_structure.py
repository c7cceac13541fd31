"""The package's shape: no import cycles, the plan path imports no torch, no family branching."""
import ast
import os
import subprocess
import re
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "hybrid")


def import_lines(root: str = ROOT) -> list[tuple[str, int, str]]:
    """(module, line, hybrid module it imports) for every import at import time or inside a
    function (a lazy import is still a dependency); `if TYPE_CHECKING:` blocks are left out (they
    never run). A name imported from a package that is one of its modules counts as that module."""
    found, modules = [], set()
    for dirpath, _, files in os.walk(root):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(root))[:-3].replace(os.sep, ".")
                modules.add(rel[:-len(".__init__")] if rel.endswith(".__init__") else rel)
    for dirpath, _, files in os.walk(root):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            rel = os.path.relpath(path, os.path.dirname(root))[:-3].replace(os.sep, ".")
            mod = rel[:-len(".__init__")] if rel.endswith(".__init__") else rel
            pkg = mod if f == "__init__.py" else mod.rsplit(".", 1)[0]
            tree = ast.parse(open(path).read())
            skip = {id(n) for top in tree.body if isinstance(top, ast.If) and "TYPE_CHECKING" in ast.unparse(top.test)
                    for n in ast.walk(top)}
            for node in ast.walk(tree):
                if id(node) in skip:
                    continue
                targets = []
                if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("hybrid")):
                    base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
                    target = ".".join(base + ([node.module] if node.module else []))
                    subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
                    targets = subs + ([target] if len(subs) < len(node.names) else [])
                elif isinstance(node, ast.Import):
                    targets = [a.name for a in node.names if a.name.startswith("hybrid")]
                found += [(mod, node.lineno, t) for t in targets if t in modules and t != mod]
    return found


def _module_imports():
    """module -> the hybrid modules it imports (import_lines)."""
    graph = {}
    for dirpath, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(dirpath, f), os.path.dirname(ROOT))[:-3].replace(os.sep, ".")
                graph[rel[:-len(".__init__")] if rel.endswith(".__init__") else rel] = set()
    for mod, _, target in import_lines():
        graph[mod].add(target)
    return graph


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


@pytest.mark.slow
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
    for mod in ("hybrid.measure.traced", "hybrid.measure.measured", "hybrid.measure.driver", "hybrid.measure.tracker"):
        seen, todo = set(), [mod]
        while todo:
            m = todo.pop()
            for d in graph.get(m, ()):
                if d not in seen:
                    seen.add(d)
                    todo.append(d)
        assert "hybrid.auto" not in seen, f"{mod} reaches hybrid.auto"


# --- the layout's shape (issue 21) -----------------------------------------------------------
# Dimension branches live in the modules that compose a layout, family names in families/, no
# import cycle through type-only imports, and one module applies the runtime order. A count below
# says where a rule is not met yet: lower it when you remove one, never raise it (a new dimension
# is a new field of the Layout and a term in the composing modules).
PKG = Path(ROOT)
REPO = PKG.parent

DIMENSION_MODULES = {"layout/layout.py", "estimation/shares.py", "estimation/cost/step.py",
                     "estimation/memory/analytic.py", "layout/dims.py", "layout/pipeline.py", "runtime/parallelize.py",
                     "runtime/mesh.py", "estimation/memory/cp.py", "estimation/memory/moe.py",
                     "estimation/memory/stages.py", "planning/stages.py", "measure/stages.py",
                     "handoff/torchtitan.py", "layout/applied.py", "model/tp_plan.py"}
"""Where `tp > 1`, `cp == 1`, `pipeline is None` and the like belong: the Layout, the per-rank
shares, the time and memory models that compose them (estimation/cost/step.py;
estimation/memory/analytic.py, where a pipeline rank's moments differ), ParallelDims and its mesh,
the pipeline's, cp's and ep's own arithmetic (estimation/memory/stages.py, each pipeline rank's
analytic estimate; planning/stages.py, the stage split; measure/stages.py, a rank traced), the
runtime order, and the torchtitan hand-off that spells each dimension as a flag.
runtime/backends/ (the engines), families/ (each family's rules on the dimensions, its
Family.problems) and each family's hand-off are allowed too."""
DIMENSION_DEBT: dict[str, int] = {}
"""Dimension branches still outside those modules, per file (none left: the planner asks
estimation/memory/stages for every pipeline rank and planning/reach.method_degrees for what a
memory method runs, the report's "why" lines and the hand-offs read Layout.used(), the CLI none)."""
FAMILY_DEBT: dict[str, int] = {}
"""Family or preset names and family knobs outside families/, runtime/backends/ and the catalogue."""
NOT_FAMILIES = {("measure/tracker.py", "fsdp")}
"""Strings that are a family's name by coincidence: torch's `fsdp` op namespace
(torch.ops.fsdp.all_gather_copy_in), whose calls the tracker counts as communication."""
DIMS = {"tp", "pp", "cp", "ep"}
KNOBS = {"hpz", "reshard_after_forward", "bucket_cap_mb", "gradient_as_bucket_view", "static_graph", "offload_params",
         "offload_optimizer", "reduce_bucket_size", "allgather_bucket_size", "prefetch_bucket_size",
         "max_live_parameters", "max_reuse_distance", "param_persistence_threshold"}
"""The families' own catalogue knobs (`stage` is left out: pipeline stages use the word too)."""


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG).as_posix(), ast.parse(path.read_text(encoding="utf-8"))


def _name(node):
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def _dim(node):
    """The dimension name a compared operand reads: `tp`, `d.tp`, or an unpinned one's `(tp or 1)`."""
    if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and node.values:
        node = node.values[0]
    return _name(node)


def dimension_branches(tree) -> list[int]:
    """Lines comparing tp, pp, cp or ep (or `(tp or 1)`) with 1, or testing a pipeline against None."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Compare) or len(node.ops) != 1:
            continue
        left, right, op = node.left, node.comparators[0], node.ops[0]
        if isinstance(op, (ast.Is, ast.IsNot)) and _name(left) in ("pipeline", "stage") and \
                isinstance(right, ast.Constant) and right.value is None:
            out.append(node.lineno)
        elif isinstance(op, (ast.In, ast.NotIn)) and _dim(left) in DIMS and isinstance(right, (ast.Tuple, ast.List,
                                                                                             ast.Set)) \
                and any(isinstance(e, ast.Constant) and e.value == 1 for e in right.elts):
            out.append(node.lineno)
        elif isinstance(op, (ast.Gt, ast.GtE, ast.Lt, ast.LtE, ast.Eq, ast.NotEq)) and any(
                _dim(a) in DIMS and isinstance(b, ast.Constant) and b.value == 1
                for a, b in ((left, right), (right, left))):
            out.append(node.lineno)
    return out


def family_references(tree, names: set[str]) -> list[int]:
    """Lines naming a family or a preset in a string (docstrings aside), or reading a family knob."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
            and ast.get_docstring(n, clean=False) is not None}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names \
                and id(node) not in docs:
            out.append(node.lineno)
        elif isinstance(node, ast.Attribute) and node.attr in KNOBS:
            out.append(node.lineno)
    return out


FAMILY_MODULES = {"handoff/base.py", "handoff/ddp.py", "handoff/fsdp.py", "handoff/deepspeed.py"}
"""Per-family modules outside families/ and runtime/backends/: each family's hand-off (its config
files, Accelerate plugin and torchtitan flags), reached through Family.handoff()."""


def _outside(rel: str, allowed: set[str]) -> bool:
    return rel not in allowed | FAMILY_MODULES and not rel.startswith(("runtime/backends/", "families/"))


def test_dimension_branches_live_in_the_modules_that_compose_a_layout():
    found = {rel: dimension_branches(tree) for rel, tree in _modules()}
    over = {rel: lines for rel, lines in found.items()
            if _outside(rel, DIMENSION_MODULES) and len(lines) > DIMENSION_DEBT.get(rel, 0)}
    assert not over, (f"tp/pp/cp compared with 1 or a pipeline tested against None outside {sorted(DIMENSION_MODULES)}"
                      f": {over}; make it a Layout field or a term in shares/cost/parallelize")
    lower = {rel: (n, len(found.get(rel, []))) for rel, n in DIMENSION_DEBT.items() if len(found.get(rel, [])) < n}
    assert not lower, f"fewer dimension branches than DIMENSION_DEBT says (file: (debt, found)): lower it: {lower}"


@pytest.mark.slow
def test_family_names_and_knobs_stay_in_families():
    strategies = REPO / "strategies"
    names = {"ddp", "fsdp", "deepspeed"} | {yaml.safe_load(p.read_text())["name"] for p in strategies.glob("*.yaml")}
    found = {rel: family_references(tree, names - {n for r, n in NOT_FAMILIES if r == rel}) for rel, tree in _modules()}
    over = {rel: lines for rel, lines in found.items()
            if _outside(rel, {"families/catalogue.py", "_compat.py"}) and len(lines) > FAMILY_DEBT.get(rel, 0)}
    assert not over, f"a family or preset name, or a family knob, outside families/: {over}; ask the family instead"
    lower = {rel: (n, len(found.get(rel, []))) for rel, n in FAMILY_DEBT.items() if len(found.get(rel, [])) < n}
    assert not lower, f"fewer family references than FAMILY_DEBT says (file: (debt, found)): lower it: {lower}"


def _imports(rel: str, tree, modules: set[str], everywhere: bool = False) -> set[str]:
    """Modules of the package `rel` imports at module level (type-only imports included), or
    anywhere in it with `everywhere`."""
    me = "hybrid." + rel[:-3].replace("/", ".").removesuffix(".__init__")
    pkg = me if rel.endswith("__init__.py") else me.rsplit(".", 1)[0]

    def top(body):
        for node in body:
            yield node
            if isinstance(node, (ast.If, ast.Try)):
                yield from top(node.body + node.orelse + getattr(node, "finalbody", [])
                               + [s for h in getattr(node, "handlers", []) for s in h.body])
    out = set()
    for node in (ast.walk(tree) if everywhere else top(tree.body)):
        if isinstance(node, ast.ImportFrom):
            base = pkg.split(".")[:len(pkg.split(".")) - node.level + 1] if node.level else []
            name = ".".join(base + ([node.module] if node.module else []))
            subs = {f"{name}.{a.name}" for a in node.names} & modules
            out |= subs
            if name in modules and len(subs) < len(node.names):
                out.add(name)
        elif isinstance(node, ast.Import):
            out |= {a.name for a in node.names} & modules
    return out - {me}


def _graph(everywhere: bool = False) -> dict[str, set[str]]:
    trees = dict(_modules())
    names = {"hybrid." + rel[:-3].replace("/", ".").removesuffix(".__init__"): rel for rel in trees}
    return {m: _imports(rel, trees[rel], set(names), everywhere) for m, rel in names.items()}


@pytest.mark.slow
def test_no_import_cycle_at_module_level_type_only_imports_included():
    """test_no_import_cycles leaves TYPE_CHECKING blocks out; a cycle through them is one too
    (planner and report imported each other for types)."""
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(d):] + [d]))
            if d not in state:
                visit(d)
        stack.pop()
        state[m] = 2
    for m in sorted(graph):
        if m not in state:
            visit(m)


def test_one_module_applies_the_runtime_order():
    """tensor parallel, context parallel, checkpointing, compile and float8 are applied by
    hybrid/runtime/parallelize.py; the backends supply only their family's place/wrap/engine."""
    steps = {"apply_tensor_parallel", "apply_activation_checkpointing", "apply_compile", "apply_float8",
             "ContextParallel", "apply_context_parallel"}
    # the compiled-memory probe (it compiles one block to read its graph)
    known = {"measure/compiled.py": 1}
    calls: dict[str, int] = {}
    for rel, tree in _modules():
        n = sum(1 for node in ast.walk(tree) if isinstance(node, ast.Call) and _name(node.func) in steps)
        if n and rel != "runtime/parallelize.py":
            calls[rel] = n
    assert calls == known, f"runtime steps applied outside hybrid/runtime/parallelize.py: {calls} (known: {known})"
    order = (PKG / "runtime/parallelize.py").read_text()
    at = [order.index(s + "(") for s in ("apply_float8", "apply_tensor_parallel", "ContextParallel",
                                         "apply_activation_checkpointing", "apply_compile", "backend.wrap")]
    assert at == sorted(at), "parallelize's order: float8, tp, cp, checkpointing, compile, the data-parallel wrap"


def test_the_rules_catch_what_they_name():
    """The checkers themselves: each finds the construct it names."""
    tree = ast.parse("if d.tp > 1 and 1 != cp:\n    x = c.pipeline is None\ny = 'zero3'\nz = s.hpz\n")
    assert dimension_branches(tree) == [1, 1, 2]
    assert family_references(tree, {"zero3"}) == [3, 4]


def test_the_dimension_branch_detector_sees_each_form():
    """The AST rule the two tests above rely on finds every way a module branches on a dimension."""
    code = ("if tp > 1: pass\nif d.cp == 1: pass\nif (pp or 1) > 1: pass\nif 1 < ep: pass\n"
            "if layout.pipeline is None: pass\nif pp in (None, 1): pass\nif sh.stage is not None: pass\n"
            "if n > 1: pass\nif tp > 2: pass\nif cp is None: pass\n")
    assert dimension_branches(ast.parse(code)) == [1, 2, 3, 4, 5, 6, 7]


# --- the packages are the layers (issue 32) --------------------------------------------------
LAYERS = ("errors units log memo _compat", "config", "model", "layout", "families", "estimation", "planning", "handoff",
          "ckpt", "runtime", "measure", "tune", "api auto", "__init__", "cli")
"""hybrid's packages (and its few top-level modules) in import order: each imports only what stands
before it or beside it in its own entry (docs/architecture.md). The first entry is the base every
layer may use; api and auto are the public entry points (hybrid.plan/estimate, hybrid.auto_wrap),
the package's __init__ re-exports them, and the CLI calls them."""
TORCH_FREE = ("config", "model", "layout", "families", "estimation", "planning", "handoff")
"""Layers that import no torch at module level: `hybrid plan` runs on them alone."""
TORCH_MODULES = {"model/decoder.py", "model/convnet.py"}
"""The nn.Modules we build: imported only when a module is built from a config (model/sources.py)."""


def layer_of(module: str) -> int:
    """The index in LAYERS of a hybrid module's package (or top-level module)."""
    parts = module.split(".")
    name = parts[1] if len(parts) > 1 else "__init__"
    return next(i for i, entry in enumerate(LAYERS) if name in entry.split())


def against_the_layers(lines) -> list[str]:
    """Each import of a later layer by an earlier one, as `module:line imports target (a -> b)`."""
    out = []
    for mod, line, target in lines:
        a, b = layer_of(mod), layer_of(target)
        if b > a:
            out.append(f"{mod}:{line} imports {target} ({LAYERS[a]} -> {LAYERS[b]})")
    return sorted(out)


def test_imports_follow_the_layers():
    bad = against_the_layers(import_lines())
    assert not bad, f"{len(bad)} import(s) against the layer direction: " + "; ".join(bad)


def test_the_layer_check_names_a_planted_import(tmp_path):
    """A torch-free layer importing the runtime is found, and named by module and line."""
    for pkg in ("config", "runtime"):
        (tmp_path / "hybrid" / pkg).mkdir(parents=True)
        (tmp_path / "hybrid" / pkg / "__init__.py").write_text("")
    (tmp_path / "hybrid" / "__init__.py").write_text("")
    (tmp_path / "hybrid" / "runtime" / "mesh.py").write_text("X = 1\n")
    planted = "import os\n\n\ndef f():\n    from ..runtime.mesh import X\n"
    (tmp_path / "hybrid" / "config" / "spec.py").write_text(planted)
    bad = against_the_layers(import_lines(str(tmp_path / "hybrid")))
    assert bad == ["hybrid.config.spec:5 imports hybrid.runtime.mesh (config -> runtime)"]
    assert not against_the_layers([("hybrid.runtime.mesh", 1, "hybrid.config.spec")])


def test_every_package_has_a_layer_and_pyproject_ships_it():
    packages = sorted(p.parent.relative_to(REPO).as_posix().replace("/", ".") for p in PKG.rglob("__init__.py"))
    for pkg in packages:
        layer_of(pkg)                    # a StopIteration names a package LAYERS does not place
    listed = re.search(r"^packages = \[(.*?)\]", (REPO / "pyproject.toml").read_text(), re.M | re.S).group(1)
    shipped = re.findall(r'"([\w.]+)"', listed)      # [tool.setuptools] packages (no tomllib on Python 3.10)
    assert sorted(set(shipped) - {"hybrid.strategies"}) == packages, "pyproject.toml's packages differ from the tree"


def test_the_torch_free_layers_import_no_torch_at_module_level():
    heavy = ("torch", "deepspeed", "transformers", "accelerate", "torchao")
    found = []
    for rel, tree in _modules():
        if rel.split("/")[0] not in TORCH_FREE or rel in TORCH_MODULES:
            continue
        for node in tree.body:
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{rel}:{node.lineno} {n}" for n in names if n.split(".")[0] in heavy]
    assert not found, f"module-level imports of torch or a library on it in a torch-free layer: {found}"


def test_few_modules_at_the_top_and_tests_mirror_the_packages():
    top = sorted(p.name for p in PKG.glob("*.py"))
    assert len(top) <= 10, f"{len(top)} modules directly under hybrid/ (at most 10): {top}"
    tests = REPO / "tests"
    packages = sorted(p.parent.name for p in PKG.glob("*/__init__.py"))
    missing = [p for p in packages if not list((tests / p).glob("test_*.py"))]
    assert not missing, f"packages without tests/<package>/test_*.py: {missing}"


def test_architecture_md_names_every_module():
    doc = (REPO / "docs" / "architecture.md").read_text()
    missing = [rel for rel, _ in _modules() if f"`{rel}`" not in doc]
    assert not missing, f"docs/architecture.md does not name (as `path`): {missing}"
