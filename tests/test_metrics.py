"""Metrics summary from MaxText's metrics file, including a restarted run's repeated steps."""

import json

import pytest

from multislice import metrics


def record(step, loss, seconds, tokens=256.0, tflops=0.01):
    return {"step": float(step), "learning/loss": loss, "perf/step_time_seconds": seconds,
            "perf/per_device_tokens": tokens, "perf/per_device_tflops": tflops}  # fmt: skip


def test_summary_uses_steady_steps_and_totals():
    records = [record(0, 7.5, 30.0), record(1, 7.0, 1.0), record(2, 6.5, 3.0)]
    summary = metrics.summarize(records)
    assert (summary.steps_recorded, summary.first_loss, summary.final_loss) == (3, 7.5, 6.5)
    assert summary.step_time_seconds == 2.0  # step 0 (compilation) left out
    assert summary.tokens_per_second_per_device == 512 / 4.0
    assert summary.tflops_per_second_per_device == pytest.approx(0.02 / 4.0)


def test_restarted_run_keeps_the_last_record_of_each_step():
    records = [record(s, 8.0 - s, 1.0) for s in range(5)] + [record(s, 9.0 - s, 2.0) for s in range(3, 7)]
    summary = metrics.summarize(records)
    assert (summary.steps_recorded, summary.last_step, summary.records) == (7, 6, 9)
    assert summary.final_loss == 3.0
    # steps 1, 2 (attempt 0) and 4, 5, 6 (attempt 1): the first step of each attempt is left out
    assert summary.step_time_seconds == pytest.approx((1.0 * 2 + 2.0 * 3) / 5)


def test_truncated_last_line_is_skipped(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(record(0, 7.0, 1.0)) + "\n" + '{"step": 1.0, "learn')
    assert len(metrics.read_records(path)) == 1


def test_no_records_is_an_error():
    with pytest.raises(ValueError, match="did training start"):
        metrics.summarize([])


def test_compile_lines_of_each_attempt_say_how_long_and_whether_the_cache_served_them():
    """The worker's lines (multislice.trainer.compile_cache.report_compiles, the exact format it prints),
    as the train step reads them from the leader's log of each attempt."""
    lines = [
        "multislice worker: XLA compile of jit(train_step): 26.6 s (compiled)",
        "multislice worker: XLA compile of jit(<lambda>): 7.2 s (compiled)",
        "[pod] multislice worker: XLA compile of jit(train_step): 0.9 s (cache hit)",
        "completed step: 3, seconds: 0.1",
    ]
    parsed = [metrics.parse_compile_line(line) for line in lines]
    assert parsed[0] == {"function": "jit(train_step)", "seconds": 26.6, "cache_hit": False}
    assert parsed[1]["function"] == "jit(<lambda>)" and parsed[2]["cache_hit"] and parsed[3] is None
    compiles = [{"attempt": 0, **parsed[0]}, {"attempt": 0, **parsed[1]}, {"attempt": 1, **parsed[2]}]
    assert metrics.compile_seconds_by_attempt(compiles) == [(33.8, 0, 2), (0.9, 1, 1)]
    assert metrics.compile_seconds_by_attempt([]) == []


def test_restore_lines_give_the_step_and_with_emergency_checkpoints_the_tier():
    from multislice.steps.train import note_restore
    from tests.kube_controllers import restore_lines

    assert [metrics.parse_restore_line(line) for line in restore_lines(None).splitlines()] == [{"step": None}]
    local = [metrics.parse_restore_line(line) for line in restore_lines(20, "local", slice_id=3).splitlines()]
    assert local == [None, {"step": 20}, {"step": 20, "tier": "local", "slice": 3}]
    persistent = restore_lines(50, "persistent", directory="gs://b/r/s/checkpoints").splitlines()
    assert metrics.parse_restore_line(persistent[-1]) == {"step": 50, "tier": "persistent"}
    restores: list = []
    told = [note_restore(restores, 1, record) for record in local if record]
    assert restores == [{"attempt": 1, "step": 20, "tier": "local", "slice": 3}]
    assert told == ["", "attempt 1 restored from the local tier at step 20 (slice 3)"]
    assert metrics.parse_restore_line("restoring step=5 from somewhere") is None
