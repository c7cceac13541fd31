"""What README.md and docs/*.md show is what the code does today.

- A paragraph that names `hybrid plan|estimate|compare ...` in backticks and is followed by an
  indented block (or a ``` / ```text fence) shows that command's output: each row of the block is
  checked against a fresh run (rows ending in "..." up to the dots).
- The tables and bullets right after a paragraph naming `benchmarks/public_runs.py` are what that
  script writes.
- The README's test command is what `.ci/run` runs; the README's diff to `auto_wrap` uses
  arguments and methods that exist; every docs/ file is linked from the README, and every relative
  link resolves (file and heading)."""
import ast
import re
import shlex
import sys
from pathlib import Path

import pytest

from hybrid.cli.main import main

ROOT = Path(__file__).resolve().parent.parent
COMMAND = re.compile(r"`(hybrid (?:plan|estimate|compare) [^`]+)`")
FENCE = re.compile(r"^```(\S*)\s*$")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _paragraph_before(lines: list[str], i: int) -> list[str]:
    """The run of lines that start with a non-space character ending at line i - 2, if line i - 1 is
    blank (the paragraph directly above a block)."""
    if i < 2 or lines[i - 1].strip():
        return []
    j = i - 1
    while j > 0 and lines[j - 1] and not lines[j - 1][0].isspace():
        j -= 1
    return lines[j:i - 1]


def blocks(text: str):
    """(paragraph above, block lines) for each indented block and each plain/text fence."""
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        fence = FENCE.match(lines[i])
        if fence:
            end = next((k for k in range(i + 1, len(lines)) if lines[k].startswith("```")), len(lines))
            if fence.group(1) in ("", "text"):
                yield _paragraph_before(lines, i), lines[i + 1:end]
            i = end + 1
        elif lines[i].startswith("    "):
            end = i
            while end < len(lines) and lines[end].startswith("    "):
                end += 1
            yield _paragraph_before(lines, i), [line[4:] for line in lines[i:end]]
            i = end
        else:
            i += 1


def shown_outputs():
    """(document, command, block rows) for each paragraph naming a command and then showing output."""
    out = []
    for doc in documents():
        for para, block in blocks(doc.read_text()):
            commands = COMMAND.findall(" ".join(" ".join(para).split()))
            if commands:
                out.append((doc.relative_to(ROOT).as_posix(), commands[-1], [r for r in block if r.strip()]))
    return out


def norm(line: str) -> str:
    return " ".join(line.split())


def shown_by_command() -> dict[str, list[tuple[str, list[str]]]]:
    """shown_outputs grouped by command: {command: [(document, rows)]} (a plan shown in two documents runs
    once)."""
    out: dict = {}
    for doc, command, rows in shown_outputs():
        out.setdefault(command, []).append((doc, rows))
    return out


@pytest.mark.unit
@pytest.mark.parametrize("command", sorted(shown_by_command()))
@pytest.mark.slow
def test_shown_output_is_what_the_command_prints(capsys, command):
    assert main(shlex.split(command)[1:]) == 0
    printed = [norm(line) for line in capsys.readouterr().out.splitlines()]
    for doc, rows in shown_by_command()[command]:
        for row in rows:
            want = norm(row)
            if want.startswith("...") or set(want) <= {"-"}:
                continue
            if want.endswith("..."):
                head = want[:-3].rstrip()
                assert any(p.startswith(head) for p in printed), f"{doc}: row not printed by `{command}`:\n{row}"
            else:
                assert want in printed, f"{doc}: row not printed by `{command}`:\n{row}"


@pytest.mark.unit
def test_the_docs_show_outputs():
    shown = shown_outputs()
    assert len(shown) >= 10 and any(doc == "README.md" for doc, _, _ in shown)


def script_tables(script: str):
    """(document, rows) for the table rows and bullets right after a paragraph naming `script`."""
    out = []
    for doc in documents():
        lines = doc.read_text().split("\n")
        for i in range(1, len(lines)):
            if not (lines[i].startswith(("| ", "- ")) and not lines[i - 1].strip()):
                continue
            if script not in " ".join(_paragraph_before(lines, i)):
                continue
            rows, k = [], i
            while k < len(lines) and (lines[k].startswith(("| ", "- ", "#")) or not lines[k].strip()):
                if lines[k].startswith(("| ", "- ")):
                    rows.append(lines[k])
                k += 1
            out.append((doc.relative_to(ROOT).as_posix(), rows))
    return out


@pytest.mark.unit
@pytest.mark.slow
def test_public_runs_tables_are_what_the_script_writes(tmp_path, monkeypatch):
    shown = script_tables("benchmarks/public_runs.py")
    assert len(shown) >= 2 and sum(len(rows) for _, rows in shown) > 36
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import public_runs
    monkeypatch.setattr(public_runs, "OUT", tmp_path / "out.md")
    assert public_runs.main([]) == 0
    written = {norm(line) for line in (tmp_path / "out.md").read_text().splitlines()}
    for doc, rows in shown:
        for row in rows:
            assert norm(row) in written, f"{doc}: not what benchmarks/public_runs.py writes:\n{row}"


def _two_commands() -> tuple[str, str]:
    text = (ROOT / "README.md").read_text()
    demo = re.search(r"^    (\./setup\.sh && \S+ demo)$", text, flags=re.M)
    tests = re.search(r"^    (\./setup\.sh && .*pytest.*)$", text, flags=re.M)
    assert demo and tests, "README.md shows the set-up + demo and the set-up + tests commands"
    return demo.group(1), tests.group(1)


@pytest.mark.unit
def test_ci_runs_the_readme_test_command():
    demo, tests = _two_commands()
    assert demo == "./setup.sh && .venv/bin/hybrid demo"
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line.strip() and line[0] != "#"]
    assert ci[-1] == tests


def _signature(name: str, kind: type) -> tuple[Path, ast.AST]:
    for path in sorted((ROOT / "hybrid").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, kind) and node.name == name:
                return path, node
    raise AssertionError(f"no {name} in hybrid/")


@pytest.mark.unit
def test_the_readme_diff_to_auto_wrap_uses_what_exists():
    """Both sides of the README's diff are Python; auto_wrap takes the keywords the diff passes and
    the wrapped object has the methods it calls (tests/test_readme_loop.py runs the full loop)."""
    text = (ROOT / "README.md").read_text()
    diff = re.search(r"```diff\n(.*?)```", text, flags=re.S).group(1).splitlines()
    before = "\n".join(line[1:] for line in diff if line[:1] in (" ", "-"))
    after = "\n".join(line[1:] for line in diff if line[:1] in (" ", "+"))
    ast.parse(before)
    tree = ast.parse(after)
    _, auto_wrap = _signature("auto_wrap", ast.FunctionDef)
    params = {a.arg for a in auto_wrap.args.args + auto_wrap.args.kwonlyargs}
    _, wrapped = _signature("Wrapped", ast.ClassDef)
    methods = {n.name for n in wrapped.body if isinstance(n, ast.FunctionDef)}
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)]
    wrap = [c for c in calls if isinstance(c.func, ast.Attribute) and c.func.attr == "auto_wrap"]
    assert len(wrap) == 1 and {k.arg for k in wrap[0].keywords} <= params
    used = {c.func.attr for c in calls if isinstance(c.func, ast.Attribute) and isinstance(c.func.value, ast.Name)
            and c.func.value.id == "w"}
    assert used and used <= methods, used - methods


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.S | re.M)
    return {slug(h) for h in re.findall(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.unit
def test_every_doc_is_linked_from_the_readme():
    linked = {(ROOT / target.split("#")[0]).resolve() for target in LINK.findall((ROOT / "README.md").read_text())}
    missing = [p.name for p in documents()[1:] if p.resolve() not in linked]
    assert not missing, f"docs/ files the README does not link: {missing}"


@pytest.mark.unit
def test_relative_links_resolve():
    broken = []
    for doc in documents():
        for target in LINK.findall(doc.read_text()):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            dest = (doc.parent / path).resolve() if path else doc
            if not dest.exists():
                broken.append(f"{doc.name}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{doc.name}: {target} (no such heading)")
    assert not broken, "\n".join(broken)
