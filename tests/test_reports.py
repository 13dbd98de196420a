"""Typed step reports: what a KFP component hands the next one, and what a run directory holds."""

import json

import pytest

from multislice import config, reports
from multislice.plan import make_plan


def nulls(value, path="") -> list[str]:
    """Paths of every None in plain data."""
    if value is None:
        return [path]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in nulls(v, f"{path}.{k}")]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in nulls(v, f"{path}[{i}]")]
    return []


SAMPLES = [
    reports.AdmitReport(jobset="r-s", workload=None, uid=None),
    reports.LaunchReport(workload="r-s", placement={"p": reports.PodPlacement(slice=0, host=1, node=None)}),
    reports.TrainReport(jobset="r-s", skipped=True),
    reports.ProvisionReport(backend="gke", node_pools=[{"name": "tpu-0", "reservation": None}]),
    reports.PreflightReport(stage="s", verdict="error", error="x", alternative={"report": {"cost": None}}),
    reports.VerificationReport(verdict="PASS", written_mesh=None),
    reports.CleanupReport(error=None, notified=None),
]


@pytest.mark.parametrize("report", SAMPLES, ids=lambda r: type(r).__name__)
def test_a_report_as_a_component_output_has_no_null_and_reads_back_the_same(report):
    # kfp.local refuses a None inside a dict output ("Value must be one of the following types").
    data = report.to_dict()
    assert nulls(data) == []
    again = type(report).model_validate(data)
    assert again.to_dict() == data


def test_reports_are_written_to_and_read_from_the_run_directory(tmp_path):
    plan = make_plan(config.load_profile("local", {"output_dir": str(tmp_path), "run_name": "r"}))
    stage = plan.stages[0]
    written = reports.write(plan, reports.AdmitReport(jobset=stage.jobset, admitted=True), stage)
    assert (tmp_path / "r" / "reports" / stage.name / "admit.json").is_file()
    assert reports.read(reports.AdmitReport, plan, stage) == written
    assert reports.read(reports.TrainReport, plan, stage) is None
    with pytest.raises(ValueError, match="jobset"):
        reports.AdmitReport.model_validate({"skipped": False})  # a misspelt or missing field is an error
    # A report an older version wrote, with fields since retired, still reads back.
    older = {"jobset": stage.jobset, "skipped": False, "steps_recorded": 20, "leader_log": "/x", "steps_trained": 20}
    (tmp_path / "r" / "reports" / stage.name / "train.json").write_text(json.dumps(older))
    assert reports.read(reports.TrainReport, plan, stage).steps_trained == 20


def test_a_plan_and_a_launch_report_written_with_the_old_jobset_key_still_load(tmp_path):
    # StagePlan.workload and LaunchReport.workload were `jobset` before a stage could be a RayJob.
    plan = make_plan(config.load_profile("local", {"output_dir": str(tmp_path), "run_name": "r"}))
    stage = plan.stages[0]
    data = json.loads(plan.to_json())
    assert "jobset" not in data["stages"][0] and data["stages"][0]["workload"] == stage.workload
    data["stages"][0]["jobset"] = data["stages"][0].pop("workload")
    older = type(plan).model_validate(data)
    assert older == plan and older.stages[0].jobset == older.stages[0].workload == "r-" + stage.name
    launch = reports.LaunchReport.model_validate({"jobset": stage.workload, "pods": 2})
    assert launch.workload == launch.jobset == stage.workload and "jobset" not in launch.to_dict()
