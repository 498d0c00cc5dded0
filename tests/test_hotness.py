"""Prefix-family hotness: H local misses within the sliding window T_h (paper section 3.4)."""

from __future__ import annotations

import pytest

from kvcompass.discovery import hotness
from kvcompass.discovery.hotness import HotnessTracker


def test_hot_at_h_misses_within_the_window_inclusive() -> None:
    h = HotnessTracker(hot_misses=3, window_s=1.0)
    assert not h.observe_miss(7, 0.0)
    assert not h.observe_miss(7, 0.5)
    assert h.observe_miss(7, 1.0)  # 0.0 .. 1.0 spans exactly T_h
    assert h.is_hot(7, 1.0)
    assert not h.is_hot(7, 1.01)  # the miss at 0.0 left the window
    assert h.misses(7, 1.01) == 2
    assert not h.is_hot(8, 1.0)  # families are independent


def test_misses_spread_wider_than_the_window_never_make_a_family_hot() -> None:
    h = HotnessTracker(3, 1.0)
    assert not any(h.observe_miss(1, t) for t in [0.0, 0.6, 1.2, 1.8, 2.4])


def test_quiet_families_are_forgotten() -> None:
    h = HotnessTracker(2, 1.0)
    for f in range(100):
        h.observe_miss(f, 0.0)
    assert len(h) == 100
    h.sweep(0.5)
    assert len(h) == 100
    h.sweep(1.5)
    assert len(h) == 0
    assert h.misses(3, 2.0) == 0


def test_periodic_sweep_bounds_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hotness, "_SWEEP_EVERY", 10)
    h = HotnessTracker(2, 1.0)
    for i in range(100):
        h.observe_miss(i, float(i))  # each family misses once, one second apart
    assert len(h) <= 11


def test_one_miss_suffices_when_h_is_one() -> None:
    assert HotnessTracker(1, 0.1).observe_miss(5, 3.0)


@pytest.mark.parametrize(("h", "w"), [(0, 1.0), (3, 0.0)])
def test_bad_parameters_are_refused(h: int, w: float) -> None:
    with pytest.raises(ValueError):
        HotnessTracker(h, w)
