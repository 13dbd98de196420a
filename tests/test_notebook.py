"""examples/rerun_from_notebook.ipynb runs top to bottom (nbclient) from the wheel, installed outside the checkout.

The wheel is built from a copy of the checkout (setuptools' PEP 517 backend,
offline, in the trainer environment, which pins setuptools) and installed
with ``pip install --no-deps --target``; the kernel starts in a temporary
directory with ``PYTHONPATH`` naming that target, so profiles, CRDs and lock
files must come from the wheel. Two executions:

- the fast one with ``MULTISLICE_TARGET=kfp,vertex`` and ``MULTISLICE_PROFILE`` a GKE profile with a deployment's
  values (the packaged one's placeholders are refused): KFP and Vertex AI are the suite's fakes (tests/fakes.py,
  Vertex AI over REST) and Cloud Storage the loopback one; the fakes play the cluster: each run moves PENDING -> RUNNING
  -> SUCCEEDED over the notebook's polls, writing the stages' reports, metrics
  files and checkpoints as the pipeline does. The local and
  ``@multislice.remote`` sections are skipped.
- the ``e2e`` one with the default target, ``local``, on the suite's shared
  local runs (``local_runs``: ``e2e`` and its twin ``e2e-twin``, through
  ``MULTISLICE_LOCAL_RUNS``, so nothing trains anew), and the
  ``@multislice.remote`` section (4 JAX processes of the trainer environment, twice).

And one with the packaged profile, whose submit is refused: "Run All" stops there with the cause; run on past it,
each later cell that needs the run skips with one line naming the failed cell.
"""

import json
import re
import shutil
import subprocess
import zipfile
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from multislice import metrics, storage
from multislice.backends.local import trainer_env
from multislice.reports import TrainReport, VerificationReport
from tests import deployment
from tests.conftest import ROOT
from tests.fakes import FakeServer
from tests.test_metrics import record

NOTEBOOK = ROOT / "examples" / "rerun_from_notebook.ipynb"
#: The GKE profile with a deployment's values in place of its placeholders, which submit refuses (tests/deployment.py).
PROFILE = deployment.profile_file("gke-v6e-16x2")
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


#: What the notebook needs from the wheel besides the code: the profiles and model presets (links to configs/ in
#: the checkout), the CRDs the manifests are checked against, and the lock files `multislice env install` installs.
PACKAGE_DATA = [
    "multislice/profiles/local.yaml", "multislice/profiles/gke-v6e-16x2.yaml",
    "multislice/profiles/models/llama3-tiny.yaml", "multislice/data/trainer-requirements.txt",
    "multislice/data/loader-hf4-requirements.txt", "multislice/data/maxtext_config_schema.json",
    "components/train.py", "pipelines/multislice_training.py",
]  # fmt: skip


@pytest.fixture(scope="session")
def wheel_site(tmp_path_factory, trainer_python):
    """The project's wheel, built offline from a copy of the checkout and installed with ``pip --target``."""
    root = tmp_path_factory.mktemp("wheel")
    source, dist, site = root / "source", root / "dist", root / "site"
    skip = (".venvs", ".git", "build", "output", "__pycache__", "*.egg-info", ".ruff_cache", ".pytest_cache")
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*skip))
    build = "import sys; from setuptools import build_meta; print(build_meta.build_wheel(sys.argv[1]))"
    built = subprocess.run([str(trainer_python), "-c", build, str(dist)], cwd=source, capture_output=True, text=True,
                           check=False)  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    wheel = dist / built.stdout.split()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    assert [n for n in PACKAGE_DATA if n not in names] == [], "pyproject.toml's package-data misses these"
    assert wheel.name == "multislice_pipelines-0.1.0-py3-none-any.whl"
    pip = [str(ROOT / ".venvs" / "bootstrap" / "bin" / "python"), "-m", "pip"]  # `make env`'s pip (uv venvs have none)
    done = subprocess.run([*pip, "install", "--no-deps", "--no-index", "--quiet", "--target", str(site), str(wheel)],
                          capture_output=True, text=True, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return site


def execute(tmp_path, monkeypatch, site, env, allow_errors=False):
    """Execute the notebook from ``site`` with ``env`` set; each code cell's text and its count of PNG images.

    ``allow_errors``: run on past a cell that raises (as "Run All" with "continue on error" does), its error in its
    text; else the first cell that raises ends the execution (``nbclient.exceptions.CellExecutionError``).
    """
    work = tmp_path / "work"
    work.mkdir(parents=True)
    monkeypatch.setenv("PYTHONPATH", str(site))
    monkeypatch.setenv("MULTISLICE_TRAINER_ENV", str(trainer_env()))
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(work)}},
                   allow_errors=allow_errors).execute()  # fmt: skip
    cells = [c for c in notebook.cells if c.cell_type == "code"]
    text = [
        "".join(o.get("text", "") or f"{o.get('ename')}: {o.get('evalue')}" * (o.get("output_type") == "error")
                for o in c.get("outputs", []))
        for c in cells
    ]  # fmt: skip
    images = [sum("image/png" in o.get("data", {}) for o in c.get("outputs", [])) for c in cells]
    return text, images


def execute_on_fakes(tmp_path, monkeypatch, site, profile=PROFILE, allow_errors=False):
    """The notebook with ``MULTISLICE_TARGET=kfp,vertex`` against the fakes; also what the fakes were sent."""
    with FakeServer() as fake:
        cluster = Cluster()
        fake.state.on_run, fake.state.on_get_run = cluster.kfp_created, cluster.kfp_read
        fake.state.on_vertex_job = cluster.vertex
        text, images = execute(tmp_path, monkeypatch, site, {
            "MULTISLICE_TARGET": "kfp,vertex", "KF_PIPELINES_ENDPOINT": fake.url, "VERTEX_API_ENDPOINT": fake.url,
            "VERTEX_PROJECT": "team-project", "MULTISLICE_OUTPUT_DIR": "gs://bucket/runs",
            "MULTISLICE_POLL_SECONDS": "0", "MULTISLICE_REMOTE_DEMO": "0", "MULTISLICE_PROFILE": profile,
        }, allow_errors)  # fmt: skip
        runs = [r.body for r in fake.state.sent("POST", "/runs")]
        jobs = list(fake.state.vertex_jobs.values())
        terminated = fake.state.sent("POST", ":terminate")
    return text, images, runs, jobs, terminated


def test_notebook_submits_follows_cancels_and_compares(tmp_path, monkeypatch, gcs, wheel_site):
    text, images, runs, jobs, terminated = execute_on_fakes(tmp_path, monkeypatch, wheel_site)
    site = wheel_site
    assert f"profiles from {site / 'multislice' / 'profiles'}" in text[0]  # no checkout: the packaged profiles
    assert f"targets: kfp, vertex | profile: {PROFILE}" in text[0]
    a, b, c = runs
    params = a["runtime_config"]["parameters"]
    assert (params["stage1_steps"], params["stage2_per_device_batch_size"], params["max_restarts"]) == (300, 1.0, 6)
    assert "stage1_steps: expected an integer, got 'many'" in text[2] and "stage3_steps: unknown" in text[2]
    assert text[3] == ""  # the local section skipped
    name_a = params["run_name"]
    # The run's page, then progress while waiting.
    assert re.search(rf"run page: http://127\.0\.0\.1:\d+/#/runs/details/run-\d+\n{name_a}: RUNNING", text[4])
    assert f"{name_a}: stage llama3-8b train reported, final loss 6.503" in text[4]
    assert f"{name_a}: SUCCEEDED" in text[4] and f"run {name_a}: SUCCEEDED" in text[4]
    assert "| llama3-8b | verified | 300 | 299 |" in text[6] and "| llama3-70b | verified | 200 | 199 |" in text[6]
    assert images[7] == 1  # the loss curves, inline
    name_b = b["runtime_config"]["parameters"]["run_name"]
    assert f"run {name_b}: SUCCEEDED" in text[5] and re.search(r"run llama3-multislice-\S+: CANCELED", text[5])
    assert len(terminated) == 1 and c["runtime_config"]["parameters"]["stage1_steps"] == 300
    table = text[8].splitlines()
    assert table[0].startswith("| run | stage | steps | first loss | final loss |")
    assert table[2].startswith(f"| {name_a} | llama3-8b | 300 | 7.5 | 6.503 |") and table[2].endswith("| PASS |  |")
    assert table[4].startswith(f"| {name_b} | llama3-8b | 200 | 7.5 | 6.505 |")
    assert images[9] == 1  # both runs in one plot
    # Vertex AI: the PipelineJob sent, its console page, followed to the end.
    [job] = jobs
    assert job["runtimeConfig"]["parameterValues"]["stage1_steps"] == 300 and job["state"].endswith("SUCCEEDED")
    assert "https://console.cloud.google.com/vertex-ai/locations/us-east5/pipelines/runs/" in text[10]
    assert "?project=team-project" in text[10] and re.search(r"run \S+: SUCCEEDED", text[10])
    assert text[11] == "" and text[12] == ""  # remote section skipped


def test_a_failed_submit_cell_stops_the_notebook_or_each_later_cell_skips_with_one_line(
    tmp_path, monkeypatch, gcs, wheel_site
):
    """Issue 44: after a failed submit cell, four results cells raised AttributeError on the missing run."""
    from nbclient.exceptions import CellExecutionError

    with pytest.raises(CellExecutionError) as raised:  # "Run All": it stops at the first failure, with its cause
        execute_on_fakes(tmp_path / "stop", monkeypatch, wheel_site, profile="gke-v6e-16x2")
    assert "cluster_project: 'your-project' is the profile's placeholder" in str(raised.value)
    text, _, runs, jobs, _ = execute_on_fakes(tmp_path / "on", monkeypatch, wheel_site, profile="gke-v6e-16x2",
                                              allow_errors=True)  # fmt: skip
    assert runs == [] and jobs == []  # refused before anything was sent
    assert text[4].startswith("ConfigError: invalid run spec") and "--set cluster_project=PROJECT_ID" in text[4]
    skipped = "skipped: the cell 'if \"kfp\" in TARGETS:' failed: ConfigError: invalid run spec"
    for index in (5, 6, 7, 8, 9):  # the second KFP run and the results cells: one line each, no error of their own
        assert text[index].startswith(skipped) and text[index].count("\n") == 1, (index, text[index])
    assert "AttributeError" not in "".join(text)


@pytest.mark.e2e
def test_notebook_reads_the_suites_local_runs_and_runs_the_remote_section(tmp_path, monkeypatch, local_runs,
                                                                        wheel_site):  # fmt: skip
    """The default target (local) on runs the suite made, and ``@multislice.remote`` on emulated slices."""
    main, twin = local_runs
    output = Path(main.plan.run_dir).parent
    assert Path(twin.plan.run_dir).parent == output and main.returncode == twin.returncode == 0
    text, images = execute(tmp_path, monkeypatch, wheel_site, {
        "MULTISLICE_LOCAL_RUNS": f"{output}:e2e,e2e-twin", "MULTISLICE_REMOTE_DIR": str(tmp_path / "remote"),
    })  # fmt: skip
    assert f"profiles from {wheel_site / 'multislice' / 'profiles'}" in text[0]
    assert "targets: local | profile: local" in text[0]
    assert f"runs e2e and e2e-twin in {output}" in text[3]
    assert text[4] == text[5] == text[10] == ""  # KFP and Vertex AI sections skipped
    for stage in ("tiny-8b-recipe", "tiny-70b-recipe"):
        assert f"| {stage} | verified | 20 | 19 |" in text[6]
    assert images[7] == 1 and images[9] == 1
    table = text[8].splitlines()
    assert table[2].startswith("| e2e | tiny-8b-recipe | 20 |") and table[2].endswith("| PASS |  |")
    assert table[3].startswith("| e2e | tiny-70b-recipe | 20 |") and table[3].endswith("| PASS | PASS |")
    assert table[4].startswith("| e2e-twin | tiny-8b-recipe | 20 |")
    assert "hello from process 0 of 4" in text[11] and "hello from process 1" not in text[11]  # the leader's lines
    assert "devices seen by the leader: 16" in text[11]
    assert "slice 1 host 1 raised builtins.ValueError: bad shard" in text[12]
    assert text[12].rstrip().endswith("ValueError: bad shard")
