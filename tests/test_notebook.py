"""examples/rerun_from_notebook.ipynb runs top to bottom (nbclient) from an installed copy of the package.

The kernel starts in a temporary directory with ``PYTHONPATH`` naming a copy
of the packages (``multislice``, ``components``, ``pipelines``; links
resolved, as a wheel holds them) outside the checkout, so profiles must come
from the package. KFP and Vertex AI are the suite's fakes (tests/fakes.py,
Vertex AI over REST) and Cloud Storage the loopback one; the fakes play the
cluster: each run moves PENDING -> RUNNING -> SUCCEEDED over the notebook's
polls, writing the stages' reports, metrics files and checkpoints as the
pipeline does.

Two tests: the fast one leaves out the ``@multislice.remote`` section; the
``e2e`` one runs it (4 JAX processes of the trainer environment, twice).
"""

import json
import re
import shutil

import nbformat
import pytest
from nbclient import NotebookClient

from multislice import metrics, storage
from multislice.backends.local import trainer_env
from multislice.reports import TrainReport, VerificationReport
from tests.conftest import ROOT
from tests.fakes import FakeServer
from tests.test_metrics import record

NOTEBOOK = ROOT / "examples" / "rerun_from_notebook.ipynb"
STAGES = ["llama3-8b", "llama3-70b"]


def write_stage(params, index, stage):
    """What the pipeline writes for one stage: metrics file, train and verification reports, a checkpoint."""
    steps = int(params[f"stage{index + 1}_steps"])
    records = [record(s, 7.5 - s / steps, 1.0) for s in range(steps)]
    run_dir = f"{params['output_dir']}/{params['run_name']}"
    storage.write_text(f"{run_dir}/{stage}/metrics.jsonl", "".join(json.dumps(r) + "\n" for r in records))
    measured = metrics.summarize(records).as_dict()
    train = TrainReport(jobset=f"x-{stage}", steps_trained=measured.pop("steps_recorded"), restarts=index,
                        **measured)  # fmt: skip
    storage.write_json(f"{run_dir}/reports/{stage}/train.json", train.to_dict())
    storage.write_json(f"{run_dir}/reports/{stage}/verification.json", VerificationReport(verdict="PASS").to_dict())
    storage.write_text(f"{run_dir}/{stage}/checkpoints/{steps - 1}/{storage.COMMIT_FILE}", "")


class Cluster:
    """Moves each run on the fakes' reads: RUNNING when created; stage 1 on the next read, stage 2 and done after."""

    def __init__(self):
        self.reads = {}

    def advance(self, key, params, set_state, prefix=""):
        if self.reads.get(key, 0) >= 2:
            return
        self.reads[key] = self.reads.get(key, 0) + 1
        write_stage(params, self.reads[key] - 1, STAGES[self.reads[key] - 1])
        if self.reads[key] == 2:
            set_state(prefix + "SUCCEEDED")

    def kfp_created(self, run):
        run["state"] = "RUNNING"

    def kfp_read(self, run):
        if run["state"] == "RUNNING":
            self.advance(run["run_id"], run["runtime_config"]["parameters"], lambda s: run.update(state=s))

    def vertex(self, job):
        if job["state"] == "PIPELINE_STATE_PENDING":
            job["state"] = "PIPELINE_STATE_RUNNING"
        elif job["state"] == "PIPELINE_STATE_RUNNING":
            params = job["runtimeConfig"]["parameterValues"]
            self.advance(job["name"], params, lambda s: job.update(state=s), "PIPELINE_STATE_")


def installed_copy(target):
    """The packages as a wheel installs them: real files (profiles/ is a link to configs/ in the checkout)."""
    for package in ("multislice", "components", "pipelines"):
        shutil.copytree(ROOT / package, target / package, symlinks=False,
                        ignore=shutil.ignore_patterns("__pycache__", "*_test.py"))  # fmt: skip
    return target


def execute(tmp_path, monkeypatch, gcs, remote):
    site, work = installed_copy(tmp_path / "site"), tmp_path / "work"
    work.mkdir()
    with FakeServer() as fake:
        cluster = Cluster()
        fake.state.on_run, fake.state.on_get_run = cluster.kfp_created, cluster.kfp_read
        fake.state.on_vertex_job = cluster.vertex
        monkeypatch.setenv("PYTHONPATH", str(site))
        monkeypatch.setenv("MULTISLICE_TRAINER_ENV", str(trainer_env()))
        monkeypatch.setenv("KF_PIPELINES_ENDPOINT", fake.url)
        monkeypatch.setenv("VERTEX_API_ENDPOINT", fake.url)
        monkeypatch.setenv("VERTEX_PROJECT", "team-project")
        monkeypatch.setenv("MULTISLICE_OUTPUT_DIR", "gs://bucket/runs")
        monkeypatch.setenv("MULTISLICE_POLL_SECONDS", "0")
        monkeypatch.setenv("MULTISLICE_REMOTE_DEMO", "1" if remote else "0")
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        NotebookClient(
            notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}}
        ).execute()
        runs = [r.body for r in fake.state.sent("POST", "/runs")]
        jobs = list(fake.state.vertex_jobs.values())
        terminated = fake.state.sent("POST", ":terminate")
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    text = ["".join(o.get("text", "") for o in c.get("outputs", [])) for c in cells]
    images = [sum("image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in cells]
    return text, images, runs, jobs, terminated, site


def test_notebook_submits_follows_cancels_and_compares(tmp_path, monkeypatch, gcs):
    text, images, runs, jobs, terminated, site = execute(tmp_path, monkeypatch, gcs, remote=False)
    assert f"profiles from {site / 'multislice' / 'profiles'}" in text[0]  # no checkout: the packaged profiles
    a, b, c = runs
    params = a["runtime_config"]["parameters"]
    assert (params["stage1_steps"], params["stage2_per_device_batch_size"], params["max_restarts"]) == (300, 1.0, 6)
    assert "stage1_steps: expected an integer, got 'many'" in text[2] and "stage3_steps: unknown" in text[2]
    name_a = params["run_name"]
    # The run's page, then progress while waiting.
    assert re.search(rf"run page: http://127\.0\.0\.1:\d+/#/runs/details/run-\d+\n{name_a}: RUNNING", text[3])
    assert f"{name_a}: stage llama3-8b train reported, final loss 6.503" in text[3]
    assert f"{name_a}: SUCCEEDED" in text[3] and f"run {name_a}: SUCCEEDED" in text[3]
    assert "| llama3-8b | verified | 300 | 299 |" in text[4] and "| llama3-70b | verified | 200 | 199 |" in text[4]
    assert images[5] == 1  # the loss curves, inline
    name_b = b["runtime_config"]["parameters"]["run_name"]
    assert f"run {name_b}: SUCCEEDED" in text[6] and re.search(r"run llama3-multislice-\S+: CANCELED", text[6])
    assert len(terminated) == 1 and c["runtime_config"]["parameters"]["stage1_steps"] == 300
    table = text[7].splitlines()
    assert table[0].startswith("| run | stage | steps | first loss | final loss |")
    assert table[2].startswith(f"| {name_a} | llama3-8b | 300 | 7.5 | 6.503 |") and table[2].endswith("| PASS |  |")
    assert table[4].startswith(f"| {name_b} | llama3-8b | 200 | 7.5 | 6.505 |")
    assert images[8] == 1  # both runs in one plot
    # Vertex AI: the PipelineJob sent, its console page, followed to the end.
    [job] = jobs
    assert job["runtimeConfig"]["parameterValues"]["stage1_steps"] == 300 and job["state"].endswith("SUCCEEDED")
    assert "https://console.cloud.google.com/vertex-ai/locations/us-east5/pipelines/runs/" in text[9]
    assert "?project=team-project" in text[9] and re.search(r"run \S+: SUCCEEDED", text[9])
    assert text[10] == "" and text[11] == ""  # remote section skipped


@pytest.mark.e2e
def test_notebook_remote_section_runs_on_emulated_slices(tmp_path, monkeypatch, gcs):
    text, *_ = execute(tmp_path, monkeypatch, gcs, remote=True)
    assert "hello from process 0 of 4" in text[10] and "hello from process 1" not in text[10]  # the leader's lines
    assert "devices seen by the leader: 16" in text[10]
    assert "slice 1 host 1 raised builtins.ValueError: bad shard" in text[11]
    assert text[11].rstrip().endswith("ValueError: bad shard")
