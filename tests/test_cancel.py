"""Cancel-safety: SIGTERM or SIGINT at any named state of any step leaves no process and no JobSet behind.

Each case runs the local pipeline's components in a subprocess
(:mod:`tests.cancel_driver`: the real steps on the local backend, with tiny
Python pods instead of MaxText) up to a cancel point
(:func:`multislice.cancel.point`): the step announces the point on a FIFO and
waits; the test then signals it, waits for it to end, and checks the run
directory and /proc: every JobSet is terminal and no process of the run (a
supervisor, a pod, an AOT compile, the verifier) is alive. No sleeps: the
step is stopped at the state by the hook, and process ends are awaited through
pidfds.

The driver is imported once per module (:class:`Driver`, a zygote: the
components' imports cost about 5 s of CPU) and each case is a fresh process
forked from it, in its own session, with a fresh interpreter's signal
dispositions.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from multislice import cancel
from multislice.backends.local import LocalJobSets, pid_alive
from multislice.backends.local.jobsets import PID_FILE
from tests.cancel_driver import RUN_NAME

ROOT = Path(__file__).resolve().parents[1]
#: Seconds a step may take to reach a point, or to finish after the signal (bounds, not synchronisation).
LIMIT = 240

#: (point, step the driver runs up to, pod mode, what exists when the signal arrives: "jobset" or "none").
POINTS = [
    ("plan:entry", "plan", "sleep", "none"),
    ("plan:start", "plan", "sleep", "none"),
    ("plan:report", "plan", "sleep", "none"),
    ("preflight:entry", "preflight", "sleep", "none"),
    ("preflight:start", "preflight", "sleep", "none"),
    ("preflight:compiling", "preflight", "sleep", "none"),
    ("provision:entry", "provision", "sleep", "none"),
    ("provision:start", "provision", "sleep", "none"),
    ("provision:checking", "provision", "sleep", "none"),
    ("provision:report", "provision", "sleep", "none"),
    ("admit:entry", "admit", "sleep", "none"),
    ("admit:start", "admit", "sleep", "none"),
    ("admit:before-create", "admit", "sleep", "none"),
    ("admit:created", "admit", "sleep", "jobset"),
    ("admit:waiting", "admit", "sleep", "jobset"),
    ("admit:report", "admit", "sleep", "jobset"),
    ("launch:start", "launch", "sleep", "jobset"),
    ("launch:waiting", "launch", "sleep", "jobset"),
    ("launch:report", "launch", "sleep", "jobset"),
    ("train:start", "train", "sleep", "jobset"),
    ("train:following", "train", "sleep", "jobset"),
    ("train:report", "train", "done", "completed"),
    ("verify_checkpoint:start", "verify_checkpoint", "done", "completed"),
    ("verify_checkpoint:verifying", "verify_checkpoint", "done", "completed"),
    ("cleanup:entry", "cleanup", "sleep", "jobset-left"),
    ("cleanup:start", "cleanup", "sleep", "jobset"),
    ("cleanup:deleting", "cleanup", "sleep", "jobset"),
]


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait (on pidfds, no polling) until every process in ``pids`` has exited; those still alive after ``timeout``."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        waiting = {fd for fd, pid in fds.items() if pid_alive(pid)}
        while waiting:
            ready, _, _ = select.select(list(waiting), [], [], timeout)
            if not ready:
                break
            waiting -= set(ready)
        return {fds[fd] for fd in waiting if pid_alive(fds[fd])}
    finally:
        for fd in fds:
            os.close(fd)


def run_processes(root: Path) -> set[int]:
    """Live processes of the run: supervisors and pods from the JobSet state files, and any process of this
    machine whose command line or working directory is under ``root`` (pods, supervisors, AOT, verifier)."""
    found: set[int] = set()
    jobsets = root / RUN_NAME / "jobsets"
    for state_dir in jobsets.iterdir() if jobsets.is_dir() else []:
        state = LocalJobSets(root / RUN_NAME).get_jobset(state_dir.name)
        if state:
            found |= {p.pid for p in state.pods if p.pid} | {state.supervisor_pid or 0}
        if (state_dir / PID_FILE).exists():
            found.add(int((state_dir / PID_FILE).read_text()))
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(entry / "cwd")
        except OSError:
            continue
        if str(root) in cmdline or cwd.startswith(str(root)):
            found.add(int(entry.name))
    return {pid for pid in found if pid and pid_alive(pid)}


class Driver:
    """``python -m tests.cancel_driver --serve`` (the driver, imported once: a zygote) and the case it runs.

    Each :meth:`start` forks one fresh driver process from it (:func:`tests.cancel_driver.serve`); the test
    signals it through a pidfd and gets its exit status (``Popen.returncode``'s convention) from the zygote.
    """

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        self.zygote = subprocess.Popen(
            [sys.executable, "-m", "tests.cancel_driver", "--serve"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=env, cwd=ROOT, preexec_fn=cancel.die_with_parent(),  # it dies with the suite
        )  # fmt: skip
        self.pid = 0
        self.pidfd = -1
        self.returncode: int | None = None

    def start(self, argv: list[str], env: dict[str, str], log: Path) -> int:
        """Fork a driver running ``main(*argv)`` with this environment, its output to ``log``; its pid fd."""
        assert self.zygote.stdin and self.zygote.stdout and self.zygote.poll() is None
        request = {"argv": argv, "env": env, "cwd": str(ROOT), "log": str(log)}
        self.zygote.stdin.write(json.dumps(request) + "\n")
        self.zygote.stdin.flush()
        self.pid = int(self.zygote.stdout.readline())
        self.pidfd = os.pidfd_open(self.pid)  # the zygote reaps it only after reporting: the pid is still its
        self.returncode = None
        return self.pidfd

    def send_signal(self, sig: int) -> None:
        signal.pidfd_send_signal(self.pidfd, sig)

    def wait(self, timeout: float) -> int:
        """The driver's exit status once it has ended; raises TimeoutError after ``timeout`` seconds."""
        if self.returncode is None:
            ready, _, _ = select.select([self.pidfd], [], [], timeout)
            if not ready:
                raise TimeoutError(f"the cancel driver {self.pid} still runs after {timeout} s")
            assert self.zygote.stdout
            self.returncode = int(self.zygote.stdout.readline())
        return self.returncode

    def finish(self) -> None:
        """End the case: SIGKILL the driver if it still runs, take its status, close its pid fd."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
            self.wait(LIMIT)
        os.close(self.pidfd)

    def close(self) -> None:
        assert self.zygote.stdin
        self.zygote.stdin.close()
        self.zygote.wait(timeout=LIMIT)


@pytest.fixture(scope="module")
def driver():
    started = Driver()
    yield started
    started.close()


def cancel_at(
    driver: Driver, tmp_path: Path, point: str, step: str, mode: str, sig: int = signal.SIGTERM
) -> tuple[int, str]:
    """Run the driver up to ``step``, stop it at ``point``, send ``sig``; its exit status and output."""
    fifo = tmp_path / "cancel.fifo"
    os.mkfifo(fifo)
    output = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), cancel.ENV_POINT: point, cancel.ENV_FIFO: str(fifo)}
    pidfd = driver.start([str(tmp_path / "runs"), step, mode], env, output)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        ready, _, _ = select.select([reader, pidfd], [], [], LIMIT)
        assert reader in ready, f"{point} not reached:\n{output.read_text()}"
        assert os.read(reader, 200).decode().strip() == point
        driver.send_signal(sig)
        code = driver.wait(timeout=LIMIT)
    finally:
        os.close(reader)
        driver.finish()
    return code, output.read_text()


def cleanup_command(tmp_path: Path, *extra: str) -> subprocess.CompletedProcess:
    """``multislice cleanup --run cancel --output-dir <tmp_path>/runs``, as a user would run it."""
    argv = [
        sys.executable,
        "-m",
        "multislice.cli",
        "cleanup",
        "--run",
        RUN_NAME,
        "--output-dir",
        str(tmp_path / "runs"),
    ]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([*argv, *extra], capture_output=True, text=True, cwd=ROOT, env=env, timeout=LIMIT)


def jobset_states(tmp_path: Path) -> list:
    return LocalJobSets(tmp_path / "runs" / RUN_NAME).list_jobsets()


@pytest.mark.parametrize(("point", "step", "mode", "exists"), POINTS, ids=[p[0] for p in POINTS])
def test_a_step_cancelled_at_any_point_leaves_nothing_running(driver, tmp_path, point, step, mode, exists):
    code, output = cancel_at(driver, tmp_path, point, step, mode)
    assert code != 0, output
    if point.endswith(":entry"):  # before the handler: SIGTERM's default action ends the step at once
        assert code == -signal.SIGTERM, output
        assert "cancelled (" not in output
    else:
        assert "cancelled (SIGTERM)" in output, output
    states = jobset_states(tmp_path)
    if exists == "none":
        assert states == [], output
    elif exists == "completed":
        assert [s.phase for s in states] == ["Completed"], output
    elif exists == "jobset":
        assert [(s.phase, s.reason) for s in states] == [("Deleted", "Deleted")], output
    if exists == "jobset-left":
        # Killed before its handler, a step that did not create the JobSet cannot remove it:
        # the run's leftovers are what `multislice cleanup --run` is for.
        assert [s.phase for s in states] == ["Running"], output
        done = cleanup_command(tmp_path)
        assert done.returncode == 0, done.stderr
        assert done.stdout.startswith(f"removed JobSet {states[0].name} (Running -> Deleted)"), done.stdout
    assert not any(not s.terminal for s in jobset_states(tmp_path))
    left = wait_gone(run_processes(tmp_path), timeout=60)
    assert not left, f"processes of the run still alive: {left}\n{output}"


def test_sigint_cancels_like_sigterm(driver, tmp_path):
    """Ctrl-C (SIGINT to the foreground process group) in the middle of training: the JobSet goes as well."""
    code, output = cancel_at(driver, tmp_path, "train:following", "train", "sleep", signal.SIGINT)
    assert code != 0 and "cancelled (SIGINT): deleting" in output, output
    assert "TrainingFailed: cancelled;" in output
    assert [s.phase for s in jobset_states(tmp_path)] == ["Deleted"]
    assert not wait_gone(run_processes(tmp_path), timeout=60)


@pytest.mark.parametrize("point", ["launch:entry", "train:entry"])
def test_a_step_killed_before_its_handler_leaves_the_jobset_to_cleanup(driver, tmp_path, point):
    """The one window no handler covers: a process signalled before its first statement ran."""
    code, output = cancel_at(driver, tmp_path, point, point.split(":")[0], "sleep")
    assert code == -signal.SIGTERM, output
    states = jobset_states(tmp_path)
    assert [s.phase for s in states] == ["Running"]
    done = cleanup_command(tmp_path)
    assert done.returncode == 0 and f"removed JobSet {states[0].name} (Running -> Deleted)" in done.stdout
    assert not wait_gone(run_processes(tmp_path), timeout=60)


def test_cleanup_command_names_bad_input_and_says_when_nothing_is_left(tmp_path, capsys):
    from multislice import cli

    assert cli.main(["cleanup", "--run", "Not_A_Run", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "error: --run 'Not_A_Run' is not a run name" in err and "fix: give the run_name" in err
    assert "Traceback" not in err
    assert cli.main(["cleanup", "--run", "nosuch", "--output-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert f"no run directory {tmp_path}/nosuch" in err and "fix: check --run and --output-dir" in err
    (tmp_path / "done").mkdir()
    assert cli.main(["cleanup", "--run", "done", "--output-dir", str(tmp_path)]) == 0
    assert capsys.readouterr().out == f"run done (local, {tmp_path}/done): nothing left\n"


def test_sigterm_to_multislice_run_is_passed_on_to_the_running_step(tmp_path):
    """``kill <multislice run>`` (a process manager, a CI timeout): the step it runs is cancelled too."""
    fifo = tmp_path / "cancel.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, cancel.ENV_POINT: "plan:report", cancel.ENV_FIFO: str(fifo)}
    run = subprocess.Popen(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", "local",
         "--set", "run_name=sigterm", "--set", f"output_dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
        preexec_fn=cancel.die_with_parent(),
    )  # fmt: skip
    with open(fifo, encoding="utf-8") as announced:  # the plan step (a child of the CLI) is at the point
        assert announced.read().strip() == "plan:report"
    steps = set(cancel.step_pids(run.pid))
    # kfp.local's `sh -c` wrapper and the step's own interpreter under it: the step must be among them
    assert any("kfp.dsl.executor_main" in Path(f"/proc/{pid}/cmdline").read_text() for pid in steps), steps
    run.send_signal(signal.SIGTERM)
    output, _ = run.communicate(timeout=LIMIT)
    assert run.returncode == 130, output
    assert "interrupted" in output and "Traceback" not in output.split("interrupted")[-1]
    assert not wait_gone(steps, timeout=60)  # the step got the signal and ended; it was not orphaned


@pytest.mark.parametrize(
    ("point", "step", "holder"),
    [("train:following", "train", "the train step"), ("launch:entry", "launch", "the JobSet's supervisor")],
)
def test_a_sigkilled_driver_ends_its_run_as_sigterm_would(driver, tmp_path, point, step, holder):
    """Issue 43: a SIGKILLed ``multislice run`` left its train step, supervisor and pods training headless. The steps
    and the supervisors watch the driver ``MULTISLICE_DRIVER`` names (here a stand-in process, SIGKILLed while the
    step waits at ``point``) and cancel as on SIGTERM: the step deletes its JobSet; where no step can (``:entry``,
    before its handler), the supervisor deletes it."""
    stand_in = subprocess.Popen(
        [sys.executable, "-c", "import signal; signal.pause()"], preexec_fn=cancel.die_with_parent()
    )
    fifo = tmp_path / "cancel.fifo"
    os.mkfifo(fifo)
    output = tmp_path / "out"
    env = {
        **os.environ, "PYTHONPATH": str(ROOT), cancel.ENV_POINT: point, cancel.ENV_FIFO: str(fifo),
        cancel.ENV_DRIVER: cancel.driver_value(stand_in.pid),
    }  # fmt: skip
    pidfd = driver.start([str(tmp_path / "runs"), step, "sleep"], env, output)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    try:
        ready, _, _ = select.select([reader, pidfd], [], [], LIMIT)
        assert reader in ready, f"{point} not reached:\n{output.read_text()}"
        assert os.read(reader, 200).decode().strip() == point
        assert [s.phase for s in jobset_states(tmp_path)] == ["Running"]
        stand_in.kill()  # the driver dies without a word: no handler runs, nothing is forwarded
        stand_in.wait(timeout=LIMIT)
        code = driver.wait(timeout=LIMIT)  # the step ended on its own
    finally:
        os.close(reader)
        driver.finish()
        stand_in.kill()
        stand_in.wait(timeout=LIMIT)
    text = output.read_text()
    assert code != 0, text
    assert f"the run's driver (multislice run, pid {stand_in.pid}) has ended: cancelling as on SIGTERM" in text
    if holder == "the train step":
        assert "cancelled (SIGTERM)" in text, text
    else:
        assert code == -signal.SIGTERM, text  # before its handler: the default action
    left = wait_gone(run_processes(tmp_path), timeout=60)  # the supervisor and the pods end too
    assert not left, f"processes of the run still alive: {left}\n{text}"
    assert [(s.phase, s.reason) for s in jobset_states(tmp_path)] == [("Deleted", "Deleted")], text


def test_a_step_of_a_sigkilled_multislice_run_ends_instead_of_running_on(tmp_path):
    """``kill -9 <multislice run>``: the step kfp.local was running notices its driver is gone and ends."""
    fifo = tmp_path / "cancel.fifo"
    os.mkfifo(fifo)
    env = {**os.environ, cancel.ENV_POINT: "plan:report", cancel.ENV_FIFO: str(fifo)}
    run = subprocess.Popen(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", "local",
         "--set", "run_name=sigkill", "--set", f"output_dir={tmp_path}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env,
        preexec_fn=cancel.die_with_parent(),
    )  # fmt: skip
    with open(fifo, encoding="utf-8") as announced:  # the plan step (a child of the CLI) is at the point
        assert announced.read().strip() == "plan:report"
    steps = set(cancel.step_pids(run.pid))
    assert any("kfp.dsl.executor_main" in Path(f"/proc/{pid}/cmdline").read_text() for pid in steps), steps
    run.kill()
    run.communicate(timeout=LIMIT)
    assert run.returncode == -signal.SIGKILL
    assert not wait_gone(steps, timeout=LIMIT), "the step runs on without its driver"
