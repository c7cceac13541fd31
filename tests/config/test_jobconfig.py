"""The JobConfig (hybrid/config/options.py) is the one list of job options: the CLI's flags, the job
file's keys and auto_wrap's job arguments are its rows, with its defaults."""
import argparse
import ast
import dataclasses
import inspect
import re
from pathlib import Path

import pytest

from hybrid.cli.main import _common, build_parser
from hybrid.config.options import CLUSTER_KEYS, JOB_KEYS, OPTIONS, PLAN_ONLY, WRAP_KEYS
from hybrid.errors import HybridError

ROOT = Path(__file__).resolve().parents[2]
COMMANDS = {"plan": True, "tune": True, "estimate": False, "compare": False, "measure": False}
"""Each command that takes the job options, and whether it searches what is not given."""
WRAP_SPELLING = {"strategy": "auto"}
"""auto_wrap's default where it spells "not given" its own way: strategy="auto", the planner chooses."""
WRAP_OWN = {"model", "optimizer", "cluster", "verbose", "scheduler", "max_grad_norm", "find_unused_parameters",
            "config", "tune", "max_bad_steps", "resume"}
"""auto_wrap's arguments that are not job options: the module, the loop and the job file itself."""


def _subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _parsed_default(o):
    """What the parser holds for an option not given: its default where it fills it in, else None."""
    return list(o.default) if o.kind == "list" else o.default if o.fill else None


@pytest.mark.unit
def test_every_row_is_a_flag_of_every_job_command_with_its_help_and_default():
    subs = _subparsers()
    for command, search in COMMANDS.items():
        actions = {a.dest: a for a in subs[command]._actions}
        for o in OPTIONS.values():
            if o.flag_per_command:
                continue
            a = actions[o.name]
            assert (a.option_strings or [a.dest]) == [o.flag], (command, o.name)
            assert a.help == o.help_text(search) and len(a.help) > 10, (command, o.name)
            assert a.default == _parsed_default(o), (command, o.name)
            if o.kind in ("int", "float"):
                assert a.type is {"int": int, "float": float}[o.kind], (command, o.name)
        assert "{default}" not in subs[command].format_help()
    for command in ("plan", "estimate", "measure"):          # the row each adds with its own help
        assert any(a.dest == "strategy" for a in subs[command]._actions)


@pytest.mark.unit
def test_the_common_flags_are_the_table_and_nothing_else():
    p = argparse.ArgumentParser()
    _common(p)
    dests = [a.dest for a in p._actions if a.dest != "help"]
    assert dests == [o.name for o in OPTIONS.values() if not o.flag_per_command]
    groups = [g.title for g in p._action_groups if g._group_actions and g.title not in ("positional arguments",
                                                                                          "options")]
    assert groups == ["cluster", "training step", "goodput", "fine-tuning", "method and output"]


@pytest.mark.unit
def test_search_changes_only_the_searched_options_help():
    for o in OPTIONS.values():
        if o.searched is None:
            assert o.help_text(True) == o.help_text(False)
        else:
            assert o.searched in o.help_text(True) and o.searched not in o.help_text(False)
    assert OPTIONS["activation_checkpointing"].help_text(False).endswith("(default: none)")


@pytest.mark.unit
def test_the_help_states_each_given_default():
    for o in OPTIONS.values():
        if o.default is not None and o.kind not in ("bool", "list"):
            assert str(o.default) in o.help_text(), o.name


@pytest.mark.unit
def test_job_keys_are_the_tables_rows(tmp_path):
    from hybrid.config.jobfile import load_job
    assert JOB_KEYS == tuple(k for k, o in OPTIONS.items() if o.use != "cli")
    assert set(JOB_KEYS) == set(WRAP_KEYS) | set(CLUSTER_KEYS) | set(PLAN_ONLY)
    plan = {a.dest for a in _subparsers()["plan"]._actions}
    assert set(JOB_KEYS) <= plan                                       # a key for every flag of plan
    job = tmp_path / "job.yaml"
    job.write_text("model: gpt2\njson: true\n")                        # an output switch is not a job key
    with pytest.raises(HybridError, match=r"job.yaml:2: unknown key 'json' for `hybrid plan`. Allowed: "
                       + re.escape(", ".join(JOB_KEYS)) + "$"):
        load_job(str(job))


@pytest.mark.unit
def test_save_config_writes_what_load_reads(tmp_path):
    """Every job key set on the command line comes back from the saved file, switches included."""
    from hybrid.cli.main import _parse
    from hybrid.config.jobfile import load_job
    saved = tmp_path / "saved.yaml"
    args = _parse(["plan", "gpt2", "--nodes", "2", "--compile", "--headroom", "0", "--strategies-dir", "strategies",
                   "--expandable-segments", "off", "--save-config", str(saved)])
    assert load_job(str(saved)) == {"model": "gpt2", "nodes": 2, "expandable_segments": "off", "headroom": 0.0,
                                    "optimizer": "adamw", "compile": True, "attention": "sdpa", "loss": "eager",
                                    "method": "analytic", "implementation": "auto", "strategies_dir": ["strategies"]}
    again = _parse(["plan", "--config", str(saved)])
    assert {k: getattr(again, k) for k in JOB_KEYS} == {k: getattr(args, k) for k in JOB_KEYS}


def _auto_wrap_defaults() -> dict:
    """auto_wrap's keyword defaults, read from its source (importing hybrid.auto needs torch)."""
    tree = ast.parse((ROOT / "hybrid" / "auto.py").read_text())
    fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "auto_wrap")
    a = fn.args
    positional = dict(zip([x.arg for x in a.args][len(a.args) - len(a.defaults):], a.defaults))
    out = {x.arg: ast.literal_eval(d) for x, d in zip(a.kwonlyargs, a.kw_defaults)}
    out.update({k: ast.literal_eval(d) for k, d in positional.items()})
    return out | {x.arg: inspect.Parameter.empty for x in a.args if x.arg not in positional}


@pytest.mark.unit
def test_auto_wrap_takes_the_job_options_with_the_tables_defaults():
    defaults = _auto_wrap_defaults()
    assert set(defaults) == set(WRAP_KEYS) | WRAP_OWN, "a new auto_wrap argument: a job option (a row) or its own?"
    for k in WRAP_KEYS:
        o = OPTIONS[k]
        expect = WRAP_SPELLING.get(k, tuple(o.default) if o.kind == "list" else _parsed_default(o))
        assert defaults[k] == expect, f"auto_wrap's {k}={defaults[k]!r}, the JobConfig's {expect!r}"


@pytest.mark.unit
def test_the_public_values_default_as_the_table_does():
    """Cluster, Cluster.build, TrainSpec and hybrid.plan/estimate keep explicit defaults (readers and
    IDEs see them); they are the table's."""
    from hybrid import api
    from hybrid.config.cluster import Cluster
    from hybrid.config.spec import TrainSpec
    build = inspect.signature(Cluster.build).parameters
    assert set(CLUSTER_KEYS) | {"gpu_memory"} == set(build) - {"cls"}
    for k in build:
        if k in OPTIONS:
            assert build[k].default == OPTIONS[k].default, k
    c = Cluster()
    assert (c.nodes, c.gpus_per_node, c.gpu.name) == tuple(OPTIONS[k].default for k in ("nodes", "gpus_per_node",
                                                                                        "gpu"))
    shared = [f for f in dataclasses.fields(TrainSpec) if f.name in OPTIONS and OPTIONS[f.name].default is not None]
    assert {f.name for f in shared} >= {"micro_batch", "gradient_accumulation", "optimizer", "attention", "compile",
                                        "float8", "activation_checkpointing", "moe_imbalance"}
    for f in shared:
        assert f.default == OPTIONS[f.name].default, f.name
    for fn in (api.plan, api.estimate):
        for k, p in inspect.signature(fn).parameters.items():
            if k in OPTIONS and k != "strategy" and p.default is not p.empty:
                o = OPTIONS[k]
                assert p.default == (tuple(o.default) if o.kind == "list" else _parsed_default(o)), (fn, k)


@pytest.mark.unit
def test_the_cli_docs_name_every_option():
    section = (ROOT / "docs" / "cli.md").read_text().split("## Options")[1].split("\n## ")[0]
    missing = [o.flag for o in OPTIONS.values() if not o.positional
               and not re.search(re.escape(o.flag) + r"(?![\w-])", section)]
    assert not missing, f"docs/cli.md's Options section does not name {missing}"


@pytest.mark.unit
def test_a_job_files_cluster_and_arguments_come_with_the_tables_defaults(tmp_path):
    from hybrid.config.jobfile import check_arguments, wrap_options
    job = tmp_path / "job.yaml"
    job.write_text("host_memory: 1TiB\nstrategies_dir: [strategies]\ncompile: false\nmodel: gpt2\n")
    kwargs, cluster, plan_only = wrap_options(str(job))
    assert kwargs == {"strategies_dir": ("strategies",), "compile": False} and plan_only == ["model"]
    assert (cluster.nodes, cluster.gpus_per_node, cluster.gpu.name) == tuple(
        OPTIONS[k].default for k in ("nodes", "gpus_per_node", "gpu"))
    check_arguments({"strategies_dir": ()}, "auto_wrap")                # auto_wrap's tuple, as the flag's list
    with pytest.raises(HybridError, match="auto_wrap: strategies_dir is empty"):
        check_arguments({"strategies_dir": ("",)}, "auto_wrap")
