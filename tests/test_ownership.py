"""Ownership of run state: a second run of one run_name is refused before it writes; no run deletes another's.

The owner here is a real process holding the run directory as ``multislice run``
does (:mod:`multislice.ownership`), and the JobSets are the local backend's real
CPU JobSets with scripted pods (tests/backends/local/test_backend.py), so each case takes
seconds and no MaxText runs.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from multislice import cli, names, ownership
from multislice.backends.local import LocalBackend, LocalJobSets, pid_alive
from multislice.steps import stage_labels
from tests.backends.local.test_backend import scripted_jobset
from tests.test_cancel import wait_gone

ROOT = Path(__file__).resolve().parents[1]

#: A process that owns a run directory as ``multislice run`` does, with the pipeline run id its plan step records.
HOLDER = """
import os, sys
from multislice import ownership
claim = ownership.claim(sys.argv[1], sys.argv[2])
os.environ[ownership.ENV_CLAIM] = sys.argv[2]
ownership.join(sys.argv[1], sys.argv[3])
print("held", flush=True)
sys.stdin.read()
"""


def hold(run_dir: Path, run_id: str, pipeline_run_id: str) -> subprocess.Popen:
    """Start a process that owns ``run_dir``; returns once it holds it (it says so)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), run_id, pipeline_run_id],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    assert proc.stdout.readline().strip() == "held"
    return proc


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``root`` but the running JobSets' state (its supervisor's to change): (size, mtime in ns)."""
    found = (p for p in root.rglob("*") if p.is_file() and "jobsets" not in p.relative_to(root).parts)
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in found}


@pytest.fixture
def owned(tmp_path):
    """Run ``unit`` in ``tmp_path``: a live owner (run 1a2b3c4d, pipeline run run-a) whose stage JobSet of scripted
    pods is running. Yields ``(plan, manifest, holder)``; the JobSets are deleted and the holder ended afterwards."""
    plan, manifest = scripted_jobset(tmp_path, "sleep", run_name="unit", run_id="run-a")
    holder = hold(Path(plan.run_dir), "1a2b3c4d", "run-a")
    jobsets = LocalJobSets(plan.run_dir)
    jobsets.create_jobset(manifest)
    yield plan, manifest, holder
    for state in jobsets.list_jobsets():
        jobsets.delete_jobset(state.name)
    holder.kill()
    holder.wait()


def test_a_second_run_into_a_live_runs_directory_is_refused_before_writing_anything(owned, capsys):
    plan, manifest, holder = owned
    run_dir = Path(plan.run_dir)
    before = snapshot(run_dir.parent)
    pods = {p.pid for p in LocalJobSets(run_dir).get_jobset(manifest["metadata"]["name"]).pods}

    code = cli.main(["run", "--profile", "local", "--set", "run_name=unit", "--set", f"output_dir={run_dir.parent}"])

    err = capsys.readouterr().err
    assert code == 2, err
    assert f"error: run directory {run_dir} is owned by run 1a2b3c4d (pipeline run run-a, pid {holder.pid} " in err
    assert "fix: set unique_run_name: true" in err and "another run_name" in err and "Traceback" not in err
    assert snapshot(run_dir.parent) == before  # no pipeline.yaml, no log, no report: nothing at all
    state = LocalJobSets(run_dir).get_jobset(manifest["metadata"]["name"])
    assert state.phase == "Running" and all(pid_alive(pid) for pid in pods)


def test_another_pipeline_run_is_refused_by_its_plan_step(owned):
    plan, _, holder = owned
    with pytest.raises(ownership.RunDirOwned, match="owned by run 1a2b3c4d"):
        ownership.join(plan.run_dir, "run-b")  # a pipeline run not started by this multislice run
    assert ownership.read_owner(plan.run_dir).pipeline_run_id == "run-a"


def test_no_exit_path_of_another_run_deletes_the_owners_jobset(owned, capsys):
    """Run B of the same run_name (refused, cancelled or failed) runs every exit path it has: run A's JobSet and
    pods stay. Then ``multislice cleanup --run`` keeps it while its owner lives, and removes it once it is gone."""
    plan, manifest, holder = owned
    name, stage = manifest["metadata"]["name"], plan.stages[0]
    pods = {p.pid for p in LocalJobSets(plan.run_dir).get_jobset(name).pods}
    backend = LocalBackend(plan.run_dir)

    assert backend.cleanup("run-b", print) == ([], [])
    assert backend.delete_matching(stage_labels(plan, stage, "run-b"), print) == []
    assert backend.delete(name, owner="run-b") is False
    assert cli.run._stop_run(plan, "run-b") == "nothing of pipeline run run-b was left running"
    with pytest.raises(ValueError, match="pipeline run id"):
        backend.delete_matching(stage_labels(plan, stage), print)  # without a run id: refused, not "everything"
    assert backend.jobsets.get_jobset(name).phase == "Running" and all(pid_alive(pid) for pid in pods)

    assert cli.main(["cleanup", "--run", "unit", "--output-dir", str(Path(plan.run_dir).parent)]) == 0
    out = capsys.readouterr().out
    assert f"kept JobSet {name}: its pipeline run run-a is still running (run 1a2b3c4d" in out
    assert backend.jobsets.get_jobset(name).phase == "Running"

    holder.kill()  # the owner crashes: its lock goes with it
    holder.wait()
    assert cli.main(["cleanup", "--run", "unit", "--output-dir", str(Path(plan.run_dir).parent)]) == 0
    assert capsys.readouterr().out == f"removed JobSet {name} (Running -> Deleted)\n"
    assert not wait_gone(pods, timeout=60)


def test_a_jobset_recreated_by_another_run_between_list_and_delete_is_left(tmp_path):
    """Run A lists its JobSet to delete it; before the delete, that JobSet ends and run C creates one of the same
    name (a run continuing A's replaces a finished JobSet). A's delete re-reads the owner and leaves C's."""
    plan, manifest = scripted_jobset(tmp_path, "sleep", run_name="unit", run_id="run-a")
    jobsets = LocalJobSets(plan.run_dir)
    name = manifest["metadata"]["name"]
    jobsets.create_jobset(manifest)
    listed = jobsets.list_jobsets({names.LABEL_PIPELINE_RUN_ID: "run-a"})
    assert [s.name for s in listed] == [name]
    jobsets.delete_jobset(name, owner="run-a")  # A's JobSet ends ...
    _, theirs = scripted_jobset(tmp_path, "sleep", run_name="unit", run_id="run-c")
    created = jobsets.create_jobset(theirs)  # ... and C creates its own under the name
    assert created.labels[names.LABEL_PIPELINE_RUN_ID] == "run-c"

    assert jobsets.delete_jobset(listed[0].name, owner="run-a") is None  # A's delete, from its stale listing
    state = jobsets.get_jobset(name)
    assert (state.phase, state.labels[names.LABEL_PIPELINE_RUN_ID]) == ("Running", "run-c")
    assert all(pid_alive(p.pid) for p in state.pods)
    assert jobsets.delete_jobset(name, owner="run-c").phase == "Deleted"


def test_a_crashed_owner_is_taken_over_and_a_rerun_resumes_in_its_directory(tmp_path):
    run_dir = tmp_path / "unit"
    holder = hold(run_dir, "1a2b3c4d", "run-a")
    with pytest.raises(ownership.RunDirOwned):
        ownership.claim(str(run_dir), "5e6f7a8b")
    os.kill(holder.pid, signal.SIGKILL)  # no handler runs: the kernel drops the lock with the process
    holder.wait()
    with ownership.claim(str(run_dir), "5e6f7a8b") as claim:
        assert ownership.read_owner(str(run_dir)).run_id == "5e6f7a8b" and claim.pipeline_run_id == ""
        os.environ[ownership.ENV_CLAIM] = "5e6f7a8b"
        try:
            ownership.join(str(run_dir), "run-b")  # the rerun's plan step
        finally:
            del os.environ[ownership.ENV_CLAIM]
        assert claim.pipeline_run_id == "run-b"
    with ownership.claim(str(run_dir), "9c0d1e2f"):  # a finished run's directory: free again
        pass


def test_a_pipeline_runs_lease_is_renewed_by_its_own_steps_and_taken_over_once_expired(tmp_path, monkeypatch):
    run_dir = str(tmp_path / "unit")
    os.makedirs(run_dir)
    first = ownership.join(run_dir, "run-a", lease_seconds=60)
    assert (first.run_id, first.pipeline_run_id) == ("run-a", "run-a") and first.expires > time.time()
    assert ownership.join(run_dir, "run-a").expires >= first.expires  # its second stage's plan task
    with pytest.raises(ownership.RunDirOwned, match="pipeline run run-a"):
        ownership.join(run_dir, "run-b")
    with pytest.raises(ownership.RunDirOwned):
        ownership.claim(run_dir, "1a2b3c4d")  # multislice run into a live pipeline run's directory
    assert not ownership.renew(run_dir, pipeline_run_id="run-b") and ownership.renew(run_dir, pipeline_run_id="run-a")
    assert not ownership.release(run_dir, run_id="run-b") and ownership.read_owner(run_dir) is not None

    later = time.time() + 3600 + 1  # past the renewed lease: run-a is gone without its cleanup step
    monkeypatch.setattr(ownership.time, "time", lambda: later)
    assert ownership.join(run_dir, "run-b").pipeline_run_id == "run-b"
    assert ownership.release(run_dir, run_id="run-b") and ownership.read_owner(run_dir) is None


def test_a_gs_run_directory_is_held_by_a_lease(gcs):
    run_dir = "gs://bucket/runs/unit"
    with ownership.claim(run_dir, "1a2b3c4d") as claim:
        assert ownership.read_owner(run_dir).expires is not None
        with pytest.raises(ownership.RunDirOwned, match="owned by run 1a2b3c4d"):
            ownership.claim(run_dir, "5e6f7a8b")
        os.environ[ownership.ENV_CLAIM] = "1a2b3c4d"
        try:
            ownership.join(run_dir, "run-a")
        finally:
            del os.environ[ownership.ENV_CLAIM]
        assert claim.pipeline_run_id == "run-a"
    assert "runs/unit/owner.json" not in gcs.names(prefix="runs/unit/")  # released with the claim
    with ownership.claim(run_dir, "5e6f7a8b"):
        pass
