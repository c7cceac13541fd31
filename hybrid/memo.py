"""Memoisation of pure functions of frozen values (profiles, layouts, specs), for the planner's
search, which asks the same question of the same value many times."""
from __future__ import annotations

from functools import lru_cache, wraps


def memoised(fn):
    """`fn` cached on its arguments (lru_cache, 8192 entries); arguments that cannot be hashed (a
    module's tp_plan dict inside a profile) are computed, never refused."""
    cached = lru_cache(maxsize=8192)(fn)

    @wraps(fn)
    def call(*args):
        try:
            hash(args)
        except TypeError:
            return fn(*args)
        return cached(*args)
    call.cache_clear = cached.cache_clear
    return call
