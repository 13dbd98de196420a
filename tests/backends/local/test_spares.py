"""Local backend: the pre-started interpreter (a fork server) that forks a JobSet's restarted pods.

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
from multislice.backends.local.spares import ENV_SPARES, Spares, identity_env, warmable, warmable_modules
from multislice.trainer.spare import READY
from tests.backends.local.test_backend import finish, scripted_jobset
from tests.inotify import wait_for_glob, wait_for_text
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


def ready_server(backend: LocalJobSets, name: str, attempt: int) -> int:
    """The pid of the JobSet's fork server started for ``attempt``, once it has said it is warmed up."""
    log = backend.state_dir(name) / "spares" / f"fork-server.attempt-{attempt}.log"
    # the supervisor makes spares/ once the first attempt's pods have started: its log's directory first
    assert wait_for_glob(backend.state_dir(name), f"spares/{log.name}", timeout=120), "no server log"
    assert wait_for_text(log, READY, timeout=120), log.read_text()
    return int(log.read_text().split(f"{READY}: pid ")[1].split(",")[0])


def backend_manifest(backend: LocalJobSets, name: str) -> dict:
    return yaml.safe_load((backend.state_dir(name) / "jobset.yaml").read_text())


def pod_line(backend: LocalJobSets, name: str, pod, attempt: int) -> str:
    return backend.pod_log(name, pod.job_index, pod.completion_index, attempt).read_text()


def wait_started(backend: LocalJobSets, name: str, attempt: int):
    """The JobSet's state once every pod of ``attempt`` runs and has written its line."""
    state = backend.wait(name, lambda s: s.restarts >= attempt and s.phase == "Running", timeout=120, poll=0.2)
    for pod in state.pods:
        assert wait_for_text(Path(pod.log), "spare pod: pid", timeout=120), pod.log
    return state


def test_restarted_attempts_are_forked_from_one_warmed_server_and_are_the_supervisors_pods(tmp_path, stand_in):
    plan, obj = stand_in_jobset(tmp_path, "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    first = backend.create_jobset(obj)
    assert not any(p.prestarted for p in first.pods)  # the first attempt's pods start cold
    server = ready_server(backend, name, attempt=1)  # started and warmed up while attempt 0 runs
    assert pid_alive(server) and server not in {p.pid for p in first.pods}
    assert [p.hostname for p in backend.get_jobset(name).pods] == [p.hostname for p in first.pods]  # not a pod

    os.kill(next(p for p in first.pods if (p.job_index, p.completion_index) == (1, 0)).pid, signal.SIGKILL)
    second = wait_started(backend, name, attempt=1)
    os.kill(next(p for p in second.pods if (p.job_index, p.completion_index) == (0, 1)).pid, signal.SIGKILL)
    third = wait_started(backend, name, attempt=2)
    stand_in.touch()  # every pod of attempt 2 ends
    done = finish(backend, name)

    assert (done.phase, done.restarts) == ("Completed", 2), done.events
    supervisor = done.supervisor_pid
    started = [e.message for e in done.events if e.reason == "Started"]
    assert started == [
        "attempt 0: started 4 pods",
        "attempt 1: started 4 pods (4 in pre-started interpreters)",
        "attempt 2: started 4 pods (4 in pre-started interpreters)",
    ]
    # the forked pod that was SIGKILLed is reaped by the supervisor with its real status, as a pod of its own
    failed = [e.message for e in done.events if e.reason == "JobFailed"]
    assert "exited with code 137" in failed[1], failed
    assert all(p.prestarted and p.attempt == 2 and p.exit_code == 0 for p in done.pods)
    ports = [e.message.rsplit(":", 1)[1] for e in done.events if e.reason == "CoordinatorPort"]
    for attempt, state in ((1, second), (2, third)):
        pids = {p.pid for p in state.pods}
        assert len(pids) == 4 and server not in pids
        for pod in state.pods:
            line = pod_line(backend, name, pod, attempt)
            # forked from the warmed server, then the pod's own: the attempt's port, stdin, priority and directory,
            # its own session, and the supervisor as its parent (the supervisor reaps it: its exit code above)
            assert (
                f"spare pod: pid {pod.pid} attempt {attempt} port {ports[attempt]} prestarted True warmed-first True "
                f"nice {NICE} stdin /dev/null cwd {backend.state_dir(name)} ppid {supervisor} pgid {pod.pid}"
            ) in line, line
    assert "prestarted False" in pod_line(backend, name, first.pods[0], attempt=0)
    spares_dir = backend.state_dir(name) / "spares"
    assert [p.name for p in spares_dir.iterdir()] == ["fork-server.attempt-1.log"]  # one server for both restarts
    server_log = (spares_dir / "fork-server.attempt-1.log").read_text()
    assert server_log.count(READY) == 1 and "spare pod:" not in server_log  # warmed once; the pods log their own
    assert not wait_gone({server}, timeout=60)  # no restart can follow the last one: stopped


def test_the_server_dies_with_its_jobset_on_delete_and_on_completion(tmp_path, stand_in):
    plan, obj = stand_in_jobset(tmp_path, "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    server = ready_server(backend, name, attempt=1)
    assert spare_pids(backend.state_dir(name)) == [server]
    assert backend.delete_jobset(name).phase == "Deleted"
    assert not wait_gone({server} | {p.pid for p in state.pods}, timeout=60)

    plan, obj = stand_in_jobset(tmp_path / "again", "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    server = ready_server(backend, name, attempt=1)
    stand_in.touch()  # the pods of attempt 0 end: the JobSet completes with its server unused
    done = finish(backend, name)
    assert (done.phase, done.restarts) == ("Completed", 0)
    assert not wait_gone({server}, timeout=60)


def test_a_sigkilled_supervisors_server_and_forked_pods_die_with_it(tmp_path, stand_in):
    plan, obj = stand_in_jobset(tmp_path, "wait-for-release", release=stand_in)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    first = backend.create_jobset(obj)
    server = ready_server(backend, name, attempt=1)
    os.kill(first.pods[0].pid, signal.SIGKILL)
    forked = wait_started(backend, name, attempt=1)
    assert all(p.prestarted for p in forked.pods)
    os.kill(forked.supervisor_pid, signal.SIGKILL)
    assert not wait_gone({server} | {p.pid for p in forked.pods}, timeout=60)  # PR_SET_PDEATHSIG
    backend.delete_jobset(name)


def test_no_server_where_no_restart_can_follow_or_for_other_commands(tmp_path, stand_in, monkeypatch):
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
    assert not (backend.state_dir(name) / "spares").exists()  # maxRestarts 0: no attempt could use it


def test_the_variables_that_identify_a_pod_are_its_downward_api_ones_never_an_import_time_one(tmp_path):
    _, obj = stand_in_jobset(tmp_path, "exit")
    container = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    field = {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/job-index']"}}
    container["env"].append({"name": "JAX_PROCESS_ID", "valueFrom": field})
    assert identity_env(obj) == {
        "HOSTNAME", "JOBSET_NAME", "REPLICATED_JOB_NAME", "JOB_INDEX", "JOB_COMPLETION_INDEX", "RESTART_ATTEMPT"
    }  # fmt: skip


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
def test_a_pod_is_forked_only_when_its_environment_differs_from_the_servers_in_identity_and_run_time_values(
    tmp_path, change
):
    """JAX reads some variables at import (``JAX_PLATFORMS``, its config flags): a pod whose value differs from the
    server's starts as a new process, as before, and the server stays for the next. Values that identify the pod
    (its hostname, job and completion index) or are only known at the start (the coordinator port) reach it when it
    is forked. (This test process becomes a child subreaper, as the supervisor does.)"""
    _, obj = stand_in_jobset(tmp_path, "exit")
    pods = expand_jobset(obj, restart_attempt=1)
    spares = Spares(tmp_path / "spares", frozenset({STAND_IN}))
    assert spares.start(pods, 1, pod_env, tmp_path, identity_env(obj)) == 1
    assert spares.start(pods, 1, pod_env, tmp_path, identity_env(obj)) == 0  # one runs: kept
    log = tmp_path / "spares" / "fork-server.attempt-1.log"
    assert wait_for_text(log, READY, timeout=120), log.read_text()
    server = spares.pids()
    pod = pods[3]  # not the one whose environment the server has: its identity differs too

    out = tmp_path / "pod.log"
    proc, forked = spares.launch(pod.argv, pod_env(pod, change), tmp_path, out)
    assert proc.wait(timeout=120) == 0
    matched = set(change) == {"JAX_COORDINATOR_PORT"}
    assert forked is matched
    assert f"port 40001 prestarted {matched} warmed-first {matched} nice {NICE}" in out.read_text()
    assert f"ppid {os.getpid()} pgid {proc.pid}" in out.read_text()
    assert spares.pids() == server  # kept either way
    spares.stop()
    assert not wait_gone(set(server), timeout=60) and not spares.pids()


def test_a_server_that_died_before_its_pods_started_leaves_them_to_start_cold(tmp_path):
    _, obj = stand_in_jobset(tmp_path, "fail-warm-up")
    pods = expand_jobset(obj, restart_attempt=1)
    spares = Spares(tmp_path / "spares", frozenset({STAND_IN}))
    spares.start(pods, 1, pod_env, tmp_path, identity_env(obj))
    assert spares.server is not None
    dead = spares.server.proc
    assert dead.wait(timeout=120) != 0  # its warm-up raised
    assert "the stand-in's warm-up fails" in (tmp_path / "spares" / "fork-server.attempt-1.log").read_text()
    pod = pods[0]
    proc, forked = spares.launch(pod.argv, pod_env(pod), tmp_path, tmp_path / "pod.log")
    assert proc.wait(timeout=120) == 0 and not forked and proc.pid != dead.pid
    assert "prestarted False" in (tmp_path / "pod.log").read_text()
