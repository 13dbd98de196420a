"""Pages for the pipelines UI: tables, the train step's plots and summary, the verifier's Markdown report."""

import base64
import io
import json
import re

import matplotlib.image
import pytest

from multislice.delivery import artifacts
from multislice.reports import TrainReport, VerificationReport
from multislice.steps import train as train_step
from multislice.steps import verify_checkpoint as verify_step
from tests.test_metrics import record


def test_html_table_escapes_formats_and_orders_columns():
    rows = [{"stage": "llama3-8b <a>", "hbm_bytes": 17_179_869_184, "fits": True, "ratio": 0.912345},
            {"stage": "llama3-70b"}]  # fmt: skip
    table = artifacts.html_table(rows, {"stage": "stage", "hbm_bytes": "HBM (bytes)", "ratio": "used"})
    assert table.startswith("<table><thead><tr><th>stage</th><th>HBM (bytes)</th><th>used</th></tr></thead>")
    assert "<td>llama3-8b &lt;a&gt;</td><td class=num>17,179,869,184</td><td class=num>0.9123</td>" in table
    assert "<tr><td>llama3-70b</td><td></td><td></td></tr>" in table
    assert "fits" not in table
    md = artifacts.markdown_table(rows, ["stage", "fits"])
    assert md.splitlines() == ["| stage | fits |", "|---|---|", "| llama3-8b <a> | True |", "| llama3-70b |  |"]


def test_write_html_artifact(tmp_path):
    path = artifacts.write_html_artifact(str(tmp_path / "a" / "hbm.html"), "HBM <per> stage", "<p>x</p>")
    text = open(path, encoding="utf-8").read()
    assert text.startswith("<!DOCTYPE html>") and "<title>HBM &lt;per&gt; stage</title>" in text
    assert "<h1>HBM &lt;per&gt; stage</h1>\n<p>x</p>" in text


LOSSES = [7.5, 7.2, 6.9, 6.5, 6.4]


def test_training_figure_plots_the_loss_and_step_time_of_each_step():
    records = [record(s, loss, 1.0 + s) for s, loss in enumerate(LOSSES)]
    records.append(record(3, 6.0, 9.0))  # a restart re-trained step 3: its last record wins
    figure = artifacts.training_figure(records, "t")
    loss_axes, time_axes = figure.axes
    assert list(loss_axes.lines[0].get_xdata()) == [0, 1, 2, 3, 4]
    assert list(loss_axes.lines[0].get_ydata()) == [7.5, 7.2, 6.9, 6.0, 6.4]
    assert list(time_axes.lines[0].get_ydata()) == [1.0, 2.0, 3.0, 9.0, 5.0]
    assert (loss_axes.get_ylabel(), time_axes.get_ylabel()) == ("loss", "seconds")


def _report(**fields):
    return TrainReport(jobset="run-s1", steps_trained=5, restarts=1, first_loss=7.5, final_loss=6.4,
                       step_time_seconds=1.25, tokens_per_second_per_device=77.2, tflops_per_second_per_device=0.01,
                       wall_seconds=30.0, **fields)  # fmt: skip


def test_train_pages_embed_a_png_and_summarise(tmp_path, local_plan):
    stage = local_plan.stages[0]
    metrics_file = tmp_path / "metrics.jsonl"
    metrics_file.write_text("\n".join(json.dumps(record(s, v, 1.0)) for s, v in enumerate(LOSSES)))
    report = _report(metrics_file=str(metrics_file))
    pages = train_step.result_pages(local_plan, stage, report)
    [encoded] = re.findall(r'src="data:image/png;base64,([^"]+)"', pages["html"])
    image = matplotlib.image.imread(io.BytesIO(base64.b64decode(encoded)), format="png")
    assert image.shape[0] > 100 and image.shape[1] > 300
    assert "<td class=num>6.4</td>" in pages["html"] and "<script" not in pages["html"]
    assert "loss **7.500 -> 6.400**" in pages["markdown"] and "1 JobSet restarts" in pages["markdown"]
    written = local_plan.run_dir + f"/reports/{stage.name}"
    assert open(f"{written}/train.html").read() == pages["html"]
    assert open(f"{written}/train.md").read() == pages["markdown"]


def test_skipped_train_page(local_plan):
    pages = train_step.result_pages(local_plan, local_plan.stages[1], TrainReport(jobset="x", skipped=True))
    assert "final checkpoint already existed" in pages["markdown"] and "<img" not in pages["html"]


def test_verification_markdown(local_plan):
    report = VerificationReport.model_validate(
        {"verdict": "FAIL", "latest_step": 19, "parameter_count": 2098432, "written_mesh": {"fsdp": 4},
         "checks": [{"name": "final step", "passed": True, "detail": "19 == 19"},
                    {"name": "finite | values", "passed": False, "detail": "NaN in decoder"}]}
    )  # fmt: skip
    text = verify_step.result_page(local_plan, local_plan.stages[0], report)
    assert text.startswith(f"# verify_checkpoint {local_plan.stages[0].name}: FAIL")
    assert "2,098,432 parameters, written with mesh fsdp=4" in text
    assert "| finite \\| values | FAIL | NaN in decoder |" in text
    path = f"{local_plan.run_dir}/reports/{local_plan.stages[0].name}/verification.md"
    assert open(path).read() == text


@pytest.fixture
def local_plan(tmp_path):
    from multislice import config
    from multislice.plan import make_plan

    return make_plan(config.load_profile("local", {"output_dir": str(tmp_path / "out"), "run_name": "pages"}))


def test_a_skipped_check_is_shown_as_skipped_never_as_pass():
    """A checkpoint from elsewhere (no digest record, no ledger) has ``checksums`` skipped: not a PASS (issue 43)."""
    report = VerificationReport.model_validate(
        {"verdict": "PASS", "checks": [{"name": "checksums", "passed": True, "skipped": True, "detail": "SKIPPED: x"},
                                       {"name": "finite_arrays", "passed": True, "detail": "all finite"}]}
    )  # fmt: skip
    assert [c.result for c in report.checks] == ["SKIPPED", "PASS"]
    text = artifacts.verification_markdown("s", report)
    assert "| checksums | SKIPPED | SKIPPED: x |" in text and "| finite_arrays | PASS |" in text


def test_a_loss_replay_an_older_trainer_image_reported_as_passed_with_skipped_detail_shows_as_skipped():
    """Trainer images before issue 44 wrote a skipped ``loss_replay`` as ``passed`` with a ``skipped: ...`` detail."""
    detail = "skipped: only a synthetic-data stage's batch can be rebuilt"
    report = VerificationReport.model_validate(
        {"verdict": "PASS", "checks": [{"name": "loss_replay", "passed": True, "detail": detail}]}
    )
    assert [(c.result, c.skipped) for c in report.checks] == [("SKIPPED", True)]
    assert f"| loss_replay | SKIPPED | {detail} |" in artifacts.verification_markdown("s", report)


def test_verification_markdown_with_a_mesh_given_as_text():
    report = VerificationReport(verdict="PASS", written_mesh="fsdp=8")
    assert "written with mesh fsdp=8" in artifacts.verification_markdown("s", report)
