"""Checkpoint verifier: passes the pipeline's real checkpoints, and fails broken or mismatched ones."""

import json
import shutil
import subprocess
import sys

import pytest

from multislice.trainer.verify import choose_samples
from tests.conftest import ROOT, run_in_trainer

VERIFY = "import sys; from multislice.trainer.verify import main; sys.exit(main())"


def verify(trainer_python, checkpoint_dir, expected_step, args):
    done = run_in_trainer(
        trainer_python, VERIFY, "--checkpoint-dir", str(checkpoint_dir), "--expected-step", str(expected_step),
        "--", *args,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def stage_copy(local_run, tmp_path):
    """A copy of stage 1's checkpoints from the end-to-end run, safe to break."""
    stage = local_run.plan.stages[0]
    target = tmp_path / "checkpoints"
    shutil.copytree(stage.checkpoint_dir, target)
    return stage, target


def failed_checks(report):
    return {c["name"] for c in report["checks"] if not c["passed"]}


@pytest.mark.e2e
def test_real_checkpoint_passes_every_check(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    status, report = verify(trainer_python, checkpoints, stage.final_step, stage.maxtext_args)
    assert (status, report["verdict"]) == (0, "PASS")
    assert [c["name"] for c in report["checks"]] == [
        "latest_step",
        "commit_markers",
        "params_tree",
        "parameter_count",
        "finite_samples",
    ]
    assert report["parameter_count"] == 2_098_432
    assert report["state_step"] == stage.steps
    assert len(report["samples"]) == 12 and all(s["finite"] for s in report["samples"])


@pytest.mark.e2e
def test_wrong_final_step_fails(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    status, report = verify(trainer_python, checkpoints, stage.final_step + 10, stage.maxtext_args)
    assert (status, report["verdict"]) == (1, "FAIL") and failed_checks(report) == {"latest_step"}


@pytest.mark.e2e
def test_uncommitted_checkpoint_fails(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    (checkpoints / str(stage.final_step) / "items" / "commit_success.txt").unlink()
    (checkpoints / f"{stage.final_step}.orbax-checkpoint-tmp-1").mkdir()
    status, report = verify(trainer_python, checkpoints, stage.final_step, stage.maxtext_args)
    assert status == 1 and failed_checks(report) == {"commit_markers"}
    assert "items commit_success.txt" in report["checks"][1]["detail"]


@pytest.mark.e2e
def test_checkpoint_of_another_model_fails(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    args = [a if not a.startswith("base_mlp_dim=") else "base_mlp_dim=512" for a in stage.maxtext_args]
    status, report = verify(trainer_python, checkpoints, stage.final_step, args)
    assert status == 1 and failed_checks(report) == {"params_tree", "parameter_count"}
    assert "mlp/wi_0/kernel: expected (256, 2, 512)" in report["checks"][2]["detail"]


@pytest.mark.e2e
def test_cli_finds_the_plan_from_the_checkpoint_path(local_run):
    stage = local_run.plan.stages[1]
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "verify-checkpoint", stage.checkpoint_dir],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: PASS" in done.stdout and "PASS params_tree" in done.stdout


def test_sample_choice_takes_all_that_fit_or_spreads_over_the_tree():
    sizes = {f"p{i}": 10 for i in range(16)}
    assert choose_samples(sizes, 1000) == sorted(sizes)
    chosen = choose_samples(sizes | {"huge": 10_000}, 60)
    assert "huge" not in chosen and 0 < len(chosen) <= 6
    assert len({name[:2] for name in chosen}) > 1


def test_checkpoint_dir_keeps_a_cloud_storage_url(trainer_python):
    # pathlib would make gs://bucket/x into gs:/bucket/x; the verifier Job on GKE reads gs:// checkpoints.
    script = (
        "from multislice.trainer.verify import checkpoint_path as p; print(p('gs://b/runs/ckpt') / '19', p('/tmp'))"
    )
    done = run_in_trainer(trainer_python, script)
    assert done.stdout.split() == ["gs://b/runs/ckpt/19", "/tmp"], done.stderr
