"""``benchmarks.pipeline_overhead``: issue 28's figure from a kfp.local log, as kfp.local writes it."""

import pytest

from benchmarks.pipeline_overhead import overhead

# kfp 2.17's kfp.local lines (kfp/local/task_dispatcher.py and pipeline_orchestrator.py log them,
# logging_utils.py colours the names), past midnight once.
LOG = """\
23:59:00.000 - INFO - Running pipeline: \x1b[95m'multislice-training'\x1b[0m
23:59:00.100 - INFO - Executing task \x1b[96m'preflight'\x1b[0m
    [preflight tiny] fits
23:59:40.100 - INFO - Task \x1b[96m'preflight'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
23:59:40.200 - INFO - Executing task \x1b[96m'train'\x1b[0m
00:01:20.200 - INFO - Task \x1b[96m'train'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
00:01:20.300 - INFO - Executing task \x1b[96m'verify-checkpoint'\x1b[0m
00:01:30.300 - INFO - Task \x1b[96m'verify-checkpoint'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
00:01:30.400 - INFO - Executing task \x1b[96m'train-2'\x1b[0m
00:02:30.400 - INFO - Task \x1b[96m'train-2'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
00:02:40.000 - INFO - Pipeline \x1b[95m'multislice-training'\x1b[0m finished with status \x1b[92mSUCCESS\x1b[0m
"""


def test_the_figure_is_the_wall_less_preflight_over_the_train_tasks():
    found = overhead(LOG)
    assert found["pipeline_wall_seconds"] == 220.0  # 23:59:00 to 00:02:40, across midnight
    assert (found["preflight_seconds"], found["train_seconds"]) == (40.0, 160.0)  # train and train-2
    assert found["wall_minus_preflight_over_train"] == pytest.approx(180 / 160, abs=1e-3)
    assert found["by_kind"]["verify-checkpoint"] == 10.0 and found["tasks"]["train-2"] == 60.0


def test_a_task_that_never_finished_is_an_error():
    with pytest.raises(ValueError, match="train-2"):
        overhead(LOG.rsplit("00:02:30", 1)[0])
