"""Job files: every `hybrid plan|estimate|compare|measure` option as a YAML key, so a job lives in
a file as Accelerate, torchtune and torchtitan users keep theirs.

    model: llama3-70b          # keys are the long options without dashes (or with _ for -)
    nodes: 8
    gpus_per_node: 8
    seq_len: 8192
    activation_checkpointing: selective

`--config job.yaml` reads one (flags on the command line override it); `--save-config job.yaml`
writes the options in effect; `auto_wrap(model, config="job.yaml")` trains the same job.
Unknown keys are errors naming the key and its line.
"""
from __future__ import annotations

import yaml

from .catalogue import key_lines
from .errors import HybridError

JOB_KEYS = ("model", "params", "nodes", "gpus_per_node", "gpu", "gpu_memory", "host_memory", "expandable_segments",
            "headroom", "micro_batch", "global_batch", "global_batch_tokens",
            "seq_len", "gradient_accumulation", "precision", "optimizer", "activation_checkpointing", "attention", "compile", "float8",
            "shard_size", "tp", "pp", "schedule", "method", "implementation", "efficiency", "strategies_dir",
            "strategy")
"""What a job file may hold: the model, the cluster, the training step and the method (not output
switches such as --json or --emit)."""
_NUMBERS = {"nodes": int, "gpus_per_node": int, "micro_batch": int, "global_batch": int, "global_batch_tokens": int, "seq_len": int, "gradient_accumulation": int,
            "shard_size": int, "tp": int, "pp": int, "efficiency": float, "headroom": float}
"""Job keys that hold numbers (the CLI's option types); the rest are strings."""


def on_off(value: str | None) -> bool | None:
    """An on/off option (--expandable-segments, the job key expandable_segments) as a bool; None
    when not given. YAML reads a bare on/off as a bool."""
    if isinstance(value, bool):
        return value
    if value in (None, "on", "off"):
        return None if value is None else value == "on"
    raise HybridError(f"expandable_segments must be on or off, got {value!r}")


def load_job(path: str, allowed: tuple[str, ...] = JOB_KEYS, prog: str = "hybrid plan") -> dict:
    """The file's options (keys as argparse dests), type-checked like the flags; `allowed`: the
    keys the command takes."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
        data = yaml.safe_load(text)
    except FileNotFoundError:
        raise HybridError(f"job file {path!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise HybridError(f"cannot read job file {path!r}: {e}") from None
    except yaml.YAMLError as e:
        raise HybridError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise HybridError(f"{path}: a job file is a mapping of option: value, got a {type(data).__name__}")
    lines = key_lines(text)
    out = {}
    for key, value in data.items():
        dest = str(key).replace("-", "_")
        if dest not in allowed:
            raise HybridError(f"{path}:{lines.get(key, 1)}: unknown key {key!r} for `{prog}`. "
                              f"Allowed: {', '.join(allowed)}")
        if dest == "strategies_dir":
            value = value if isinstance(value, list) else [value]
        elif value is not None and dest in _NUMBERS:
            try:
                value = _NUMBERS[dest](value) if not isinstance(value, bool) else _bad(path, lines, key, value)
            except (TypeError, ValueError):
                _bad(path, lines, key, value)
        out[dest] = value
    return out


def _bad(path, lines, key, value):
    raise HybridError(f"{path}:{lines.get(key, 1)}: {key} must be a number, got {value!r}")


def save_job(path: str, args) -> None:
    """The options in effect (unset ones left out) as a job file."""
    data = {k: getattr(args, k) for k in JOB_KEYS if getattr(args, k, None) not in (None, [])}
    try:
        with open(path, "w") as f:
            f.write("# hybrid job file (hybrid plan --config FILE); flags given on the command line override it\n")
            yaml.safe_dump(data, f, sort_keys=False)
    except OSError as e:
        raise HybridError(f"cannot write --save-config {path!r}: {e.strerror or e}") from None


_WRAP_KEYS = ("micro_batch", "global_batch", "global_batch_tokens", "seq_len", "gradient_accumulation", "precision", "activation_checkpointing",
              "attention", "compile", "float8", "shard_size", "tp", "pp", "schedule", "strategy", "gpu_memory")
"""Job keys that are auto_wrap arguments of the same name."""
_PLAN_ONLY = ("model", "params", "method", "implementation", "efficiency", "optimizer")
"""Keys that describe what `hybrid plan` estimates: auto_wrap has the module and the optimizer."""


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
        cluster = Cluster.build(job.get("nodes") or 1, job.get("gpus_per_node") or 8, job.get("gpu") or "h100-80gb",
                                job.get("gpu_memory"), job.get("host_memory"), job.get("headroom"),
                                on_off(job.get("expandable_segments")))
    return kwargs, cluster, [k for k in _PLAN_ONLY if k in job]
