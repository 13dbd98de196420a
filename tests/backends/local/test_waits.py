"""The local backend's waits are woken by events (multislice/backends/local/inotify.py), not by a poll interval.

Each wait here is given a fallback interval of an hour: it can only return in time when the change it waits for
wakes it (the state file replaced, the supervisor's end, the state directory renamed away). The change is made
after the wait has read the state once (its ``on_poll``), so it cannot have been seen by that first read.
"""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from multislice.backends.local import inotify
from multislice.backends.local.jobsets import LocalJobSets
from multislice.backends.local.state import JobSetState, write_state

HOUR = 3600.0
WAIT_SECONDS = 60.0  # far beyond what a loaded machine needs to deliver one event


@pytest.fixture
def supervisor():
    """A process standing in for a JobSet's supervisor: alive until killed (it blocks reading a pipe that nothing
    writes to; the fixture closes it and kills the process at the end)."""
    proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    yield proc
    proc.kill()
    proc.wait()
    assert proc.stdin is not None
    proc.stdin.close()


def pending(tmp_path, supervisor) -> tuple[LocalJobSets, JobSetState]:
    jobsets = LocalJobSets(tmp_path)
    state = JobSetState(name="js", phase="Pending", supervisor_pid=supervisor.pid)
    jobsets.state_dir("js").mkdir(parents=True)
    write_state(jobsets.state_dir("js"), state)
    return jobsets, state


def wait_in_thread(jobsets, predicate, poll=HOUR):
    """Start ``jobsets.wait`` in a thread; returns (first read done, result holder, thread)."""
    first_read, result, reads = threading.Event(), {}, []

    def on_poll(state):
        reads.append(state.phase)
        first_read.set()

    def run():
        try:
            result["state"] = jobsets.wait("js", predicate, timeout=WAIT_SECONDS, poll=poll, on_poll=on_poll)
        except BaseException as error:  # noqa: BLE001 - handed to the test
            result["error"] = error

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    assert first_read.wait(WAIT_SECONDS), "the wait never read the state"
    return result, reads, thread


def test_a_state_change_wakes_the_wait_at_once(tmp_path, supervisor):
    jobsets, state = pending(tmp_path, supervisor)
    result, reads, thread = wait_in_thread(jobsets, lambda s: s.phase == "Running")
    state.phase = "Running"
    write_state(jobsets.state_dir("js"), state)  # as the supervisor does: a new file renamed into place
    thread.join(WAIT_SECONDS)
    assert not thread.is_alive(), "the wait was not woken by the state change"
    assert result["state"].phase == "Running"
    assert reads[0] == "Pending" and len(reads) <= 3  # one read per event, not one per interval


def test_the_supervisors_end_wakes_the_wait_with_supervisor_lost(tmp_path, supervisor):
    jobsets, _ = pending(tmp_path, supervisor)
    result, _, thread = wait_in_thread(jobsets, lambda s: s.phase == "Running")
    supervisor.kill()  # SIGKILL: it writes nothing; only its pidfd tells
    thread.join(WAIT_SECONDS)
    assert not thread.is_alive(), "the wait was not woken by the supervisor's end"
    assert (result["state"].phase, result["state"].reason) == ("Failed", "SupervisorLost")


def test_a_jobset_deleted_meanwhile_wakes_the_wait_with_keyerror(tmp_path, supervisor):
    jobsets, _ = pending(tmp_path, supervisor)
    result, _, thread = wait_in_thread(jobsets, lambda s: s.phase == "Running")
    jobsets.state_dir("js").rename(jobsets.state_dir("js").with_name("js.replaced-1"))
    thread.join(WAIT_SECONDS)
    assert not thread.is_alive(), "the wait was not woken by the state directory's removal"
    assert isinstance(result["error"], KeyError)


def test_without_inotify_or_pidfds_the_wait_polls_at_its_fallback_interval(tmp_path, supervisor, monkeypatch):
    monkeypatch.setattr(inotify, "_LIBC", None)
    with inotify.Watch(fallback_seconds=0.01) as watch:
        assert watch.polling and watch.fd is None
        assert watch.wait(HOUR) is False  # returned after the fallback interval, not the hour
    jobsets, state = pending(tmp_path, supervisor)
    result, _, thread = wait_in_thread(jobsets, lambda s: s.phase == "Running", poll=0.05)
    state.phase = "Running"
    write_state(jobsets.state_dir("js"), state)
    thread.join(WAIT_SECONDS)
    assert result["state"].phase == "Running"


def test_a_process_already_gone_when_watched_wakes_the_next_wait(supervisor):
    supervisor.kill()
    supervisor.wait()  # reaped: its pid is no process now
    with inotify.Watch(fallback_seconds=HOUR) as watch:
        assert watch.add_process(supervisor.pid)
        assert watch.wait(HOUR) is True
