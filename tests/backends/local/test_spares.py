"""Local backend: pre-started pod interpreters (spares) for a JobSet's next restart attempt.

The pods are a scripted stand-in of the trainer worker (:mod:`tests.spare_pod`: a ``warm_up`` the spare calls, one
line saying how the pod started), named as the warmable module through the supervisor's
``MULTISLICE_LOCAL_SPARES``; the manifests are the real CPU JobSets with only the container command replaced.
Every wait is on an event: a log line (inotify) or a process's end (pidfd), never a delay.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import yaml

from multislice.backends.local import LocalJobSets, pid_alive
from multislice.backends.local.environment import trainer_env
from multislice.backends.local.pods import expand_jobset
from multislice.backends.local.spares import ENV_SPARES, Spares, warmable, warmable_modules
from multislice.trainer.spare import READY
from tests.backends.local.test_backend import finish, scripted_jobset
from tests.inotify import wait_for_text
from tests.processes import spare_pids
from tests.test_cancel import wait_gone

ROOT = Path(__file__).resolve().parents[3]
STAND_IN = "tests.spare_pod"
#: This process's scheduling priority: a pod's, whether it started cold or in a spare (which waited at a lower one).
NICE = os.getpriority(os.PRIO_PROCESS, 0)


@pytest.fixture
def stand_in(monkeypatch, tmp_path):
    """The supervisor gives the stand-in pod spares, and its pods (and spares) import it from the checkout."""
    monkeypatch.setenv(ENV_SPARES, STAND_IN)
    monkeypatch.setenv("PYTHONPATH", str(ROOT))
    return tmp_path / "release"


def stand_in_jobset(tmp_path, mode, max_restarts=2, release=None):
    plan, obj = scripted_jobset(tmp_path, mode, max_restarts=max_restarts)
    container = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    container["command"], container["args"] = ["python", "-m", STAND_IN], [mode, *([str(release)] if release else [])]
    return plan, obj


def ready_spares(backend: LocalJobSets, name: str, attempt: int) -> dict[str, int]:
    """Each pod's spare for ``attempt``, once it has said it is ready (its warm-up done): ``{hostname: pid}``."""
    found = {}
    for pod in expand_jobset(backend_manifest(backend, name), restart_attempt=attempt):
        log = backend.state_dir(name) / "spares" / f"{pod.hostname}.attempt-{attempt}.log"
        assert wait_for_text(log, READY, timeout=120), log.read_text() if log.exists() else "no spare log"
        found[pod.hostname] = int(log.read_text().split(f"{READY}: pid ")[1].split(",")[0])
    return found


def backend_manifest(backend: LocalJobSets, name: str) -> dict:
    return yaml.safe_load((backend.state_dir(name) / "jobset.yaml").read_text())


def pod_line(backend: LocalJobSets, name: str, pod, attempt: int) -> str:
    return backend.pod_log(name, pod.job_index, pod.completion_index, attempt).read_text()


def test_a_restarted_attempt_runs_in_interpreters_started_and_warmed_before_the_kill(tmp_path, stand_in):
    plan, obj = stand_in_jobset(tmp_path, "wait-first-attempt")
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    first = backend.create_jobset(obj)
    assert not any(p.prestarted for p in first.pods)  # the first attempt has no spares: its pods start cold
    spares = ready_spares(backend, name, attempt=1)  # pre-started and warmed while attempt 0 runs
    assert len(spares) == 4 and not set(spares.values()) & {p.pid for p in first.pods}
    assert all(pid_alive(pid) for pid in spares.values())
    assert [p.hostname for p in backend.get_jobset(name).pods] == [p.hostname for p in first.pods]  # not pods

    killed = next(p for p in first.pods if (p.job_index, p.completion_index) == (1, 0))
    os.kill(killed.pid, signal.SIGKILL)
    done = finish(backend, name)

    assert (done.phase, done.restarts) == ("Completed", 1), done.events
    assert {p.hostname: p.pid for p in done.pods} == spares  # each pod of attempt 1 is the spare started before
    assert all(p.prestarted and p.attempt == 1 and p.exit_code == 0 for p in done.pods)
    started = [e.message for e in done.events if e.reason == "Started"]
    assert started == ["attempt 0: started 4 pods", "attempt 1: started 4 pods (4 in pre-started interpreters)"]
    port = [e.message for e in done.events if e.reason == "CoordinatorPort"][-1].rsplit(":", 1)[1]
    for pod in done.pods:
        line = pod_line(backend, name, pod, attempt=1)
        # imports done before the pod started; run-time values (the attempt's port) and the pod's own stdin,
        # priority and directory, as a pod started cold has them
        assert (
            f"spare pod: pid {pod.pid} attempt 1 port {port} prestarted True warmed-first True nice {NICE} "
            f"stdin /dev/null cwd {backend.state_dir(name)}"
        ) in line, line
    assert "prestarted False" in pod_line(backend, name, first.pods[0], attempt=0)
    spares_dir = backend.state_dir(name) / "spares"
    assert READY not in "".join(pod_line(backend, name, p, 1) for p in done.pods)  # its own log stays its own
    assert sorted(p.name for p in spares_dir.iterdir()) == sorted(
        [f"{p.hostname}.attempt-{a}.log" for p in done.pods for a in (1, 2)]
    )  # attempt 2's spares were started too (max_restarts 2): the completed JobSet stopped them
    assert not wait_gone(set(spares_of(backend, name)), timeout=60)


def spares_of(backend: LocalJobSets, name: str) -> list[int]:
    """Pids of live spares in this JobSet's state directory."""
    return spare_pids(backend.state_dir(name))


def test_spares_die_with_their_jobset_on_delete_and_on_completion(tmp_path, stand_in):
    plan, obj = stand_in_jobset(tmp_path, "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    spares = ready_spares(backend, name, attempt=1)
    assert sorted(spares_of(backend, name)) == sorted(spares.values())
    assert backend.delete_jobset(name).phase == "Deleted"
    assert not wait_gone(set(spares.values()) | {p.pid for p in state.pods}, timeout=60)

    plan, obj = stand_in_jobset(tmp_path / "again", "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    spares = ready_spares(backend, name, attempt=1)
    stand_in.touch()  # the pods of attempt 0 end: the JobSet completes with its spares unused
    done = finish(backend, name)
    assert (done.phase, done.restarts) == ("Completed", 0)
    assert not wait_gone(set(spares.values()), timeout=60)


def test_a_sigkilled_supervisors_spares_die_with_it(tmp_path, stand_in):
    plan, obj = stand_in_jobset(tmp_path, "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    spares = ready_spares(backend, name, attempt=1)
    os.kill(state.supervisor_pid, signal.SIGKILL)
    assert not wait_gone(set(spares.values()) | {p.pid for p in state.pods}, timeout=60)  # PR_SET_PDEATHSIG
    backend.delete_jobset(name)


def test_no_spares_where_no_restart_can_follow_or_for_other_commands(tmp_path, stand_in, monkeypatch):
    assert warmable(["python", "-m", STAND_IN, "x"], warmable_modules())
    assert not warmable(["python", "-c", "print()"], warmable_modules())
    assert warmable_modules({}) == {"multislice.trainer.worker"}  # by default: the trainer worker's pods
    assert warmable_modules({ENV_SPARES: "off"}) == frozenset()
    plan, obj = stand_in_jobset(tmp_path, "wait-for-release", max_restarts=0, release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    backend.create_jobset(obj)
    stand_in.touch()
    assert finish(backend, name).phase == "Completed"
    assert not (backend.state_dir(name) / "spares").exists()  # maxRestarts 0: no attempt could use them


def pod_env(pod, extra=None) -> dict[str, str]:
    """A pod's environment as the supervisor gives it (:meth:`Supervisor._pod_env`), for the unit cases below."""
    env = {
        "PATH": f"{trainer_env() / 'bin'}:/usr/bin:/bin",
        "HOME": os.environ.get("HOME", "/root"),
        "PYTHONPATH": str(ROOT),
        "PYTHONUNBUFFERED": "1",
        "HOSTNAME": pod.hostname,
        **pod.env,
    }
    return {**env, **(extra or {})}


@pytest.mark.parametrize(
    "change",
    [{"JAX_COORDINATOR_PORT": "40001"}, {"JAX_COORDINATOR_PORT": "40001", "XLA_FLAGS": "--other"}],
    ids=["only-a-run-time-value-differs", "an-import-time-value-differs"],
)
def test_a_pod_starts_in_its_spare_only_when_their_environments_match(tmp_path, change):
    """JAX reads some variables at import (``JAX_PLATFORMS``, its config flags): a spare started with another value
    than its pod's cannot become it, and the pod starts as a new process, as before; the unused spare is stopped.
    Values only known at the start (the coordinator port) reach the spare when it becomes the pod."""
    _, obj = stand_in_jobset(tmp_path, "exit")
    pods = expand_jobset(obj, restart_attempt=1)
    spares = Spares(tmp_path / "spares", frozenset({STAND_IN}))
    assert spares.start(pods, 1, pod_env, tmp_path) == 4
    pod = pods[0]
    log = tmp_path / "spares" / f"{pod.hostname}.attempt-1.log"
    assert wait_for_text(log, READY, timeout=120), log.read_text()
    spare_pid = spares.waiting[pod.hostname].proc.pid

    out = tmp_path / "pod.log"
    proc, from_spare = spares.launch(pod.hostname, 1, pod.argv, pod_env(pod, change), tmp_path, out)
    assert proc.wait(timeout=120) == 0
    matched = set(change) == {"JAX_COORDINATOR_PORT"}
    assert from_spare is matched and (proc.pid == spare_pid) is matched
    assert f"port 40001 prestarted {matched} warmed-first {matched} nice {NICE}" in out.read_text()
    if not matched:
        assert not wait_gone({spare_pid}, timeout=60)  # the mismatched spare was stopped
    others = set(spares.pids())
    assert len(others) == 3
    spares.stop()
    assert not wait_gone(others, timeout=60) and not spares.waiting


def test_a_spare_that_died_before_its_pod_started_leaves_the_pod_to_start_cold(tmp_path):
    _, obj = stand_in_jobset(tmp_path, "fail-warm-up")
    pods = expand_jobset(obj, restart_attempt=1)
    spares = Spares(tmp_path / "spares", frozenset({STAND_IN}))
    spares.start(pods[:1], 1, pod_env, tmp_path)
    pod = pods[0]
    dead = spares.waiting[pod.hostname].proc
    assert dead.wait(timeout=120) != 0  # its warm-up raised
    assert "the stand-in's warm-up fails" in (tmp_path / "spares" / f"{pod.hostname}.attempt-1.log").read_text()
    proc, from_spare = spares.launch(pod.hostname, 1, pod.argv, pod_env(pod), tmp_path, tmp_path / "pod.log")
    assert proc.wait(timeout=120) == 0 and not from_spare and proc.pid != dead.pid
    assert "prestarted False" in (tmp_path / "pod.log").read_text()
