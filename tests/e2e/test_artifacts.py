"""After the local run (the session's ``local_run``), each stage has its UI pages, and the plot is its loss curve."""

import base64
import json
import re

import pytest

from multislice import metrics
from multislice.delivery import artifacts

pytestmark = pytest.mark.e2e


def test_each_stage_has_its_html_and_markdown_pages(local_run):
    assert local_run.returncode == 0, local_run.stderr
    reports = f"{local_run.plan.run_dir}/reports"
    assert f"UI pages    {reports}/<stage>/preflight.html (HBM per chip), train.html" in local_run.stdout
    for stage in local_run.plan.stages:
        checked = json.load(open(f"{reports}/{stage.name}/preflight.json", encoding="utf-8"))
        assert checked["verdict"] == "fits" and checked["target"]["compile_topology"] == "v5e-8"
        hbm_page = open(f"{reports}/{stage.name}/preflight.html", encoding="utf-8").read()
        assert f"<td>{stage.name}</td>" in hbm_page and "HBM per chip (GiB)" in hbm_page
        page = open(f"{reports}/{stage.name}/train.html", encoding="utf-8").read()
        summary = open(f"{reports}/{stage.name}/train.md", encoding="utf-8").read()
        verification = open(f"{reports}/{stage.name}/verification.md", encoding="utf-8").read()
        train = json.load(open(f"{reports}/{stage.name}/train.json", encoding="utf-8"))
        assert train["metrics_file"] == stage.metrics_file  # the records the train step wrote, from the leader's log
        [png] = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
        assert base64.b64decode(png).startswith(b"\x89PNG")
        # The plot is drawn from this stage's own metrics: the embedded PNG is the figure of this stage's
        # records, whose loss line is the stage's loss per step.
        records = metrics.read_records(stage.metrics_file)
        title = f"{stage.name}: loss and step time per step"
        assert artifacts.png_data_uri(artifacts.training_figure(records, title), "x").endswith(f'{png}">')
        loss_axes = artifacts.training_figure(records, title).axes[0]
        assert list(loss_axes.lines[0].get_ydata())[0] == pytest.approx(train["first_loss"])
        assert list(loss_axes.lines[0].get_ydata())[-1] == pytest.approx(train["final_loss"])
        assert len(loss_axes.lines[0].get_xdata()) == stage.steps
        assert f"loss **{train['first_loss']:.3f} -> {train['final_loss']:.3f}**" in summary
        assert verification.startswith(f"# verify_checkpoint {stage.name}: PASS")
