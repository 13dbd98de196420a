"""End to end with ``launcher: ray``: the local pipeline trains both stages through Ray Train's JaxTrainer.

One run (session fixture, few steps): stage 1 loses a Ray worker, killed by the driver's test hook when
the leader reports step 6 (after the step-5 checkpoint), and Ray Train's ``FailureConfig`` retries it;
stage 2 keeps FSDP over DCN = 2 across the emulated slices; both checkpoints verify.

It runs the local-synthetic profile (the local profile's slices and recipes, MaxText's synthetic data, a
1024-token vocabulary): what differs between the launchers is how the stage's processes start, and the real-data
stages' one launcher-specific need (the tokenizer's ``maxtext:`` path, resolved in the worker) is shared with the
JobSet worker (:func:`multislice.trainer.worker.maxtext_argv`, tested in tests/steps/test_prepare_data.py); the
real-data stages' Llama 3 vocabulary would make this run several times longer.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multislice import config, reports
from multislice.backends.local import LocalJobSets, pid_alive
from multislice.plan import make_plan
from multislice.storage import committed_steps, latest_committed_step
from multislice.trainer import digests, ray_job
from multislice.trainer.ray_driver import KILL_HOOK_ENV
from tests.conftest import ROOT, LocalRun

pytestmark = pytest.mark.e2e

SETTINGS = {"run_name": "e2e-ray", "launcher": "ray", "stage1_steps": 8, "stage2_steps": 6, "skip_preflight": True}
KILL_AFTER_STEP = 6
PROFILE = "local-synthetic"


@pytest.fixture(scope="module")
def ray_run(tmp_path_factory: pytest.TempPathFactory) -> LocalRun:
    """``multislice run --profile local-synthetic --set launcher=ray`` with a worker of stage 1 killed once."""
    output = tmp_path_factory.mktemp("e2e-ray-output")
    spec = config.load_profile(PROFILE, {**SETTINGS, "output_dir": str(output)})
    plan = make_plan(spec)
    env = {**os.environ, KILL_HOOK_ENV: f"{plan.stages[0].jobset}:1:{KILL_AFTER_STEP}"}
    sets = [arg for key, value in {**SETTINGS, "output_dir": output}.items() for arg in ("--set", f"{key}={value}")]
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", PROFILE, *sets],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=2400,
    )  # fmt: skip
    seconds = time.monotonic() - started
    print(f"e2e-ray run: {seconds:.0f} s")
    return LocalRun(done.returncode, done.stdout, done.stderr, seconds, plan)


def test_both_stages_train_through_ray_and_verify(ray_run):
    assert ray_run.returncode == 0, ray_run.stdout[-4000:] + ray_run.stderr[-4000:]
    out = ray_run.stdout
    assert "run e2e-ray: SUCCEEDED" in out
    assert out.count("verification  PASS") == 2
    assert out.count("(launcher ray)") >= 2  # the summary says which launcher ran
    # each stage's verifier ran in the process its train step started while Ray trained (as for a JobSet)
    assert out.count("in the verifier's process started during training (its imports done)") == 2
    for stage in ray_run.plan.stages:
        assert latest_committed_step(stage.checkpoint_dir) == stage.final_step
        trained = reports.read(reports.TrainReport, ray_run.plan, stage)
        assert trained.launcher == "ray" and trained.last_step == stage.final_step
        assert reports.read(reports.VerificationReport, ray_run.plan, stage).verdict == "PASS"
        # each worker group's rank 0 started as a JobSet's worker does: no torch or transformers for the step loop
        log = LocalJobSets(ray_run.plan.run_dir).pod_log(stage.jobset, 0, 0).read_text()
        imported = log.split("multislice ray worker: MaxText imported; heavy packages imported: ")[1:]
        assert imported, log[-3000:]
        for line in imported:
            heavy = line.split(" (of ")[0].split(", ")
            assert not {"torch", "transformers", "ml_goodput_measurement"} & set(heavy), heavy
        # rank 0 recorded each committed step's digests, as a JobSet's leader does (the verifier checked them)
        for step in committed_steps(stage.checkpoint_dir):
            assert Path(stage.checkpoint_dir, str(step), digests.DIGEST_FILE).is_file(), step


def test_a_killed_ray_worker_is_retried_by_failure_config(ray_run):
    stage = ray_run.plan.stages[0]
    log = LocalJobSets(ray_run.plan.run_dir).pod_log(stage.jobset, 0, 0).read_text()
    assert "killing the worker of rank 1" in log
    assert log.count("multislice ray worker: rank 0 of 4") == 2  # a second worker group after the kill
    resumed = log.split("killing the worker of rank 1", 1)[1]
    step = int(resumed.split("restoring from this run's directory step ")[1].split()[0])
    assert step >= 5  # MaxText resumed from its checkpoint, not from step 0
    assert reports.read(reports.TrainReport, ray_run.plan, stage).restarts == 1


def test_stage_two_shards_fsdp_over_dcn_across_ray_workers(ray_run):
    stage = ray_run.plan.stages[1]
    log = LocalJobSets(ray_run.plan.run_dir).pod_log(stage.jobset, 0, 0).read_text()
    assert "2 slices as DCN granules (slice 0: processes [0, 1]; slice 1: processes [2, 3])" in log
    assert "mesh fsdp=8 (ici 4 x dcn 2), tensor=2" in log
    assert reports.read(reports.VerificationReport, ray_run.plan, stage).written_mesh == {"fsdp": 8, "tensor": 2}


def test_each_stage_ran_on_a_ray_head_through_the_jobs_api(ray_run):
    """The pod did what KubeRay does: a head that answered its probe, the driver submitted through the Jobs API,
    and the driver joined that head's cluster (multislice.trainer.ray_job)."""
    for stage in ray_run.plan.stages:
        log = LocalJobSets(ray_run.plan.run_dir).pod_log(stage.jobset, 0, 0).read_text()
        assert "--include-dashboard=true" in log and "/api/healthz -> 200" in log
        submitted = log.split(f"multislice ray job: submitted {stage.jobset}-", 1)[1].split()[0]
        job_id = f"{stage.jobset}-{submitted}"
        assert "through the Jobs API at http://127.0.0.1:" in log
        gcs_port = log.split("--port=", 1)[1].split()[0]
        assert "multislice ray driver: connected to the Ray cluster at " in log
        assert f":{gcs_port} (Jobs API submission {job_id})" in log
        assert f"multislice ray job: {job_id} SUCCEEDED (driver exit code 0)" in log


def test_the_ray_run_leaves_no_process_behind(ray_run):
    for state in LocalJobSets(ray_run.plan.run_dir).list_jobsets():
        assert state.phase == "Completed"
        assert not pid_alive(state.supervisor_pid)
        assert not any(pid_alive(p.pid) for p in state.pods)
        log = Path(state.pods[0].log).read_text()
        temp_dir = log.split("--temp-dir=", 1)[1].split()[0]
        assert ray_job.head_processes(temp_dir) == [] and not Path(temp_dir).exists()  # the head and its job
    assert Path(ray_run.plan.run_dir).is_dir()
