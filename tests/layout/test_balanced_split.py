"""balanced_split gives back surplus blocks in closed form: the same split as the one-at-a-time
loop it replaces (kept here as the reference) on random inputs, and at once on a huge model."""
import random
import time

import pytest

from hybrid.layout.pipeline import balanced_split

pytestmark = pytest.mark.unit


def _reference(layers, fixed, per_block):
    """The implementation before closed form (hybrid 0.2): bisection, then one block at a time."""
    stages = len(fixed)

    def counts(limit):
        return [max(1, int((limit - f) // b)) if b > 0 else layers for f, b in zip(fixed, per_block)]

    lo, hi = 0.0, max(f + layers * b for f, b in zip(fixed, per_block))
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(counts(mid)) >= layers:
            hi = mid
        else:
            lo = mid
    n = counts(hi)
    while sum(n) > layers:
        i = max((j for j in range(stages) if n[j] > 1), key=lambda j: fixed[j] + n[j] * per_block[j])
        n[i] -= 1
    return tuple(n)


def _case(rng):
    stages = rng.choice([1, 2, 3, 4, 5, 8, 16])
    layers = rng.randint(stages, rng.choice([stages + 3, 40, 200, 3000]))
    kind = rng.random()
    if kind < 0.3:                                   # small integers: many ties
        fixed = [float(rng.randint(-3, 6)) for _ in range(stages)]
        per = [float(rng.randint(0, 3)) for _ in range(stages)]
    elif kind < 0.7:                                 # memory-like bytes
        fixed = [rng.uniform(-1e9, 5e10) for _ in range(stages)]
        per = [rng.uniform(1e6, 3e9) for _ in range(stages)]
    elif kind < 0.9:                                 # fixed costs so large the bisection overshoots: a long loop
        big = 10 ** rng.uniform(12, 19)
        fixed = [big * rng.uniform(0.999, 1.0) for _ in range(stages)]
        per = [rng.uniform(0.5, 2.0) for _ in range(stages)]
    else:                                            # the odd ones: zero and negative per-block costs
        fixed = [rng.uniform(-10, 10) for _ in range(stages)]
        per = [rng.choice([0.0, -1.0, rng.uniform(-2, 2), rng.uniform(0, 5)]) for _ in range(stages)]
    return layers, fixed, per


@pytest.mark.slow
def test_balanced_split_matches_the_one_at_a_time_loop_on_random_inputs():
    rng = random.Random(20261201)
    checked = 0
    for _ in range(3000):
        layers, fixed, per = _case(rng)
        try:
            want = _reference(layers, fixed, per)
        except (ValueError, OverflowError, ZeroDivisionError):
            continue                                 # an input the loop did not handle
        assert balanced_split(layers, fixed, per) == want, (layers, fixed, per)
        checked += 1
    assert checked > 2500


def test_balanced_split_answers_at_once_where_the_loop_ran_for_hours():
    start = time.monotonic()
    n = balanced_split(100, [1e30, 0.999999e30], [1.0, 1.1])       # the loop: ~10**15 steps (1e22: 3 s)
    assert n == (1, 99)
    n = balanced_split(10 ** 12, [0.0, 0.0], [0.0, 1.0])          # a free stage takes every block, then gives back
    assert n == (10 ** 12 - 1, 1)
    assert time.monotonic() - start < 1.0
