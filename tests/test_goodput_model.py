"""The goodput model's arithmetic (multislice.goodput_model): hand-checked cases and its monotonicity."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multislice.goodput_model import (
    Interruption,
    Phase,
    Restart,
    Stage,
    daly_period,
    expected_goodput,
    with_period,
    young_period,
)

RESTART = Restart(detect_and_reschedule=60, image_pull=40, startup=30, compile_cold=300, compile_cached=10,
                  restore_persistent=50, restore_emergency=5)  # fmt: skip


def stage(**changes) -> Stage:
    fields = dict(name="s", step_seconds=2.0, slices=2, persistent_period_steps=100, persistent_save_blocking=4.0,
                  restart=RESTART, emergency_period_steps=10, emergency_save_blocking=1.0, emergency_coverage=1.0,
                  capacity_wait=0.0)  # fmt: skip
    return Stage(**(fields | changes))


def test_persistent_only_by_hand():
    # tau = 100 x 2 + 4 = 204 s; overhead 4 / 204; restart 60 + 40 + 30 + 300 + 50 = 480 s; loss 480 + 102 = 582 s.
    predicted = expected_goodput(stage(), 3600.0, emergency=False, compile_cache=False)
    assert predicted.restart_seconds == 480
    assert predicted.loss_per_interruption == pytest.approx(582.0)
    assert predicted.checkpoint_overhead == pytest.approx(4 / 204)
    assert predicted.goodput == pytest.approx((1 - 4 / 204) * (1 - 582 / 3600))
    assert predicted.young_period_steps == pytest.approx(math.sqrt(2 * 4 * 3600) / 2)


def test_emergency_and_cache_by_hand():
    # Emergency tau = 10 x 2 + 1 = 21 s; restart 60 + 40 + 30 + 10 + 5 = 145 s; loss 145 + 10.5.
    predicted = expected_goodput(stage(), 3600.0, emergency=True, compile_cache=True)
    assert predicted.restart_seconds == 145
    assert predicted.loss_per_interruption == pytest.approx(155.5)
    assert predicted.goodput == pytest.approx((1 - 4 / 204 - 1 / 21) * (1 - 155.5 / 3600))
    # Half the interruptions restore from the persistent tier: restart and lost progress mix.
    half = expected_goodput(stage(emergency_coverage=0.5), 3600.0, emergency=True, compile_cache=True)
    assert half.restart_seconds == pytest.approx(0.5 * 145 + 0.5 * 190)
    assert half.loss_per_interruption == pytest.approx(167.5 + 0.5 * 10.5 + 0.5 * 102)


def test_elastic_by_hand():
    # Capacity back after 1200 s: waiting loses 1200 s; elastic goes on at half speed (600 s lost) and restarts twice.
    waiting = expected_goodput(stage(capacity_wait=1200), 7200.0, emergency=False, compile_cache=True)
    elastic = expected_goodput(stage(capacity_wait=1200), 7200.0, emergency=False, compile_cache=True, elastic=True)
    assert waiting.loss_per_interruption == pytest.approx(190 + 102 + 1200)
    assert elastic.loss_per_interruption == pytest.approx(190 + 102 + 600 + 190)
    assert elastic.goodput > waiting.goodput


def test_interruptions_faster_than_a_restart_leave_no_goodput():
    assert expected_goodput(stage(), 300.0, emergency=False, compile_cache=False).goodput == 0


def test_young_and_daly_periods():
    assert young_period(4.0, 3600.0) == pytest.approx(math.sqrt(28800))
    assert daly_period(4.0, 3600.0, 480.0) == pytest.approx(math.sqrt(2 * 4 * 4080) - 4)
    assert daly_period(3000.0, 3600.0, 0.0) == 3600.0  # a save costing over half the MTBI: once per MTBI
    with pytest.raises(ValueError, match="mtbi > 0"):
        young_period(1.0, 0.0)


@pytest.mark.parametrize(
    ("changes", "options", "message"),
    [
        ({}, {"emergency": True, "compile_cache": False, "mtbi": 0.0}, "mtbi > 0"),
        ({"emergency_period_steps": None}, {"emergency": True, "compile_cache": False, "mtbi": 60.0},
         "emergency_period_steps"),
        ({"slices": 1}, {"emergency": False, "compile_cache": False, "elastic": True, "mtbi": 60.0}, "2 slices"),
    ],
)  # fmt: skip
def test_impossible_choices_name_the_field(changes, options, message):
    mtbi = options.pop("mtbi")
    with pytest.raises(ValueError, match=message):
        expected_goodput(stage(**changes), mtbi, **options)


hours = st.floats(min_value=0.1, max_value=1000.0)
periods = st.integers(min_value=1, max_value=10_000)
choices = st.sampled_from([(False, False), (False, True), (True, False), (True, True)])


@settings(max_examples=200, deadline=None)
@given(hours, hours, choices)
def test_goodput_never_falls_as_interruptions_get_rarer(a, b, choice):
    emergency, cache = choice
    low, high = sorted((a, b))
    worse = expected_goodput(stage(), low * 3600, emergency=emergency, compile_cache=cache).goodput
    better = expected_goodput(stage(), high * 3600, emergency=emergency, compile_cache=cache).goodput
    assert 0 <= worse <= better <= 1


@settings(max_examples=200, deadline=None)
@given(hours, choices, st.floats(min_value=0, max_value=600))
def test_a_faster_restart_never_lowers_goodput(mtbi_hours, choice, cut):
    emergency, cache = choice
    base = stage()
    faster = stage(restart=Restart(**{**RESTART.__dict__, "startup": max(0.0, RESTART.startup - cut)}))
    slower = stage(restart=Restart(**{**RESTART.__dict__, "image_pull": RESTART.image_pull + cut}))
    g = [expected_goodput(s, mtbi_hours * 3600, emergency=emergency, compile_cache=cache).goodput
         for s in (faster, base, slower)]  # fmt: skip
    assert g[0] >= g[1] >= g[2]
    # The compile cache is never worse than compiling.
    assert (
        expected_goodput(base, mtbi_hours * 3600, emergency=emergency, compile_cache=True).goodput
        >= expected_goodput(base, mtbi_hours * 3600, emergency=emergency, compile_cache=False).goodput
    )


@settings(max_examples=100, deadline=None)
@given(st.floats(min_value=1.0, max_value=500.0), st.floats(min_value=0.5, max_value=50.0))
def test_youngs_period_is_near_the_best_one(mtbi_hours, save):
    """Goodput at Young's period is within a percent of the best over a sweep of periods (first-order optimum)."""
    base = stage(persistent_save_blocking=save)
    mtbi = mtbi_hours * 3600
    young = max(1, round(young_period(save, mtbi) / base.step_seconds))
    at_young = expected_goodput(with_period(base, young), mtbi, emergency=False, compile_cache=True).goodput
    sweep = [max(1, round(young * f)) for f in (0.25, 0.5, 0.75, 1.5, 2, 4)]
    best = max(expected_goodput(with_period(base, p), mtbi, emergency=False, compile_cache=True).goodput for p in sweep)
    assert at_young >= best - 0.01


@settings(max_examples=100, deadline=None)
@given(periods, periods, hours)
def test_a_longer_period_costs_less_saving_but_loses_more_per_interruption(p, q, mtbi_hours):
    short, long = sorted((p, q))
    a = expected_goodput(with_period(stage(), short), mtbi_hours * 3600, emergency=False, compile_cache=True)
    b = expected_goodput(with_period(stage(), long), mtbi_hours * 3600, emergency=False, compile_cache=True)
    assert b.checkpoint_overhead <= a.checkpoint_overhead
    assert b.loss_per_interruption >= a.loss_per_interruption


def test_docs_hold_the_table_the_benchmark_prints():
    """docs/goodput.md's predictions are what ``python -m benchmarks.goodput_model`` computes from the profile."""
    from pathlib import Path

    from benchmarks import goodput_model as benchmark

    doc = (Path(__file__).resolve().parents[1] / "docs" / "goodput.md").read_text(encoding="utf-8")
    assert benchmark.markdown(benchmark.predictions()) in doc


def test_an_interruption_is_its_phases_and_costs_its_share_of_the_mtbi():
    cost = Interruption("s", "InPlaceRestart", (Phase("a", 20.0, "x"), Phase("b", 40.0, "y")), checkpoint_overhead=0.01)
    assert cost.seconds == 60.0
    assert cost.goodput(600.0) == pytest.approx(0.99 * 0.9)
    assert Interruption("s", "Recreate", (Phase("a", 900.0, "x"),), 0.0).goodput(600.0) == 0.0
    with pytest.raises(ValueError, match="mtbi > 0"):
        cost.goodput(0.0)


def test_docs_hold_the_restart_cost_model_the_benchmark_prints():
    """docs/goodput.md's one-interruption table is what the benchmark computes, and every phase names its source."""
    from pathlib import Path

    from benchmarks import goodput_model as benchmark

    pairs = benchmark.interruptions()
    doc = (Path(__file__).resolve().parents[1] / "docs" / "goodput.md").read_text(encoding="utf-8")
    assert benchmark.interruption_table(pairs) in doc
    for pair in pairs:
        assert [phase.name.split(" (")[0] for phase in pair[0].phases][-3:] == ["restore", "steps redone", "first step"]
        assert all(phase.source for interruption in pair for phase in interruption.phases)
