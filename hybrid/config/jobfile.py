"""Job files: every `hybrid plan|estimate|compare|measure` option as a YAML key, so a job lives in
a file as Accelerate, torchtune and torchtitan users keep theirs.

    model: llama3-70b          # keys are the long options without dashes (or with _ for -)
    nodes: 8
    gpus_per_node: 8
    seq_len: 8192
    activation_checkpointing: selective

`--config job.yaml` reads one (flags on the command line override it); `--save-config job.yaml`
writes the options in effect; `auto_wrap(model, config="job.yaml")` trains the same job.
Unknown keys are errors naming the key and its line. The keys are the JobConfig's rows
(hybrid/config/options.py); every key has one check, `OPTIONS[key]`, which the CLI's flags, job files
and auto_wrap's arguments all go through: its type, its range (zero and empty values are errors,
never a silent default) and its choices. A job file is read with
yaml.safe_load under config/files.YAML_LIMITS (no aliases, at most 1 MiB, 10,000 values, 16 levels).
"""
from __future__ import annotations

import os

from .files import YAML_LIMITS, key_lines, load_yaml, read_text
from ..errors import HybridError, short
from .options import CLUSTER_KEYS, JOB_KEYS, OPTIONS, PLAN_ONLY, WRAP_KEYS, or_default



def on_off(value: str | bool | None) -> bool | None:
    """An on/off option (--expandable-segments, the job key expandable_segments) as a bool; None
    when not given. YAML reads a bare on/off as a bool."""
    value = OPTIONS["expandable_segments"].check(value)
    return value if value is None or isinstance(value, bool) else value == "on"


def cluster_of(values: dict, **given):
    """The Cluster of the cluster options in `values` (a job, or the parsed flags), each left out
    at its default; `given` overrides (a GPUSpec for `gpu`)."""
    from .cluster import Cluster

    args = {k: or_default(k, values.get(k)) for k in CLUSTER_KEYS} | given
    args["expandable_segments"] = on_off(args["expandable_segments"])
    if values.get("gpu_spec") is not None and values.get("gpu") is not None:
        raise HybridError(f"--gpu {short(values['gpu'])} and --gpu-spec {short(values['gpu_spec'])} both name the "
                          "GPU: give one (the spec file's name: names the GPU it describes)")
    if "gpu" in given:                        # a GPUSpec given (CPU ranks) stands for the spec file too
        args["gpu_spec"] = None
    return Cluster.build(gpu_memory=values.get("gpu_memory"), **args)


def _read_text(path: str) -> str:
    """The job file's text: a regular file (a FIFO would block), at most YAML_LIMITS bytes."""
    return read_text(path, "job file", YAML_LIMITS["bytes"], "a job file is a few lines of options")


def is_factory(model: str) -> bool:
    """Whether model.sources.resolve_model reads `model` as package.module:factory (not a folder,
    not a .json path, a colon; no preset has one), which imports and runs code."""
    return ":" in model and not model.endswith(".json") and not os.path.isdir(model)


def load_job(path: str, allowed: tuple[str, ...] = JOB_KEYS, prog: str = "hybrid plan",
             allow_code: bool = False) -> dict:
    """The file's options (keys as argparse dests), each through its OPTIONS check; `allowed`: the
    keys the command takes. A job file is data: a `model:` factory is refused unless `allow_code`
    (the CLI's --allow-code)."""
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
        if dest == "model" and not allow_code and out[dest] is not None and is_factory(out[dest]):
            raise HybridError(f"{path}:{lines.get(key, 1)}: model {short(out[dest])} is a package.module:factory, "
                              "which imports and runs code, and a job file is data: name a preset, a config.json "
                              "or its folder, give the factory on the command line, or pass --allow-code")
    return out


def check_args(args) -> None:
    """The parsed flags (and the job file's values under them) through OPTIONS, each error naming
    the flag."""
    for name in JOB_KEYS:
        if hasattr(args, name):
            option = OPTIONS[name]
            setattr(args, name, option.check(getattr(args, name), option.flag))


def save_job(path: str, args) -> None:
    """The options in effect (unset ones, switches off included, left out) as a job file."""
    import yaml

    data = {k: getattr(args, k) for k in JOB_KEYS if _set(getattr(args, k, None))}
    try:
        with open(path, "w") as f:
            f.write("# hybrid job file (hybrid plan --config FILE); flags given on the command line override it\n")
            yaml.safe_dump(data, f, sort_keys=False)
    except OSError as e:
        raise HybridError(f"cannot write --save-config {path!r}: {e.strerror or e}") from None


def _set(value) -> bool:
    """Given: not None, not a switch left off, not an empty list (0.0 is a value)."""
    return value is not None and value is not False and value != []


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
    job = load_job(path, prog="auto_wrap(config=...)", allow_code=True)     # auto_wrap never resolves model:
    kwargs = {k: tuple(job[k]) if OPTIONS[k].kind == "list" else job[k] for k in WRAP_KEYS
              if job.get(k) not in (None, [])}
    cluster = cluster_of(job) if any(job.get(k) is not None for k in CLUSTER_KEYS) else None
    return kwargs, cluster, [k for k in PLAN_ONLY if k in job]
