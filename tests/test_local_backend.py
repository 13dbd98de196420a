"""Local backend: JobSets of short scripted pods, run as real processes under a real supervisor.

The pods here are small Python programs instead of MaxText, so each case
takes seconds; the manifests are the real CPU JobSets with only the
container command replaced, and pass CRD validation as created.
"""

import os
import signal
import subprocess
import sys
import time

import pytest

from multislice import cancel, config
from multislice.backends.base import TrainingFailed
from multislice.backends.local import AlreadyExists, LocalJobSets, pid_alive
from multislice.backends.local import jobsets as local_jobsets
from multislice.backends.local.supervisor import failure_policy_action, job_failure_reason
from multislice.plan import make_plan
from multislice.render import jobset
from multislice.steps import cleanup, train
from tests.test_cancel import wait_gone

POD = """
import os, signal, sys, time
attempt = int(os.environ["RESTART_ATTEMPT"])
who = (int(os.environ["JOB_INDEX"]), int(os.environ["JOB_COMPLETION_INDEX"]))
print("pod", who, "attempt", attempt, "coordinator", os.environ["JAX_COORDINATOR_ADDRESS"],
      "processes", os.environ["JAX_PROCESS_COUNT"], flush=True)
mode = sys.argv[1]
if mode == "step-then-sleep":
    print("completed step: 0, seconds: 0.100, loss: 5.000", flush=True)
if mode in ("sleep", "step-then-sleep"):
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


def scripted_jobset(tmp_path, mode, run_name="unit", run_id="run-a", max_restarts=2):
    spec = config.load_profile(
        "local", {"run_name": run_name, "output_dir": str(tmp_path), "max_restarts": max_restarts}
    )
    plan = make_plan(spec)
    obj = jobset.render_jobset(plan, plan.stages[0], hardware="cpu", pipeline_run_id=run_id)
    pod = obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    container["command"] = ["python", "-c", POD]
    container["args"] = [mode]
    container["env"].append(
        {
            "name": "RESTART_ATTEMPT",
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['jobset.sigs.k8s.io/restart-attempt']"}},
        }
    )
    pod["terminationGracePeriodSeconds"] = 5
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


def test_killed_pod_restarts_the_whole_jobset(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "kill-first-attempt")
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.restarts, state.restarts_count_towards_max) == ("Completed", 1, 1)
    reasons = [e.reason for e in state.events]
    assert reasons.index("JobFailed") < reasons.index("Restarting") < reasons.index("AllJobsCompleted")
    failed = next(e for e in state.events if e.reason == "JobFailed")
    assert "BackoffLimitExceeded" in failed.message and "exited with code 137" in failed.message
    for host in range(2):  # every pod of every slice ran again, in attempt 1
        assert "attempt 1" in backend.pod_log(state.name, 0, host, attempt=1).read_text()


def test_restarts_stop_at_max_restarts(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "always-kill", max_restarts=2)
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.reason, state.restarts) == ("Failed", "ReachedMaxRestarts", 2)
    assert "max number of restarts (2)" in state.message


def test_a_python_error_fails_the_jobset_without_restarting(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "python-error")
    backend = LocalJobSets(plan.run_dir)
    backend.create_jobset(obj)
    state = finish(backend, obj["metadata"]["name"])
    assert (state.phase, state.reason, state.restarts) == ("Failed", "FailJobSetAction", 0)
    assert "PodFailurePolicy" in state.message
    assert not any(pid_alive(p.pid) for p in state.pods)


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
    time.sleep(0.2)
    assert not any(pid_alive(pid) for pid in pids)
    backend.create_jobset(other)  # a deleted name can be created again; the old state is kept aside
    assert any(p.name.startswith(f"{name}.deleted-") for p in backend.jobsets_dir.iterdir())
    backend.delete_jobset(name)


def test_a_lost_supervisor_is_reported_and_its_pods_are_killed_on_delete(tmp_path):
    plan, obj = scripted_jobset(tmp_path, "sleep")
    backend = LocalJobSets(plan.run_dir)
    name = obj["metadata"]["name"]
    state = backend.create_jobset(obj)
    os.kill(backend.get_jobset(name).supervisor_pid, signal.SIGKILL)
    time.sleep(0.3)
    lost = backend.get_jobset(name)
    assert (lost.phase, lost.reason) == ("Failed", "SupervisorLost")
    backend.delete_jobset(name)
    time.sleep(0.2)
    assert not any(pid_alive(p.pid) for p in state.pods)


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


@pytest.fixture
def port_free(monkeypatch):
    """The scripted pods do not listen on MaxText's coordinator port: another run on this machine may hold it."""
    monkeypatch.setattr(local_jobsets, "port_in_use", lambda port, host="127.0.0.1": False)


def test_cancelled_train_step_deletes_its_jobset(tmp_path, port_free):
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
        "train.run(Plan.from_json(Path(sys.argv[1]).read_text()), sys.argv[2], {'jobset': sys.argv[3]})\n"
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


def test_a_sigkilled_supervisors_pods_die_with_it_and_the_step_sees_it_lost(tmp_path, port_free):
    """PR_SET_PDEATHSIG: SIGKILL the supervisor (a kill soak) and every pod goes; the train step fails with
    SupervisorLost, and cleanup marks the JobSet Deleted so its name can be used again."""
    plan, obj = scripted_jobset(tmp_path, "sleep")
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
    with pytest.raises(TrainingFailed, match="SupervisorLost"):
        train.run(plan, plan.stages[0].name, {"jobset": name})
    report = cleanup.run("local", str(tmp_path), "unit", "run-a", "FAILED")
    assert report.deleted == [f"JobSet {name} (Failed -> Deleted)"]
    assert backend.get_jobset(name).phase == "Deleted"
