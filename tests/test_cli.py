"""The CLI's run command reports a failed pipeline with the failing step's own error."""

import subprocess
import sys


def test_failed_run_names_the_step_and_its_cause(tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", "local", "--set", "backend=gke",
         "--set", "output_dir=gs://bucket/runs", "--set", "run_name=fails", "--set", "cluster.project=my-project",
         "--set", "cluster.location=us-east5-b", "--set", "cluster.name=tpu-cluster", "--set", "skip_preflight=true"],
        capture_output=True, text=True, cwd=tmp_path, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Inner task failed: 'provision'" in done.stderr
    assert "cause: multislice.backends.BackendUnavailable: backend=gke" in done.stderr
    assert "run fails: FAILED" in done.stdout and "[cleanup]" in done.stdout
    local = tmp_path / "build" / "runs" / "fails"
    assert (local / "pipeline.yaml").is_file() and (local / "pipeline.log").is_file()
    assert not (tmp_path / "gs:").exists()
