"""Memoisation of pure functions of frozen values (profiles, layouts, specs), for the planner's
search, which asks the same question of the same value many times."""
from __future__ import annotations

from functools import wraps

SIZE = 8192
"""Entries one memoised function keeps; past that its cache starts again (the planner's search of one
plan asks for far fewer distinct values)."""


def memoised(fn):
    """`fn` cached on its positional arguments, each argument tuple hashed once on a hit; arguments
    that cannot be hashed (a module's tp_plan dict inside a profile) are computed, never refused, and
    a TypeError raised inside `fn` reaches the caller as it is."""
    cache: dict = {}

    @wraps(fn)
    def call(*args):
        try:
            return cache[args]
        except KeyError:
            pass
        except TypeError:               # an argument that cannot be hashed
            return fn(*args)
        if len(cache) >= SIZE:
            cache.clear()
        out = cache[args] = fn(*args)
        return out
    return call
