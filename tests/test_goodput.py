"""Goodput and badput from the leader's log (multislice.goodput), as Google's ml-goodput-measurement defines them.

``tests/data/leader_log_restart.tsv`` is a real leader log recorded on this machine: the worker
(``python -m multislice.trainer.worker``, one CPU process, MaxText 0.2.5, the tiny Llama preset on synthetic
data, async checkpoints every 3 steps, a persistent compilation cache) trained 8 steps, exited, and was started
again with ``steps=12``: it restored step 7 and trained 8-11. MaxText's 700 ``Config param`` lines are left out.
Each line's time is its absl timestamp less the first start's (an unstamped worker line takes the next stamped
line's time: it was printed just before it); the header holds the wall time from the first start to the end.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from multislice import goodput

RECORDED = Path(__file__).parent / "data" / "leader_log_restart.tsv"


def recorded() -> tuple[list[tuple[float, str]], float]:
    """The recorded log's ``(seconds, line)`` and its wall time."""
    lines, wall = [], 0.0
    for row in RECORDED.read_text(encoding="utf-8").splitlines():
        at, _, line = row.partition("\t")
        if at == "# wall_seconds":
            wall = float(line)
        else:
            lines.append((float(at), line))
    return lines, wall


def test_a_recorded_restart_splits_into_googles_categories():
    lines, wall = recorded()
    measured = goodput.measure(lines, wall)
    # By hand from the log's lines (see the module docstring):
    # start-up: "MaxText imported 39.0 s ..." and "... 113.7 s ...";
    # compile: 1.0 + 1.9 + 6.4 (attempt 0) + 0.1 + 0.7 (cache hits) + 40.0 (train_step: steps=12 is a new program);
    # restore: Orbax's "[sync] Finished load in 0.25 seconds" (not its "Finished blocking load");
    # save: the async saves' "Finished blocking save in" 0.05 + 0.03 + 0.15 + 0.08 + 0.23 + 0.42 seconds.
    assert measured.attempts == 2 and measured.steps_lost == 0
    assert measured.badput_seconds["startup"] == pytest.approx(152.7)
    assert measured.badput_seconds["compile"] == pytest.approx(50.1)
    assert measured.badput_seconds["restore"] == pytest.approx(0.25)
    assert measured.badput_seconds["checkpoint_save"] == pytest.approx(0.96)
    assert measured.badput_seconds["lost_steps"] == 0
    # Waiting: attempt 0's last line at 53.731 s, attempt 1's process start at 172.663 - 113.7 s.
    assert measured.badput_seconds["waiting"] == pytest.approx(172.663 - 113.7 - 53.731)
    # Productive: attempt 0's steps 0.146 (first, under the others' mean 1.145 / 7) + 1.145; attempt 1's
    # 0.545 (first, under (2.911 + 0.818 + 0.114) / 3) + 3.843; less the saves' 0.96 s.
    assert measured.productive_seconds == pytest.approx(0.146 + 1.145 + 0.545 + 3.843 - 0.96)
    assert measured.job_seconds == pytest.approx(wall)  # the first process started after following began
    assert measured.goodput == pytest.approx(measured.productive_seconds / wall)
    assert measured.productive_seconds + sum(measured.badput_seconds.values()) == pytest.approx(wall)


def step(n: int, seconds: float) -> str:
    return f"I1127 10:00:00.000000 1 metric_logger.py:265] completed step: {n}, seconds: {seconds:.3f}, loss: 7.0"


def test_steps_trained_again_are_wasted_progress_and_a_first_step_counts_the_steady_time():
    lines = [
        (0.0, "multislice worker: process 0 (slice 0, host 0) of 2"),
        (5.0, "multislice worker: MaxText imported 10.0 s after the process started; heavy packages imported: none"),
        (20.0, "multislice worker: XLA compile of jit(train_step): 12.0 s (compiled)"),
        (21.0, step(0, 14.0)),  # compile inside the first step: only the steady 2 s is productive
        (23.0, step(1, 2.0)),
        (25.0, step(2, 2.0)),
        (27.0, step(3, 2.0)),  # killed after step 3; checkpoint at step 1 (period 2: steps 0 and 2 ... saved 1)
        (40.0, "multislice worker: process 0 (slice 0, host 0) of 2"),
        (48.0, "multislice worker: MaxText imported 4.0 s after the process started; heavy packages imported: none"),
        (49.0, "[process=0] [sync] Finished blocking load in 0.50 seconds. Continuing load @ gs://b/c/1."),
        (50.0, "[process=0] [sync] Finished load in 1.50 seconds @ gs://b/c/1"),
        (51.0, "multislice worker: XLA compile of jit(train_step): 0.7 s (cache hit)"),
        (54.0, step(2, 3.0)),
        (56.0, step(3, 2.0)),
        (58.0, step(4, 2.0)),
    ]
    measured = goodput.measure(lines, wall_seconds=60.0)
    # Attempt 0: first step min(14, 2) = 2, steps 1-3 2 s each; steps 2 and 3 are trained again (lost: 4 s).
    # Attempt 1: first step (2) min(3, 2) = 2, then 2 + 2. Productive = 2 + 2 (steps 0, 1) + 2 + 2 + 2 = 10.
    assert measured.productive_seconds == pytest.approx(10.0)
    assert measured.steps_lost == 2 and measured.badput_seconds["lost_steps"] == pytest.approx(4.0)
    # The first process started at 5 - 10 = -5 s: 5 s before following began, added to the job's time.
    assert measured.job_seconds == pytest.approx(65.0)
    assert measured.badput_seconds["startup"] == pytest.approx(14.0)
    assert measured.badput_seconds["compile"] == pytest.approx(12.7)
    assert measured.badput_seconds["restore"] == pytest.approx(1.5)
    assert measured.badput_seconds["waiting"] == pytest.approx((48.0 - 4.0) - 27.0)
    assert measured.badput_seconds["other"] == pytest.approx(65.0 - 10.0 - 14.0 - 12.7 - 1.5 - 4.0 - 17.0)
    assert measured.goodput == pytest.approx(10.0 / 65.0)


def test_no_lines_or_no_time_is_no_goodput_and_never_negative_badput():
    empty = goodput.measure([], 30.0)
    assert empty.goodput == 0 and empty.badput_seconds["other"] == 30.0 and empty.attempts == 0
    assert goodput.measure([(0.0, step(0, 1.0))], 0.0).goodput == 0
    # Categories larger than the wall time (they overlap): other is 0, not negative.
    overlapping = goodput.measure([(0.0, "multislice worker: XLA compile of jit(f): 50.0 s (compiled)")], 10.0)
    assert overlapping.badput_seconds["other"] == 0


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("[process=0] [async] Finished blocking save in 0.42 seconds. Continuing save @ gs://b/11.",
         ("checkpoint_save", 0.42)),
        ("[process=0] [async] Finished save (blocking + background) in 3.10 seconds @ gs://b/11", None),
        ("[process=0] [sync] Finished save in 2.00 seconds @ /ckpt/4", ("checkpoint_save", 2.0)),
        ("[process=0] [sync] Finished blocking save in 1.00 seconds. Continuing save @ /ckpt/4.", None),
        ("[process=0] [sync] Finished load in 0.25 seconds @ /ckpt/7", ("restore", 0.25)),
        ("[process=0] [sync] Finished blocking load in 0.04 seconds. Continuing load @ /ckpt/7.", None),
        ("completed step: 3, seconds: 0.1, loss: 7.0", None),
    ],
)  # fmt: skip
def test_orbax_lines_count_only_what_blocks_training(line, expected):
    assert goodput.parse_orbax_line(line) == expected


def test_badput_words_name_the_causes_with_time_in_order():
    words = goodput.badput_words({"compile": 44.0, "startup": 40.0, "restore": 0.0, "other": 15.0}, 200.0)
    assert words == "start-up 40.0 s (20%), compile 44.0 s (22%), other 15.0 s (8%)"
    assert goodput.badput_words({}) == "none"
