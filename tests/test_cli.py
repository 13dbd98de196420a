"""The CLI's run command reports a failed pipeline with the failing step's own error."""

import os
import subprocess
import sys

from tests.gcs import FakeGcs


def test_failed_run_names_the_step_and_its_cause(tmp_path):
    # backend gke through a kubeconfig that does not exist: provision cannot reach the cluster. (local-synthetic:
    # no corpus to prepare into the fake gs:// bucket first.)
    with FakeGcs() as gcs:
        env = {**os.environ, **gcs.env, "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")}
        done = subprocess.run(
            [sys.executable, "-m", "multislice.cli", "run", "--profile", "local-synthetic", "--set", "backend=gke",
             "--set", "output_dir=gs://bucket/runs", "--set", "run_name=fails", "--set", "cluster.project=my-project",
             "--set", "cluster.location=us-east5-b", "--set", "cluster.name=tpu-cluster",
             "--set", "skip_preflight=true", "--set", "cluster.access=kubeconfig"],
            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env,
        )  # fmt: skip
        written = gcs.names(prefix="runs/fails/")
    assert done.returncode == 1
    assert "Inner task failed: 'provision'" in done.stderr
    assert (
        "cause: multislice.backends.gke.access.ClusterAccessError: access kubeconfig: cannot load context"
        in done.stderr
    )
    assert "[cleanup] cannot reach the gke backend, so nothing was deleted" in done.stdout
    assert "run fails: FAILED" in done.stdout and "[cleanup]" in done.stdout
    local = tmp_path / "build" / "runs" / "fails"
    # This run's compiled pipeline and full log, named by its run id (a rerun of the name keeps them).
    compiled, logs = sorted(local.glob("pipeline.*.yaml")), sorted(local.glob("pipeline.*.log"))
    assert len(compiled) == len(logs) == 1 and compiled[0].name.removesuffix(".yaml") == logs[0].name[:-4]
    assert f"see {logs[0]}" in done.stderr
    assert not (tmp_path / "gs:").exists()
    # The steps that ran left their reports in the gs:// run directory; the summary read them from there.
    assert "runs/fails/reports/tiny-8b-recipe/plan.json" in written
    assert "runs/fails/reports/tiny-70b-recipe/preflight.json" in written
    assert "runs/fails/reports/provision.json" not in written and "runs/fails/reports/cleanup.json" in written
    assert done.stdout.count("preflight     skipped") == 2
