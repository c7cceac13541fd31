"""Reading the files a user names (job files, strategy files, config.json, calibration files, GPU
spec files) under a budget: regular files only (a FIFO or a device is refused before it is read),
a size cap, and for YAML and JSON a cap on values and nesting, with no YAML aliases, so no file
can block, expand or run code."""
from __future__ import annotations

import fcntl
import json
import os
import stat

import yaml

from ..errors import HybridError

YAML_LIMITS = {"bytes": 1 << 20, "nodes": 10_000, "depth": 16}
"""What a job or strategy file may take: size, YAML nodes and nesting (a hand-written file has a
few dozen nodes, two levels); aliases (*name) are refused outright, so no file can expand."""
JSON_LIMITS = {"bytes": 4 << 20, "values": 200_000, "depth": 32}
"""What a model config.json may take: size, values and nesting (published ones hold a few hundred
values in three levels, 100 KB at most with their label maps)."""


def file_kind(mode: int) -> str:
    """What a non-regular file is, in words (for the refusal)."""
    return "a FIFO" if stat.S_ISFIFO(mode) else "a folder" if stat.S_ISDIR(mode) else \
        "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "a socket" if stat.S_ISSOCK(mode) else \
        "not a regular file"


def read_capped(f, limit: int, name: str, why: str) -> bytes:
    """All of the open binary file `f`, at most `limit` bytes; HybridError "{name} is larger than
    {limit} bytes; {why}" past it (one byte more is read to tell)."""
    data = f.read(limit + 1)
    if len(data) > limit:
        raise HybridError(f"{name} is larger than {limit} bytes; {why}")
    return data


def read_bytes(path: str, what: str, limit: int, why: str) -> bytes:
    """The bytes of the regular file `path` (a `what`: "job file", "model config", ...), at most
    `limit`; a missing, unreadable or non-regular file (FIFO, device, folder) is one HybridError,
    refused before it is read (stat, then an O_NONBLOCK open and fstat of what was opened)."""
    label = f"{what} {str(path)[:200]!r}"
    try:
        mode = os.stat(path).st_mode
        if stat.S_ISREG(mode):
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise HybridError(f"{label} does not exist") from None
    except (OSError, ValueError) as e:            # ValueError: a NUL in the path
        raise HybridError(f"cannot read {label}: {getattr(e, 'strerror', None) or e}") from None
    if not stat.S_ISREG(mode):
        raise HybridError(f"{label} is {file_kind(mode)}; give a regular file")
    with os.fdopen(fd, "rb") as f:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):                 # replaced between the stat and the open
            raise HybridError(f"{label} is {file_kind(mode)}; give a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        try:
            return read_capped(f, limit, label, why)
        except OSError as e:
            raise HybridError(f"cannot read {label}: {e.strerror or e}") from None


def read_text(path: str, what: str, limit: int, why: str) -> str:
    """read_bytes decoded as UTF-8 (the cap counts bytes, so multibyte text is never cut short)."""
    data = read_bytes(path, what, limit, why)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise HybridError(f"{what} {str(path)[:200]!r} is not UTF-8 text") from None


def read_yaml(path: str, what: str, why: str):
    """(the YAML document, its text) of a file read under YAML_LIMITS; invalid YAML is one line."""
    text = read_text(path, what, YAML_LIMITS["bytes"], why)
    try:
        return load_yaml(text), text
    except yaml.YAMLError as e:
        raise HybridError(f"{path}: not valid YAML: {str(e).splitlines()[0][:200]}") from None


def load_json(text: str, limits: dict = JSON_LIMITS):
    """json.loads under `limits` (raises ValueError past them: larger, more values, deeper; and for
    what json refuses: bad syntax, an integer of thousands of digits, nesting past the stack)."""
    if len(text) > limits["bytes"]:
        raise ValueError(f"larger than {limits['bytes']} bytes")
    try:
        data = json.loads(text)
    except RecursionError:
        raise ValueError(f"nested deeper than {limits['depth']} levels") from None
    values, stack = 0, [(data, 1)]
    while stack:                                   # iterative, so the walk itself cannot recurse
        node, depth = stack.pop()
        values += 1
        if depth > limits["depth"]:
            raise ValueError(f"nested deeper than {limits['depth']} levels")
        if values > limits["values"]:
            raise ValueError(f"more than {limits['values']} values")
        if isinstance(node, dict):
            stack += [(v, depth + 1) for v in node.values()]
        elif isinstance(node, list):
            stack += [(v, depth + 1) for v in node]
    return data


class _BudgetLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses aliases and stops past YAML_LIMITS' nodes and depth (a 406-byte
    alias bomb otherwise expands to gigabytes in safe_load)."""

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.YAMLError(f"line {mark.line + 1}: a YAML alias (*name); write the value out, aliases are "
                                 "not accepted here")
        self._nodes = getattr(self, "_nodes", 0) + 1
        self._depth = getattr(self, "_depth", 0) + 1
        if self._nodes > YAML_LIMITS["nodes"] or self._depth > YAML_LIMITS["depth"]:
            raise yaml.YAMLError(f"more than {YAML_LIMITS['nodes']} values or {YAML_LIMITS['depth']} levels of "
                                 "nesting; a hand-written file has far fewer")
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1


def load_yaml(text: str):
    """yaml.safe_load under YAML_LIMITS (raises yaml.YAMLError past them)."""
    if len(text) > YAML_LIMITS["bytes"]:
        raise yaml.YAMLError(f"larger than {YAML_LIMITS['bytes']} bytes")
    loader = _BudgetLoader(text)
    try:
        return loader.get_single_data()
    except (ValueError, OverflowError, RecursionError) as e:     # an int of 5,000 digits, deep flow nesting
        raise yaml.YAMLError(str(e).splitlines()[0][:120] if str(e) else type(e).__name__) from None
    finally:
        loader.dispose()


def key_lines(text: str) -> dict[str, int]:
    """Key -> 1-based line number of a flat YAML mapping (for error messages)."""
    node = yaml.compose(text)
    if node is None or not isinstance(node, yaml.MappingNode):
        return {}
    return {k.value: k.start_mark.line + 1 for k, _ in node.value}
