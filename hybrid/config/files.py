"""Reading the files a user names: YAML (job and strategy files) under a budget of size, values
and nesting, with no aliases, so no file can expand or run code."""
from __future__ import annotations

import yaml

YAML_LIMITS = {"bytes": 1 << 20, "nodes": 10_000, "depth": 16}
"""What a job or strategy file may take: size, YAML nodes and nesting (a hand-written file has a
few dozen nodes, two levels); aliases (*name) are refused outright, so no file can expand."""


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
