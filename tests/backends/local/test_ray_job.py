"""The local Ray driver pod's RayJob (multislice.trainer.ray_job), run for real in the trainer environment.

A real Ray head (``ray start --head --block``, full ``ray[default]``) answers KubeRay's probe (``/api/healthz`` on
the dashboard agent: 200), a job goes through the Jobs API (submit, logs, SUCCEEDED), and a SIGTERM to the pod's
process group (what the local supervisor sends on a delete or a cancel) stops the job and the head with no Ray
process left. A head took 60-90 s to answer its probe here under a load average of 10-13.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading

import pytest

from multislice.backends.local import trainer_process_env
from multislice.render import jobset
from multislice.trainer import ray_job
from tests.conftest import ROOT
from tests.processes import wait_gone

#: Bound on one test's trainer process, seconds (a head under a load average of 10 takes about 90 s).
LIMIT = 900

HEAD_AND_JOB = """
import io, json, os, shlex, sys, time, urllib.request
import ray._private.utils
from ray.job_submission import JobSubmissionClient
from multislice.trainer import ray_job

assert ray._private.utils.get_dashboard_dependency_error() is None  # ray[default]: no --minimal dashboard
head = ray_job.start_head(num_cpus=1)
try:
    with urllib.request.urlopen(head.health_url, timeout=10) as response:
        health = [response.status, response.read().decode()]
    client = JobSubmissionClient(head.dashboard_url)
    entrypoint = ["python", "-c", "import os, sys, ray; ray.init(); "
                  "print('tiny job:', sys.argv[1:], ray.cluster_resources()['CPU'], os.environ['RAY_ADDRESS'])",
                  "it's one; argument"]
    job_id = ray_job.submission_id("tiny")
    client.submit_job(entrypoint=shlex.join(entrypoint), submission_id=job_id)
    logs = io.StringIO()
    status = ray_job.follow(client, job_id, logs)
    result = {"health": health, "job_id": job_id, "status": status, "logs": logs.getvalue(),
              "listed": [j.submission_id for j in client.list_jobs()], "gcs_port": head.ports.gcs,
              "temp_dir": str(head.temp_dir)}
finally:
    head.stop()
from tests.processes import wait_gone
result["left"] = wait_gone(lambda: ray_job.head_processes(result["temp_dir"]), 60)
result["temp_dir_left"] = os.path.exists(result["temp_dir"])
print(json.dumps(result))
"""


def _env(trainer_python) -> dict[str, str]:
    # this checkout's code in the trainer environment (its editable install may point to another checkout)
    return {**trainer_process_env(trainer_python.parent.parent), "PYTHONPATH": str(ROOT)}


def _gone(temp_dir: str, timeout: float = 60) -> list[int]:
    """The head's processes still alive after up to ``timeout`` s (waited on their exit events)."""
    return wait_gone(lambda: ray_job.head_processes(temp_dir), timeout)


def test_a_real_head_answers_kuberays_probe_and_runs_a_job_through_the_jobs_api(trainer_python):
    done = subprocess.run([str(trainer_python), "-c", HEAD_AND_JOB], capture_output=True, text=True,
                          env=_env(trainer_python), timeout=LIMIT)  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    status, body = result["health"]
    assert status == 200 and "raylet: success" in body and "gcs: success" in body  # the unified health check
    assert result["status"] == "SUCCEEDED" and result["job_id"] in result["listed"]
    assert result["job_id"].startswith("tiny-") and len(result["job_id"]) == len("tiny-") + 5
    # the entrypoint went through the shell as one argument list; the job's driver joined this head's cluster
    (said,) = [line for line in result["logs"].splitlines() if line.startswith("tiny job:")]
    assert said.startswith('tiny job: ["it\'s one; argument"] 1.0 ') and said.endswith(f":{result['gcs_port']}")
    assert result["left"] == [] and not result["temp_dir_left"]  # nothing of the head is left


def test_the_driver_pod_stops_its_job_and_head_on_sigterm(trainer_python):
    """What a delete or a cancel does to the local Ray driver pod: SIGTERM to its process group
    (multislice/backends/local/supervisor.py, ``stop_all``), with the job running."""
    command = [str(trainer_python), "-m", jobset.LOCAL_RAYJOB_MODULE, "--name=cancelme", "--num-cpus=1", "--",
               "python", "-c", "import signal; print('the job runs', flush=True); signal.pause()"]  # fmt: skip
    pod = subprocess.Popen(command, env=_env(trainer_python), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                           text=True, start_new_session=True)  # fmt: skip
    watchdog = threading.Timer(LIMIT, os.killpg, (pod.pid, signal.SIGKILL))
    watchdog.start()
    try:
        assert pod.stdout is not None
        before = []
        for line in pod.stdout:  # until the job's own output comes through the Jobs API's log stream
            before.append(line)
            if "the job runs" in line:
                break
        out = "".join(before)
        assert "the job runs" in out, out[-5000:]
        os.killpg(pod.pid, signal.SIGTERM)
        after = pod.communicate(timeout=60)[0]
    finally:
        watchdog.cancel()
    assert pod.returncode == 128 + signal.SIGTERM, after[-3000:]
    assert "head healthy: GET http://127.0.0.1:" in out and "/api/healthz -> 200" in out
    assert "submitted cancelme-" in out and "through the Jobs API" in out
    assert "SIGTERM: stopping job cancelme-" in after
    temp_dir = out.split("--temp-dir=", 1)[1].split()[0]
    assert _gone(temp_dir) == [], "Ray processes left after the pod's SIGTERM:\n" + after[-3000:]
    assert not os.path.exists(temp_dir)


def test_the_pod_refuses_an_empty_entrypoint():
    with pytest.raises(SystemExit):
        ray_job.parse_args(["--name=n", "--num-cpus=1"])
    options, entrypoint = ray_job.parse_args(["--name=n", "--num-cpus=3", "--", "python", "-m", "x", "--y=1"])
    assert (options.name, options.num_cpus, entrypoint) == ("n", 3, ["python", "-m", "x", "--y=1"])
