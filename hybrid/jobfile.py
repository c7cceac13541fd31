"""Job files: every `hybrid plan|estimate|compare|measure` option as a YAML key, so a job lives in
a file as Accelerate, torchtune and torchtitan users keep theirs.

    model: llama3-70b          # keys are the long options without dashes (or with _ for -)
    nodes: 8
    gpus_per_node: 8
    seq_len: 8192
    activation_checkpointing: selective

`--config job.yaml` reads one (flags on the command line override it); `--save-config job.yaml`
writes the options in effect; `auto_wrap(model, config="job.yaml")` trains the same job.
Unknown keys are errors naming the key and its line. Every key has one check, `OPTIONS[key]`,
which the CLI's flags, job files and auto_wrap's arguments all go through: its type, its range
(zero and empty values are errors, never a silent default) and its choices. A job file is read with
yaml.safe_load under catalogue.YAML_LIMITS (no aliases, at most 1 MiB, 10,000 values, 16 levels).
"""
from __future__ import annotations

import math
import os
import stat
from dataclasses import dataclass

from .catalogue import YAML_LIMITS, key_lines, load_yaml
from .errors import HybridError, short


@dataclass(frozen=True)
class Option:
    """One job option: the checks its value passes wherever it comes from."""

    name: str
    """The job key and argparse dest (the long flag is --name with - for _)."""
    kind: str
    """int | float | str | list (of strings) | onoff | bool (true or false)."""
    lo: float | None = None
    """Smallest value (int, float), inclusive."""
    hi: float | None = None
    """Largest value (int, float), inclusive."""
    choices: tuple[str, ...] | None = None
    """The accepted strings (checked by `normalise` where aliases exist)."""
    normalise: str | None = None
    """A hybrid.spec checker (precision, optimizer, attention, checkpointing) the string must pass."""

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    def check(self, value, label: str | None = None):
        """The value as the option's type; HybridError (naming `label`, default the key, the rule,
        and the value cut to 80 characters) otherwise. None (not given) passes."""
        label = label or self.name
        if value is None:
            return None
        if self.kind in ("int", "float"):
            return self._number(value, label)
        if self.kind == "bool":
            if isinstance(value, bool):
                return value
            raise HybridError(f"{label} must be true or false, got {short(value)}")
        if self.kind == "onoff":
            if isinstance(value, bool) or value in ("on", "off"):
                return value
            raise HybridError(f"{label} must be on or off, got {short(value)}")
        if self.kind == "list":
            items = value if isinstance(value, list) else [value]
            return [Option(self.name, "str").check(v, label) for v in items]
        if isinstance(value, (int, float)) and not isinstance(value, bool) and self.name in _NUMBER_TEXT:
            value = str(value)          # params: 7.5e9, gpu_memory: 80000000000 in YAML
        if not isinstance(value, str):
            raise HybridError(f"{label} must be a string, got {type(value).__name__} {short(value)}")
        if not value.strip():
            raise HybridError(f"{label} is empty; give a value, or leave the option out for its default")
        if len(value) > 4096:
            raise HybridError(f"{label} is {len(value)} characters long; no valid value is")
        if self.choices is not None and value not in self.choices:
            raise HybridError(f"unknown {self.name} {short(value)}. Available: {', '.join(self.choices)}")
        if self.normalise is not None:
            from . import spec
            if self.normalise == "checkpointing":
                spec.checkpointing(value)
            else:
                spec.choice(self.name.replace("_", " "), value, getattr(spec, self.normalise))
        return value

    def _number(self, value, label: str):
        kind = int if self.kind == "int" else float
        number = None
        if not isinstance(value, bool) and not (kind is int and isinstance(value, float)):
            try:
                number = kind(value)
            except (TypeError, ValueError, OverflowError):
                pass
        if number is None or (kind is float and not math.isfinite(number)):
            rule = "an integer" if kind is int and isinstance(value, float) else \
                "a finite number" if kind is float and isinstance(value, (int, float)) else "a number"
            raise HybridError(f"{label} must be {rule}, got {short(value)}")
        if number < self.lo:
            rule = "a positive integer" if kind is int and self.lo == 1 else f"at least {self.lo:g}"
            raise HybridError(f"{label} must be {rule}, got {short(value)}")
        if number > self.hi:
            raise HybridError(f"{label} must be at most {self.hi:g}, got {short(value)}")
        return number


_NUMBER_TEXT = ("params", "gpu_memory", "host_memory")
_SIZE = 10**9
"""Largest count of nodes, GPUs, sequences or tokens: beyond any cluster, below float overflow."""

OPTIONS = {o.name: o for o in (
    Option("model", "str"),
    Option("params", "str"),
    Option("nodes", "int", 1, _SIZE),
    Option("gpus_per_node", "int", 1, _SIZE),
    Option("gpu", "str"),
    Option("gpu_memory", "str"),
    Option("host_memory", "str"),
    Option("expandable_segments", "onoff"),
    Option("headroom", "float", 0.0, 4.0),            # reserved/allocated - 1: public runs show 0.11-0.36
    Option("micro_batch", "int", 1, _SIZE),
    Option("global_batch", "int", 1, _SIZE),
    Option("global_batch_tokens", "int", 1, 10**15),
    Option("seq_len", "int", 1, _SIZE),
    Option("gradient_accumulation", "int", 1, 10**6),
    Option("precision", "str", normalise="Precision"),
    Option("optimizer", "str", normalise="Optimizer"),
    Option("activation_checkpointing", "str", normalise="checkpointing"),
    Option("attention", "str", normalise="Attention"),
    Option("compile", "bool"),
    Option("float8", "bool"),
    Option("shard_size", "int", 1, _SIZE),
    Option("tp", "int", 1, 10**6),
    Option("pp", "int", 1, 10**6),
    Option("cp", "int", 1, 10**6),
    Option("ep", "int", 1, 10**6),
    Option("moe_imbalance", "float", 1.0, 10**6),     # busiest ep rank's routed tokens / mean (spec.MOE_IMBALANCE)
    Option("schedule", "str", choices=("1f1b", "gpipe", "interleaved")),
    Option("method", "str", choices=("analytic", "traced", "measured")),
    Option("implementation", "str", choices=("auto", "transformers", "hybrid")),
    Option("efficiency", "float", 0.01, 1.0),         # fraction of peak FLOP/s; public runs: 0.3-0.65
    Option("strategies_dir", "list"),
    Option("strategy", "str"),
    Option("calibration", "str"),
)}
"""Every job option and its one check (issue 21 generalises this table into the JobConfig)."""

JOB_KEYS = tuple(OPTIONS)
"""What a job file may hold: the model, the cluster, the training step and the method (not output
switches such as --json or --emit)."""


def on_off(value: str | bool | None) -> bool | None:
    """An on/off option (--expandable-segments, the job key expandable_segments) as a bool; None
    when not given. YAML reads a bare on/off as a bool."""
    value = OPTIONS["expandable_segments"].check(value)
    return value if value is None or isinstance(value, bool) else value == "on"


def _read_text(path: str) -> str:
    """The job file's text: a regular file (a FIFO would block), at most YAML_LIMITS bytes."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        raise HybridError(f"job file {path!r} does not exist") from None
    except OSError as e:
        raise HybridError(f"cannot read job file {path!r}: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise HybridError(f"job file {path!r} is not a regular file")
        data = f.read(YAML_LIMITS["bytes"] + 1)
    if len(data) > YAML_LIMITS["bytes"]:     # bytes, before decoding: multibyte text is never cut short
        raise HybridError(f"job file {path!r} is larger than {YAML_LIMITS['bytes']} bytes; a job file is a few "
                          "lines of options")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise HybridError(f"job file {path!r} is not UTF-8 text") from None


def load_job(path: str, allowed: tuple[str, ...] = JOB_KEYS, prog: str = "hybrid plan") -> dict:
    """The file's options (keys as argparse dests), each through its OPTIONS check; `allowed`: the
    keys the command takes."""
    import yaml

    text = _read_text(path)
    try:
        data = load_yaml(text)
    except yaml.YAMLError as e:
        raise HybridError(f"{path}: not a job file hybrid reads: {str(e).splitlines()[0][:120]}") from None
    except RecursionError:
        raise HybridError(f"{path}: nested deeper than a job file is") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HybridError(f"{path}: a job file is a mapping of option: value, got a {type(data).__name__}")
    lines = key_lines(text)
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in allowed:
            raise HybridError(f"{path}:{lines.get(key, 1)}: unknown key {short(key)} for `{prog}`. "
                              f"Allowed: {', '.join(allowed)}")
        try:
            out[dest] = OPTIONS[dest].check(value)
        except HybridError as e:
            raise HybridError(f"{path}:{lines.get(key, 1)}: {e}") from None
    return out


def check_args(args) -> None:
    """The parsed flags (and the job file's values under them) through OPTIONS, each error naming
    the flag."""
    for name, option in OPTIONS.items():
        if hasattr(args, name):
            setattr(args, name, option.check(getattr(args, name), option.flag))


def save_job(path: str, args) -> None:
    """The options in effect (unset ones left out) as a job file."""
    import yaml

    data = {k: getattr(args, k) for k in JOB_KEYS if getattr(args, k, None) not in (None, [])}
    try:
        with open(path, "w") as f:
            f.write("# hybrid job file (hybrid plan --config FILE); flags given on the command line override it\n")
            yaml.safe_dump(data, f, sort_keys=False)
    except OSError as e:
        raise HybridError(f"cannot write --save-config {path!r}: {e.strerror or e}") from None


_WRAP_KEYS = ("micro_batch", "global_batch", "global_batch_tokens", "seq_len", "gradient_accumulation", "precision",
              "activation_checkpointing", "attention", "compile", "float8", "moe_imbalance", "shard_size", "tp", "pp",
              "cp", "ep", "schedule",
              "strategy", "gpu_memory", "calibration")
"""Job keys that are auto_wrap arguments of the same name."""
_PLAN_ONLY = ("model", "params", "method", "implementation", "efficiency", "optimizer")
"""Keys that describe what `hybrid plan` estimates: auto_wrap has the module and the optimizer."""


def check_arguments(values: dict, where: str) -> None:
    """auto_wrap's keyword arguments through the same checks as the job keys of the same name."""
    for name, value in values.items():
        try:
            OPTIONS[name].check(value)
        except HybridError as e:
            raise HybridError(f"{where}: {e}") from None


def wrap_options(path: str) -> tuple[dict, object, list[str]]:
    """A job file as auto_wrap arguments: (keyword arguments, a Cluster or None, the keys that only
    `hybrid plan` uses). Checked exactly as `hybrid plan --config` checks it."""
    from .cluster import Cluster

    job = load_job(path, prog="auto_wrap(config=...)")
    kwargs = {k: job[k] for k in _WRAP_KEYS if job.get(k) is not None}
    if job.get("strategies_dir"):
        kwargs["strategies_dir"] = tuple(job["strategies_dir"])
    cluster = None
    if any(job.get(k) is not None for k in ("nodes", "gpus_per_node", "gpu", "host_memory", "headroom",
                                            "expandable_segments")):
        cluster = Cluster.build(_given(job, "nodes", 1), _given(job, "gpus_per_node", 8),
                                _given(job, "gpu", "h100-80gb"), job.get("gpu_memory"), job.get("host_memory"),
                                job.get("headroom"), on_off(job.get("expandable_segments")))
    return kwargs, cluster, [k for k in _PLAN_ONLY if k in job]


def _given(job: dict, key: str, default):
    """The job's value where given (checked: never zero or empty), else the documented default."""
    return default if job.get(key) is None else job[key]
