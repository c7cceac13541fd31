"""Hand-off to other tools: the chosen strategy's config, written by its family (hybrid/families/):
a DeepSpeed JSON config, or FSDP2 settings as YAML."""
from __future__ import annotations

from .errors import HybridError
from .families import FAMILIES
from .planner import Candidate, Plan
from .profile import ModelProfile

KINDS = {f.emits: f for f in FAMILIES.values() if f.emits}
"""--emit choices -> the family that writes them."""


def _pick(p: Plan, family, name: str | None) -> Candidate:
    """The named strategy's best fitting candidate, else the chosen one if it is of this family,
    else the fastest fitting candidate of this family."""
    pool = [c for c in p.candidates if c.strategy.family_obj is family and c.memory is not None]
    if name:
        pool = [c for c in pool if c.name == name]
        if not pool:
            from .catalogue import load_catalogue
            valid = sorted(n for n, s in load_catalogue().items() if s.family_obj is family)
            raise HybridError(f"strategy {name!r} is not a {family.name} strategy; --emit {family.emits} "
                              f"needs one of: {', '.join(valid)}")
    elif p.chosen is not None and p.chosen.strategy.family_obj is family:
        return p.chosen
    fitting = [c for c in pool if c.fits]
    if not fitting:
        raise HybridError(f"no {family.name} candidate fits this job; see `hybrid plan` for why")
    return min(fitting, key=lambda c: c.cost.time_per_token)


def emit(kind: str, p: Plan, profile: ModelProfile, name: str | None = None) -> str:
    if kind not in KINDS:
        raise HybridError(f"unknown --emit {kind!r}. Available: {', '.join(KINDS)}")
    family = KINDS[kind]
    return family.emit(_pick(p, family, name), p, profile)
