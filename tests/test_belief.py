"""Cache belief: the EWMA of reused/claimed tokens per worker (paper section 3.4)."""

from __future__ import annotations

import pytest

from kvcompass.discovery.belief import CacheBelief


def test_false_claims_lower_the_belief_and_true_ones_restore_it() -> None:
    b = CacheBelief(2, weight=0.2)
    assert b[0] == 1.0 and b.values.tolist() == [1.0, 1.0]
    seen = [b.observe(0, claimed=1000, reused=0) for _ in range(3)]
    assert seen == pytest.approx([0.8, 0.64, 0.512])
    assert b.observe(0, claimed=1000, reused=500) == pytest.approx(0.8 * 0.512 + 0.2 * 0.5)
    for _ in range(40):
        b.observe(0, claimed=1000, reused=1000)
    assert b[0] == pytest.approx(1.0, abs=1e-3)
    assert b[1] == 1.0 and b.samples(0) == 44 and b.samples(1) == 0


def test_ratio_is_capped_and_unclaimed_responses_say_nothing() -> None:
    b = CacheBelief(1, weight=0.5, initial=0.5)
    assert b.observe(0, claimed=0, reused=900) == 0.5  # nothing was claimed: no evidence
    assert b.samples(0) == 0
    assert b.observe(0, claimed=100, reused=900) == 0.75  # reused more than claimed counts as 1
    b.reset(0)
    assert b[0] == 0.5 and b.samples(0) == 0


def test_belief_stays_in_unit_interval_for_weight_one() -> None:
    b = CacheBelief(1, weight=1.0)
    assert b.observe(0, 3, 1) == pytest.approx(1 / 3)
    assert b.observe(0, 3, 0) == 0.0
    assert b.observe(0, 3, 3) == 1.0


@pytest.mark.parametrize(("weight", "initial"), [(0.0, 1.0), (1.5, 1.0), (0.5, -0.1), (0.5, 1.1)])
def test_bad_parameters_are_refused(weight: float, initial: float) -> None:
    with pytest.raises(ValueError):
        CacheBelief(1, weight, initial)


def test_negative_counts_are_refused() -> None:
    b = CacheBelief(1, 0.2)
    with pytest.raises(ValueError):
        b.observe(0, -1, 0)
    with pytest.raises(ValueError):
        b.observe(0, 1, -1)
    assert b[0] == 1.0


def test_relax_moves_beliefs_back_with_the_half_life() -> None:
    b = CacheBelief(3, weight=1.0, initial=0.9)
    b.observe(0, 10, 0)  # 0
    b.observe(1, 10, 10)  # 1.0, above the initial value
    b.relax(100.0, half_life_s=10.0)  # the first call only starts the clock
    assert b.values.tolist() == [0.0, 1.0, 0.9]
    b.relax(100.5, half_life_s=10.0)  # under a step: nothing yet
    assert b.values.tolist() == [0.0, 1.0, 0.9]
    b.relax(110.0, half_life_s=10.0)
    assert b.values.tolist() == pytest.approx([0.45, 0.95, 0.9])
    # steps compose: two of 5 s equal one of 10 s
    c = CacheBelief(1, weight=1.0, initial=1.0)
    c.observe(0, 10, 0)
    c.relax(0.0, 10.0)
    c.relax(5.0, 10.0)
    c.relax(10.0, 10.0)
    assert c[0] == pytest.approx(0.5)
    # much later everything is back at the initial value, exactly
    b.relax(10_000.0, half_life_s=10.0)
    assert b.values.tolist() == [0.9, 0.9, 0.9]
    # a half-life of 0 disables recovery
    d = CacheBelief(1, weight=1.0)
    d.observe(0, 10, 0)
    d.relax(0.0, 0.0)
    d.relax(1e6, 0.0)
    assert d[0] == 0.0
