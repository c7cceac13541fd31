"""Every plan/estimate/compare output shown in the README is what the command next to it prints
today: a README paragraph that names `hybrid plan|estimate|compare ...` in backticks and is
followed by an indented block has each row of that block checked against a fresh run (rows
ending in "..." are checked up to the dots)."""
import os
import re
import shlex

import pytest

from hybrid.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMAND = re.compile(r"`(hybrid (?:plan|estimate|compare) [^`]+)`")


def shown_outputs():
    """(command, block lines) for each README paragraph naming a command and then showing output."""
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    out = []
    for para, block in re.findall(r"((?:^[^\n ].*\n)+)\n((?:^    .*\n)+)", text, flags=re.M):
        commands = COMMAND.findall(" ".join(para.split()))
        if commands:
            out.append((commands[-1], [line[4:] for line in block.splitlines() if line.strip()]))
    return out


def norm(line: str) -> str:
    return " ".join(line.split())


@pytest.mark.unit
@pytest.mark.parametrize("command,rows", shown_outputs(), ids=lambda v: v if isinstance(v, str) else "")
def test_readme_output_is_what_the_command_prints(capsys, command, rows):
    assert main(shlex.split(command)[1:]) == 0
    printed = [norm(line) for line in capsys.readouterr().out.splitlines()]
    for row in rows:
        want = norm(row)
        if want.startswith("...") or set(want) <= {"-"}:
            continue
        if want.endswith("..."):
            head = want[:-3].rstrip()
            assert any(p.startswith(head) for p in printed), f"README row not printed by `{command}`:\n{row}"
        else:
            assert want in printed, f"README row not printed by `{command}`:\n{row}"


@pytest.mark.unit
def test_the_readme_shows_some_outputs():
    assert len(shown_outputs()) >= 2
