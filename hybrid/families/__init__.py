"""The family registry: one object per backend family (ddp, fsdp, deepspeed), registered once.

Each owns its typed config (catalogue knobs and rules), check(layout), the placement of its bytes,
its communication and host work, its runtime module (check, place, wrap, engine:
hybrid/runtime/parallelize.py calls them in the one order; traced_apply), what a traced run
replaces, and its hand-off module (hybrid/handoff/). The planner, the estimators, the CLI and the
emitters ask the registry; nothing branches on a family's name. A new family is one module here
(plus its backend, its hand-off and YAML presets) and one line below.
"""
from __future__ import annotations

from ..errors import unknown_name
from .base import Comm, Family
from .ddp import FAMILY as _DDP
from .deepspeed import FAMILY as _DEEPSPEED
from .fsdp import FAMILY as _FSDP

FAMILIES: dict[str, Family] = {f.name: f for f in (_DDP, _FSDP, _DEEPSPEED)}

__all__ = ["Comm", "FAMILIES", "Family", "get_family"]


def get_family(name: str) -> Family:
    if name not in FAMILIES:
        raise unknown_name("strategy family", name, FAMILIES)
    return FAMILIES[name]
