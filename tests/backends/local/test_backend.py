"""Local backend: JobSets of short scripted pods, run as real processes under a real supervisor.

The pods here are small Python programs instead of MaxText, so each case
takes seconds; the manifests are the real CPU JobSets with only the
container command replaced, and pass CRD validation as created.
"""

import os
import signal
import subprocess
import sys

import pytest

from multislice import cancel, config
from multislice.backends.base import LaunchFailed
from multislice.backends.local import AlreadyExists, LocalJobSets, pid_alive
from multislice.backends.local.pods import UnsupportedManifest
from multislice.backends.local.supervisor import (
    RESTART_GRACE_SECONDS,
    failure_policy_action,
    job_failure_reason,
    restarts_in_place,
)
from multislice.plan import make_plan
from multislice.render import jobset
from multislice.steps import cleanup, train
from tests.inotify import wait_for_text
from tests.test_cancel import wait_gone

POD = """
import os, signal, sys, time
# the pod's attempt: JobSet restarts (recreated pods) plus in-place restarts (the same pod, a new process)
attempt = int(os.environ["RESTART_ATTEMPT"]) + int(os.environ["IN_PLACE_ATTEMPT"] or 0)
who = (int(os.environ["JOB_INDEX"]), int(os.environ["JOB_COMPLETION_INDEX"]))
print("pod", who, "attempt", attempt, "coordinator", os.environ["JAX_COORDINATOR_ADDRESS"],
      "processes", os.environ["JAX_PROCESS_COUNT"], flush=True)
mode = sys.argv[1]
if mode == "ignore-sigterm" or (mode == "ignore-sigterm-first-attempt" and attempt == 0):  # as JAX's preemption
    # handler: SIGTERM does not end the process
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    print("ignoring SIGTERM", flush=True)
    while True:  # until SIGKILL: no signal it heeds ends the wait
        signal.pause()
if mode == "step-then-sleep" or (mode == "sleep-first-attempt" and attempt > 0):
    print("completed step: 0, seconds: 0.100, loss: 5.000", flush=True)
if mode in ("sleep", "step-then-sleep") or (mode == "sleep-first-attempt" and attempt == 0):
    time.sleep(600)
if who == (1, 0):
    if mode == "kill-first-attempt" and attempt == 0:
        time.sleep(0.5); os.kill(os.getpid(), signal.SIGKILL)
    if mode == "always-kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "python-error":
        raise SystemExit(1)
time.sleep(1 if who != (1, 0) else 0.2)
"""


def scripted_jobset(tmp_path, mode, run_name="unit", run_id="run-a", max_restarts=2, strategy="Recreate"):
    spec = config.load_profile(
        "local", {"run_name": run_name, "output_dir": str(tmp_path), "max_restarts": max_restarts}
    )
    plan = make_plan(spec)
    obj = jobset.render_jobset(plan, plan.stages[0], hardware="cpu", pipeline_run_id=run_id)
    pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["command"] = ["python", "-c", POD]
    container["args"] = [mode]
    for name, key in (("RESTART_ATTEMPT", "restart-attempt"), ("IN_PLACE_ATTEMPT", "in-place-restart-attempt")):
        path = f"metadata.annotations['jobset.sigs.k8s.io/{key}']"
        container["env"].append({"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}})
    pod["terminationGracePeriodSeconds"] = 5
    if strategy == "InPlaceRestart":  # as JobSet v0.12.0's webhook requires (the local supervisor plays the agent)
        obj["spec"]["failurePolicy"]["restartStrategy"] = "InPlaceRestart"
        for rj in obj["spec"]["replicatedJobs"]:
            rj["template"]["spec"].update(backoffLimit=2147483647, podReplacementPolicy="Failed")
    return plan, obj


def finish(backend, name, timeout=60):
    return backend.wait(name, lambda s: s.terminal, timeout=timeout, poll=0.2)


def test_pods_run_with_their_environment_and_complete(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "ok")
    backend = LocalJobSets(plan.run_dir)
    created = backend.create_jobset(obj)
    assert created.phase == "Running" and len(created.pods) == 4
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.reason, state.restarts) == ("Completed", "AllJobsCompleted", 0)
    assert all(p.exit_code == 0 for p in state.pods)
    log = backend.pod_log(state.name, 1, 1).read_text()
    assert "pod (1, 1) attempt 0 coordinator 127.0.0.1 processes 4" in log


COORDINATED_POD = """
import os, socket, sys, time
from pathlib import Path
who = (int(os.environ["JOB_INDEX"]), int(os.environ["JOB_COMPLETION_INDEX"]))
address = (os.environ["JAX_COORDINATOR_ADDRESS"], int(os.environ["JAX_COORDINATOR_PORT"]))
release = Path(sys.argv[1])
if who == (0, 0):  # the coordinator: listen on the port, answer each host, leave once released
    server = socket.create_server(address)
    # one write: print's pieces are written one by one when stdout is unbuffered (PYTHONUNBUFFERED), and the test
    # reads the port as soon as the line's start is in the log
    sys.stdout.write(f"coordinator listening on {address[1]}\\n"); sys.stdout.flush()
    server.settimeout(0.2)
    answered = 0
    while answered < int(os.environ["JAX_PROCESS_COUNT"]) - 1 or not release.exists():
        try:
            conn, _ = server.accept()
        except TimeoutError:
            continue
        conn.sendall(b"ok"); conn.close(); answered += 1
else:  # a host: reach this JobSet's coordinator
    while True:
        try:
            with socket.create_connection(address, timeout=1) as conn:
                assert conn.recv(2) == b"ok"
            break
        except OSError:
            time.sleep(0.1)
    print("reached the coordinator at", address[1], flush=True)
"""


def test_jobsets_of_two_runs_run_at_once_each_with_its_own_coordinator_port(tmp_path):
    release = tmp_path / "release"
    started = []
    for run_name in ("run-one", "run-two"):
        plan, obj = scripted_jobset(tmp_path, "unused", run_name=run_name)
        container = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
        container["command"], container["args"] = ["python", "-c", COORDINATED_POD], [str(release)]
        backend = LocalJobSets(plan.run_dir)
        started.append((backend, backend.create_jobset(obj)))

    def leader_says_listening(backend, state):
        # a log line: LocalJobSets.wait wakes on state changes only, so the log itself is awaited (inotify)
        assert wait_for_text(backend.pod_log(state.name), "coordinator listening on", timeout=120)
        return backend.get_jobset(state.name)

    running = [leader_says_listening(backend, state) for backend, state in started]
    assert [s.phase for s in running] == ["Running", "Running"]  # both hold their coordinators now
    ports = []
    for (backend, _), state in zip(started, running, strict=True):
        port = backend.pod_log(state.name).read_text().split("listening on ")[1].split()[0]
        assert [e.message for e in state.events if e.reason == "CoordinatorPort"][-1].endswith(f":{port}")
        ports.append(port)
    assert ports[0] != ports[1]
    release.touch()
    for backend, state in started:
        done = finish(backend, state.name)
        assert (done.phase, done.restarts) == ("Completed", 0), done.events
        assert "reached the coordinator" in backend.pod_log(state.name, 1, 1).read_text()


def test_killed_pod_restarts_the_whole_jobset(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "kill-first-attempt")
    backend = LocalJobSets(plan.run_dir)
    first = backend.create_jobset(obj)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.restarts, state.restarts_count_towards_max, state.attempt) == ("Completed", 1, 1, 1)
    reasons = [e.reason for e in state.events]
    assert reasons.index("JobFailed") < reasons.index("Restarting") < reasons.index("AllJobsCompleted")
    failed = next(e for e in state.events if e.reason == "JobFailed")
    assert "BackoffLimitExceeded" in failed.message and "exited with code 137" in failed.message
    for host in range(2):  # every pod of every slice ran again, in attempt 1
        assert "attempt 1" in backend.pod_log(state.name, 0, host, attempt=1).read_text()
    assert all(p.restart_count == 0 and not p.annotations for p in state.pods)  # new pods, no in-place agent
    assert not {p.pid for p in first.pods} & {p.pid for p in state.pods}
    assert (state.previous_in_place_restart_attempt, state.current_in_place_restart_attempt) == (None, None)


def test_a_killed_pod_restarts_every_pod_in_place_under_in_place_restart(tmp_path):
    """restartStrategy InPlaceRestart (JobSet v0.12.0, KEP-467): the same pods, each a new process; their in-place
    restart attempt annotation and the JobSet's previous/current attempts move as the controller moves them, and
    status.restarts stays 0 (no pod was recreated)."""
    plan, obj = scripted_jobset(tmp_path, "kill-first-attempt", strategy="InPlaceRestart")
    backend = LocalJobSets(plan.run_dir)
    first = backend.create_jobset(obj)
    assert first.restart_strategy == "InPlaceRestart"
    assert [p.in_place_restart_attempt for p in first.pods] == [0] * 4  # each agent's first attempt: 0
    assert (first.previous_in_place_restart_attempt, first.current_in_place_restart_attempt) == (None, 0)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.restarts, state.restarts_count_towards_max, state.attempt) == ("Completed", 0, 0, 1)
    assert (state.previous_in_place_restart_attempt, state.current_in_place_restart_attempt) == (0, 1)
    assert [p.hostname for p in state.pods] == [p.hostname for p in first.pods]  # the same pods
    assert [p.in_place_restart_attempt for p in state.pods] == [1] * 4
    assert [p.restart_count for p in state.pods] == [1] * 4
    assert not {p.pid for p in first.pods} & {p.pid for p in state.pods}  # each a new process
    reasons = [e.reason for e in state.events]
    assert "JobFailed" not in reasons and "Restarting" not in reasons  # no Job failed, nothing was recreated
    assert reasons.index("PodFailed") < reasons.index("InPlaceRestart") < reasons.index("AllJobsCompleted")
    assert "exited with code 137" in next(e.message for e in state.events if e.reason == "PodFailed")
    for slice_, host in ((0, 0), (1, 1)):  # the same hostname, restart-attempt 0, in-place attempt 1 (the env)
        log = backend.pod_log(state.name, slice_, host, attempt=1).read_text()
        assert f"pod ({slice_}, {host}) attempt 1 coordinator 127.0.0.1" in log
    first_port, second_port = [e.message.rsplit(":", 1)[1] for e in state.events if e.reason == "CoordinatorPort"]
    assert first_port != second_port  # each start of the pods' processes gets its coordinator port


@pytest.mark.parametrize("strategy", ["Recreate", "InPlaceRestart"])
def test_restarts_stop_at_max_restarts(tmp_path, strategy):
    plan, obj = scripted_jobset(tmp_path, "always-kill", max_restarts=2, strategy=strategy)
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.reason, state.attempt) == ("Failed", "ReachedMaxRestarts", 2)
    assert "max number of restarts (2)" in state.message
    if strategy == "Recreate":
        assert state.restarts == 2
    else:  # the third failure restarted a container a third time, > maxRestarts: the controller's first check
        # (before exceededMaxRestarts); nothing was recreated
        assert (state.restarts, state.current_in_place_restart_attempt) == (0, 2)
        assert "a container restarted 3 times" in state.message
    assert not any(pid_alive(p.pid) for p in state.pods)


@pytest.mark.parametrize("strategy", ["Recreate", "InPlaceRestart"])
def test_a_python_error_fails_the_jobset_without_restarting(tmp_path, strategy):
    """Exit 1 matches the podFailurePolicy FailJob rule: the Job fails under either strategy (under InPlaceRestart
    the pod is not restarted in place), and the failure policy fails the JobSet."""
    plan, obj = scripted_jobset(tmp_path, "python-error", strategy=strategy)
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.reason, state.restarts, state.attempt) == ("Failed", "FailJobSetAction", 0, 0)
    assert "PodFailurePolicy" in state.message
    assert not any(pid_alive(p.pid) for p in state.pods)


def test_an_in_place_jobset_must_be_as_jobsets_webhook_requires(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "ok", strategy="InPlaceRestart")
    obj["spec"]["replicatedJobs"][0]["template"]["spec"]["backoffLimit"] = 0
    with pytest.raises(UnsupportedManifest, match=r"backoffLimit must be 2147483647 under restartStrategy InPlace"):
        LocalJobSets(plan.run_dir).create_jobset(obj)


def test_restarts_in_place_follows_the_containers_rules_then_the_pod_failure_policy():
    job = {
        "podFailurePolicy": {
            "rules": [{"action": "FailJob", "onExitCodes": {"operator": "NotIn", "values": [42, 137]}}]
        }
    }
    plain = {"name": "maxtext"}
    assert restarts_in_place(job, plain, 137) and not restarts_in_place(job, plain, 1)
    ruled = {"name": "maxtext", "restartPolicyRules": [
        {"action": "RestartAllContainers", "exitCodes": {"operator": "NotIn", "values": [0]}}]}  # fmt: skip
    assert restarts_in_place(job, ruled, 1)  # the container's rule restarts it before the pod can fail


def test_delete_stops_every_process_and_frees_the_name(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "sleep")
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    pids = [p.pid for p in state.pods] + [backend.get_jobset(name).supervisor_pid]
    assert all(pid_alive(pid) for pid in pids)
    assert backend.create_jobset(obj).pods == state.pods  # the same manifest again: adopted, not duplicated
    other = dict(obj, metadata={**obj["metadata"], "labels": {**obj["metadata"]["labels"], "pipeline/runid": "b"}})
    with pytest.raises(AlreadyExists, match="different spec"):
        backend.create_jobset(other)
    deleted = backend.delete_jobset(name)
    assert deleted.phase == "Deleted"
    assert not wait_gone(set(pids), timeout=60)
    backend.create_jobset(other)  # a deleted name can be created again; the old state is kept aside
    assert any(p.name.startswith(f"{name}.deleted-") for p in backend.jobsets_dir.iterdir())
    backend.delete_jobset(name)


def test_a_delete_with_its_own_grace_period_does_not_wait_out_the_pods(tmp_path):
    """Pods that ignore SIGTERM, with a grace period of an hour: a delete with ``grace_seconds=0`` (a hung remote
    call's) is carried out by the supervisor itself, SIGKILL at once, not by the delete's fallback after its
    timeout (which is what waiting out the pods' grace period would come to)."""
    plan, obj = scripted_jobset(tmp_path, "ignore-sigterm")
    obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 3600
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    for pod in state.pods:  # every pod has set its handler (a line in its log, awaited on inotify, not a delay)
        log = backend.pod_log(name, pod.job_index, pod.completion_index)
        assert wait_for_text(log, "ignoring SIGTERM", timeout=120), _log(backend, name, pod)
    deleted = backend.delete_jobset(name, timeout=120, grace_seconds=0)
    assert (deleted.phase, deleted.message) == ("Deleted", "the JobSet was deleted")  # the supervisor's, in time
    assert [p.exit_code for p in deleted.pods] == [137] * 4  # SIGKILL: SIGTERM was ignored
    assert not any(pid_alive(p.pid) for p in deleted.pods)


def test_a_restart_does_not_wait_out_the_survivors_grace_period(tmp_path):
    """The survivors of a failed attempt ignore SIGTERM (as JAX's preemption notifier holds a process until a sync
    point that the failed pod never reaches) and have an hour's grace period: the restart SIGKILLs them after
    ``RESTART_GRACE_SECONDS`` and the next attempt runs, long before a delete's fallback or the hour."""
    plan, obj = scripted_jobset(tmp_path, "ignore-sigterm-first-attempt")
    obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] = 3600
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    for pod in state.pods:  # every pod has set its handler (a line in its log, awaited on inotify)
        log = backend.pod_log(name, pod.job_index, pod.completion_index)
        assert wait_for_text(log, "ignoring SIGTERM", timeout=120), _log(backend, name, pod)
    os.kill(state.pods[-1].pid, signal.SIGKILL)
    done = finish(backend, name, timeout=300)
    assert (done.phase, done.restarts) == ("Completed", 1), done.events
    stopped = next(e for e in done.events if e.reason == "Stopped")
    restarted = next(e for e in done.events if e.reason == "Restarting")
    failed = next(e for e in done.events if e.reason == "JobFailed")
    assert stopped.message.startswith("stopped 3 running pods: restarting")
    assert restarted.time - failed.time < RESTART_GRACE_SECONDS + 60  # not the hour: SIGKILL after the restart grace
    assert not any(pid_alive(p.pid) for p in state.pods)


def _log(backend, name, pod):
    path = backend.pod_log(name, pod.job_index, pod.completion_index)
    return path.read_text() if path.exists() else ""


def test_a_finished_jobset_of_an_earlier_pipeline_run_is_replaced(tmp_path):
    """A run continuing an earlier one (same run_name, another pipeline run) replaces its finished JobSet."""
    from multislice.backends.local.backend import LocalBackend

    plan, obj = scripted_jobset(tmp_path, "ok")
    local = LocalBackend(plan.run_dir)
    backend, name = local.jobsets, obj["metadata"]["name"]
    backend.create_jobset(obj)
    assert finish(backend, name).phase == "Completed"
    other = dict(obj, metadata={**obj["metadata"], "labels": {**obj["metadata"]["labels"], "pipeline/runid": "b"}})
    result = local.submit(other)
    assert result.replaced == "run-a" and result.adopted is False
    assert any(p.name.startswith(f"{name}.replaced-") for p in backend.jobsets_dir.iterdir())
    assert finish(backend, name).labels["pipeline/runid"] == "b"


def test_a_ray_stage_is_the_ray_launchers_and_its_errors_name_the_ray_driver(tmp_path):
    """The local backend looks a stage's launcher up: a Ray stage's driver JobSet is the Ray launcher's, by name too
    (a failure report, a delete), and what it says names the Ray driver, not a JobSet."""
    from multislice.backends.local import launchers
    from multislice.backends.local.backend import LocalBackend
    from multislice.render.jobset import LOCAL_RAYJOB_MODULE
    from multislice.render.ray import DRIVER_MODULE

    spec = config.load_profile("local", {"run_name": "r", "output_dir": str(tmp_path), "launcher": "ray"})
    plan = make_plan(spec)
    stage = plan.stages[0]
    local = LocalBackend(plan.run_dir)
    assert isinstance(local.launcher_for(stage), launchers.RayLauncher)
    obj = local.workload_manifest(plan, stage, "run-a")
    container = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["python", "-m", LOCAL_RAYJOB_MODULE] and DRIVER_MODULE in container["args"]
    container["command"], container["args"] = ["python", "-c", "import sys; sys.exit(3)"], [DRIVER_MODULE]
    assert local.submit(obj).adopted is False
    assert finish(local.jobsets, stage.workload).phase == "Failed"  # its one pod exited 3: no pod will run
    with pytest.raises(LaunchFailed) as failed:
        local.wait_running(plan, stage, print)
    assert str(failed.value).startswith(f"Ray driver {stage.workload} is Failed") and "JobSet" not in str(failed.value)
    assert isinstance(local.launcher_of(stage.workload), launchers.RayLauncher)
    report = local.failure_report(stage.workload)
    assert report.startswith(f"Ray driver {stage.workload} Failed") and "exit code 3" in report
    assert "JobSet" not in report.splitlines()[0]
    assert local.workload_phase(stage.workload) == "Failed"
    plain, other = scripted_jobset(tmp_path / "plain", "ok")  # a JobSet stage's is the JobSet launcher's
    LocalBackend(plain.run_dir).submit(other)
    assert isinstance(LocalBackend(plain.run_dir).launcher_of(other["metadata"]["name"]), launchers.JobSetLauncher)


def test_a_lost_supervisor_is_reported_and_its_pods_are_killed_on_delete(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "sleep")
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    os.kill(backend.get_jobset(name).supervisor_pid, signal.SIGKILL)
    lost = backend.wait(name, lambda s: s.reason == "SupervisorLost", timeout=60, poll=0.1)
    assert (lost.phase, lost.reason) == ("Failed", "SupervisorLost")
    backend.delete_jobset(name)
    assert not wait_gone({p.pid for p in state.pods}, timeout=60)


def test_a_new_supervisor_takes_over_a_lost_one_and_starts_the_next_attempt(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "sleep", max_restarts=0)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    first = backend.create_jobset(obj)
    os.kill(first.supervisor_pid, signal.SIGKILL)
    lost = backend.wait(name, lambda s: s.reason == "SupervisorLost", timeout=60, poll=0.1)
    assert lost.phase == "Failed"

    taken = backend.take_over(name)

    assert taken.phase == "Running" and taken.supervisor_pid != first.supervisor_pid
    assert (taken.restarts, taken.restarts_count_towards_max) == (1, 0)  # not counted against maxRestarts: 0
    assert not any(pid_alive(p.pid) for p in first.pods)  # the old attempt's pods were stopped
    assert all(pid_alive(p.pid) and p.attempt == 1 for p in taken.pods)
    assert "SupervisorRestarted" in [e.reason for e in taken.events]
    assert backend.delete_jobset(name).phase == "Deleted"
    assert not any(pid_alive(p.pid) for p in taken.pods)


def test_cleanup_deletes_only_this_runs_unfinished_jobsets(tmp_path):
    plan_a, mine = scripted_jobset(tmp_path, "sleep", run_name="mine", run_id="run-a")
    plan_b, theirs = scripted_jobset(tmp_path, "sleep", run_name="theirs", run_id="run-b")
    a, b = LocalJobSets(plan_a.run_dir), LocalJobSets(plan_b.run_dir)
    a.create_jobset(mine)
    b.create_jobset(theirs)
    report = cleanup.run("local", str(tmp_path), "mine", "run-a", "CANCELLED")
    assert report.deleted == [f"JobSet {mine['metadata']['name']} (Running -> Deleted)"]
    assert a.get_jobset(mine["metadata"]["name"]).phase == "Deleted"
    assert b.get_jobset(theirs["metadata"]["name"]).phase == "Running"
    assert cleanup.run("local", str(tmp_path), "theirs", "run-a", "FAILED").deleted == []  # other run id
    b.delete_jobset(theirs["metadata"]["name"])


def test_job_failure_reason_follows_pod_failure_policy():
    job = {
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": "maxtext",
                        "operator": "NotIn",
                        "values": list(jobset.RESTARTABLE_EXIT_CODES),
                    },
                }
            ]
        }
    }
    assert job_failure_reason(job, "maxtext", 1)[0] == "PodFailurePolicy"
    assert job_failure_reason(job, "maxtext", 137)[0] == "BackoffLimitExceeded"
    assert job_failure_reason(job, "maxtext", 42)[0] == "BackoffLimitExceeded"
    assert job_failure_reason(job, "other", 1)[0] == "BackoffLimitExceeded"


def test_failure_policy_rules_match_in_order():
    policy = {
        "rules": [
            {"name": "a", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"]},
            {"name": "b", "action": "RestartJobSetAndIgnoreMaxRestarts", "onJobFailureMessagePatterns": ["preempt"]},
        ]
    }
    assert failure_policy_action(policy, "PodFailurePolicy", "x", "slice") == ("FailJobSet", "a")
    assert failure_policy_action(policy, "BackoffLimitExceeded", "node preempted", "slice")[0] == (
        "RestartJobSetAndIgnoreMaxRestarts"
    )
    assert failure_policy_action(policy, "BackoffLimitExceeded", "oom", "slice") == ("RestartJobSet", "(default)")


def test_cancelled_train_step_deletes_its_jobset(tmp_path):
    """SIGTERM to the train step (a cancelled pipeline run) while it follows the leader's log deletes the JobSet.

    Event-driven: the step stops at its ``train:following`` cancel point (the first step line it read) and
    announces it on a FIFO; only then does the test signal it.
    """
    plan, obj = scripted_jobset(tmp_path, "sleep")
    pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    pod["args"] = ["step-then-sleep"]
    backend = LocalJobSets(plan.run_dir)
    state = backend.create_jobset(obj)
    (tmp_path / "plan.json").write_text(plan.to_json())
    fifo = tmp_path / "cancel.fifo"
    os.mkfifo(fifo)
    script = (
        "import sys; from pathlib import Path; from multislice.plan import Plan; from multislice.steps import train\n"
        "plan = Plan.from_json(Path(sys.argv[1]).read_text())\n"
        "train.run(plan, plan.stage(sys.argv[2]), {'jobset': sys.argv[3]})\n"
    )
    env = {**os.environ, cancel.ENV_POINT: "train:following", cancel.ENV_FIFO: str(fifo)}
    step = subprocess.Popen(
        [sys.executable, "-c", script, str(tmp_path / "plan.json"), plan.stages[0].name, plan.stages[0].jobset],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    with open(fifo, encoding="utf-8") as announced:  # returns once the step is at the point
        assert announced.read().strip() == "train:following"
    step.send_signal(signal.SIGTERM)
    output, _ = step.communicate(timeout=120)
    assert step.returncode != 0
    assert f"cancelled (SIGTERM): deleting {plan.stages[0].jobset}" in output and "TrainingFailed" in output
    assert backend.get_jobset(obj["metadata"]["name"]).phase == "Deleted"
    assert not wait_gone({p.pid for p in state.pods} | {state.supervisor_pid}, timeout=60)


def test_a_sigkilled_supervisors_pods_die_with_it_and_the_train_step_starts_a_new_one(tmp_path):
    """PR_SET_PDEATHSIG: SIGKILL the supervisor (a kill soak) and every pod goes with it; the train step
    sees it lost, starts a new supervisor (as a cluster restarts its JobSet controller) and follows the
    next attempt to the end."""
    plan, obj = scripted_jobset(tmp_path, "sleep-first-attempt", max_restarts=0)
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    pods = {p.pid for p in state.pods}
    assert pods and all(pid_alive(pid) for pid in pods)
    supervisor = backend.get_jobset(name).supervisor_pid
    os.kill(supervisor, signal.SIGKILL)
    assert not wait_gone(pods | {supervisor}, timeout=60)  # the kernel killed the pods: nobody else did
    lost = backend.get_jobset(name)
    assert (lost.phase, lost.reason) == ("Failed", "SupervisorLost")

    report = train.run(plan, plan.stages[0], {"jobset": name})

    assert report.restarts == 1
    done = backend.get_jobset(name)
    assert (done.phase, done.restarts, done.restarts_count_towards_max) == ("Completed", 1, 0)
    assert "SupervisorRestarted" in [e.reason for e in done.events]


def test_cleanup_marks_a_jobset_with_a_lost_supervisor_deleted(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "sleep")
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    os.kill(state.supervisor_pid, signal.SIGKILL)
    assert not wait_gone({p.pid for p in state.pods} | {state.supervisor_pid}, timeout=60)
    report = cleanup.run("local", str(tmp_path), "unit", "run-a", "FAILED")
    assert report.deleted == [f"JobSet {name} (Failed -> Deleted)"]
    assert backend.get_jobset(name).phase == "Deleted"
