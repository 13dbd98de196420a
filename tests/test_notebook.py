"""examples/rerun_from_notebook.ipynb runs top to bottom (nbclient) against the fake KFP API and loopback GCS."""

import nbformat
from nbclient import NotebookClient

from multislice import metrics, storage
from multislice.reports import TrainReport, VerificationReport
from tests.conftest import ROOT
from tests.fakes import FakeServer
from tests.test_metrics import record

NOTEBOOK = ROOT / "examples" / "rerun_from_notebook.ipynb"


def finish_run(run):
    """Act as the cluster: the run's train and verify steps write their reports to GCS; the run succeeds."""
    params = run["runtime_config"]["parameters"]
    for index, stage in enumerate(["llama3-8b", "llama3-70b"]):
        steps = int(params[f"stage{index + 1}_steps"])
        measured = metrics.summarize([record(s, 7.5 - s / steps, 1.0) for s in range(steps)]).as_dict()
        train = TrainReport(jobset=f"x-{stage}", steps_trained=measured.pop("steps_recorded"), restarts=index,
                            **measured)  # fmt: skip
        base = f"{params['output_dir']}/{params['run_name']}/reports/{stage}"
        storage.write_json(f"{base}/train.json", train.to_dict())
        storage.write_json(f"{base}/verification.json", VerificationReport(verdict="PASS").to_dict())
    run["state"] = "SUCCEEDED"


def test_notebook_reruns_with_new_parameters(monkeypatch, gcs):
    with FakeServer() as fake:
        fake.state.on_run = finish_run
        monkeypatch.setenv("KF_PIPELINES_ENDPOINT", fake.url)
        monkeypatch.setenv("MULTISLICE_OUTPUT_DIR", "gs://bucket/runs")
        notebook = nbformat.read(NOTEBOOK, as_version=4)
        NotebookClient(
            notebook, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
        ).execute()
        [run] = fake.state.sent("POST", "/runs")
    outputs = ["".join(o.get("text", "") for o in cell.get("outputs", [])) for cell in notebook.cells
               if cell.cell_type == "code"]  # fmt: skip
    params = run.body["runtime_config"]["parameters"]
    assert (params["stage1_steps"], params["stage2_per_device_batch_size"], params["max_restarts"]) == (300, 1.0, 6)
    assert params["output_dir"] == "gs://bucket/runs" and params["run_name"].startswith("llama3-multislice-")
    assert "stage1_steps: expected an integer, got 'many'" in outputs[3]
    assert "stage3_steps: unknown pipeline parameter" in outputs[3]
    assert f"run {params['run_name']}: SUCCEEDED" in outputs[5]
    table = outputs[6].splitlines()
    assert table[0].startswith("| stage | steps | first loss | final loss |")
    assert table[2].startswith("| llama3-8b | 300 | 7.5 | 6.503 |") and table[2].endswith("| PASS |")
    assert table[3].startswith("| llama3-70b | 200 | 7.5 | 6.505 |")
