"""Local backend: a stage's verifier started ahead (``multislice.backends.local.warm_tools``, ``multislice.trainer
.warm``), with a stand-in verifier (:mod:`tests.warm_stand_in`) in the trainer environment.

Every wait is on an event: the tool's log line (inotify) or a process's end (pidfd), never a delay.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from multislice.backends.local import pid_alive, warm_tools
from multislice.backends.local.backend import LocalBackend
from multislice.backends.local.environment import trainer_env
from multislice.trainer.warm import READY
from tests.backends.local.test_backend import finish, scripted_jobset
from tests.inotify import wait_for_text
from tests.test_cancel import wait_gone

STAND_IN = "tests.warm_stand_in"


def stand_in_argv(*args: str, maxtext: tuple[str, ...] = ("steps=3",)) -> list[str]:
    return [str(trainer_env() / "bin" / "python"), "-m", STAND_IN, *args, "--", *maxtext]


def started(tmp_path: Path, stage: str = "s1", run_id: str = "run-a", **kwargs) -> warm_tools.WarmTool:
    """A stand-in tool started ahead and warmed up (its log says so)."""
    found = warm_tools.start(str(tmp_path), stage, run_id, stand_in_argv("--card", "{}"), **kwargs)
    assert wait_for_text(Path(found.log), READY, timeout=120), Path(found.log).read_text()
    return found


def test_the_verify_step_hands_its_arguments_to_the_tool_warmed_up_during_training(tmp_path):
    found = started(tmp_path)
    assert pid_alive(found.pid)
    argv = stand_in_argv("--card", '{"train_loss": 2.5}')  # known only now: sent with the go request
    taken = warm_tools.take(str(tmp_path), "s1", "run-a", argv)
    assert taken == found
    done = warm_tools.run(taken, argv, timeout=120, cancel_point="verify_checkpoint:verifying", what="the stand-in")
    assert done.returncode == 0, done.stderr
    said = json.loads(done.stdout)
    assert said == {"args": argv[3:], "warmed_first": True, "pid": found.pid}  # in the warmed process, its own args
    assert "stand-in run on stderr" in done.stderr and "stand-in warm-up" in done.stderr  # the log: not the report
    assert not wait_gone({found.pid}, timeout=60)
    assert not warm_tools.record_path(str(tmp_path), "s1", "run-a").exists()  # used once
    assert not Path(found.fifo).exists() and Path(found.log).exists()  # its log stays, as a pod's does
    assert warm_tools.take(str(tmp_path), "s1", "run-a", argv) is None


def test_the_tools_exit_status_is_the_verifiers(tmp_path):
    found = started(tmp_path)
    argv = stand_in_argv("exit=3")
    done = warm_tools.run(found, argv, timeout=120, cancel_point="verify_checkpoint:verifying", what="the stand-in")
    assert done.returncode == 3 and json.loads(done.stdout)["args"] == argv[3:]


@pytest.mark.parametrize(
    "argv",
    [
        stand_in_argv(maxtext=("steps=4",)),  # warmed up for other MaxText arguments (its lean imports differ)
        [str(trainer_env() / "bin" / "python"), "-m", "tests.processes", "--", "steps=3"],  # another module
    ],
    ids=["other-maxtext-arguments", "another-module"],
)
def test_a_tool_started_for_another_command_is_stopped_and_the_verifier_starts_anew(tmp_path, argv):
    found = started(tmp_path)
    assert warm_tools.take(str(tmp_path), "s1", "run-a", argv) is None
    assert not wait_gone({found.pid}, timeout=60)
    assert warm_tools.take(str(tmp_path), "s1", "run-b", stand_in_argv()) is None  # none for another run


def test_an_unused_tool_ends_once_its_starter_has_and_its_grace_is_over(tmp_path):
    starter = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    found = started(tmp_path, starter=starter.pid, grace=0.0)
    assert pid_alive(found.pid)  # it waits while the train step (its starter) runs
    assert starter.stdin is not None
    starter.stdin.close()
    starter.wait(timeout=60)
    assert not wait_gone({found.pid}, timeout=60)
    assert "not used" in Path(found.log).read_text()


def test_cleanup_stops_only_its_own_runs_tools(tmp_path):
    ours, theirs = started(tmp_path, run_id="run-a"), started(tmp_path, run_id="run-b")
    assert warm_tools.stop_run(str(tmp_path), "run-a") == ["s1"]
    assert not wait_gone({ours.pid}, timeout=60)
    assert pid_alive(theirs.pid) and warm_tools.record_path(str(tmp_path), "s1", "run-b").exists()
    assert warm_tools.stop_run(str(tmp_path), "run-b") == ["s1"]
    assert not wait_gone({theirs.pid}, timeout=60)


def test_no_verifier_is_started_ahead_for_pods_that_do_not_run_the_trainer(tmp_path):
    """A test's scripted pods (the real CPU JobSet with its command replaced) train nothing: nothing to verify."""
    plan, obj = scripted_jobset(tmp_path, "ok")
    backend = LocalBackend(plan.run_dir)
    backend.jobsets.create_jobset(obj)
    said: list[str] = []
    backend.prepare_verifier(plan, plan.stages[0], "run-a", said.append)
    assert said == [] and not (Path(plan.run_dir) / warm_tools.FOLDER).exists()
    assert finish(backend.jobsets, obj["metadata"]["name"]).phase == "Completed"
