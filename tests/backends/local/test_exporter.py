"""The local backend's verify step and export step of a stage with ``export``: one trainer process for both.

The trainer environment here is a stand-in (``MULTISLICE_TRAINER_ENV``) whose ``python`` runs a script printing
what ``multislice.trainer.verify``, ``multislice.trainer.export`` and ``multislice.trainer.verify_export`` print
(their ``main``: the reports, the marker line), and records each start, so the tests count the processes and see
which module each ran; the real modules are run on real checkpoints by the end-to-end run
(``tests/e2e/test_lineage.py``) and ``tests/trainer/test_export.py``.
"""

import sys

import pytest

from multislice import config, storage
from multislice.backends.local import LocalBackend
from multislice.backends.local import exporter as local_exporter
from multislice.plan import make_plan
from multislice.steps import export as export_step
from multislice.steps import verify_checkpoint
from multislice.trainer import export, verify, verify_export

STAND_IN = """
import json, os, sys
module = sys.argv[2]
with open(os.environ["STAND_IN_STARTS"], "a") as starts:
    starts.write(module + "\\n")
verdict = open(os.environ["STAND_IN_VERDICT"]).read().strip()
argv = sys.argv[3:]
checks = [{"name": "latest_step", "passed": verdict == "PASS", "detail": "latest checkpoint step 19, expected 19"}]
verification = {"verdict": verdict, "latest_step": 19, "parameter_count": 16663104, "written_mesh": {"fsdp": 8},
                "checks": checks}
exported = {"verdict": "PASS", "format": "huggingface", "export_dir": argv[argv.index("--output") + 1],
            "checkpoint_step": 19, "parameter_count": 16663104, "files": ["config.json"],
            "logits_check": {"passed": True, "detail": "64 tokens"}} if "--output" in argv else None
if module == "VERIFY":
    print(json.dumps(verification, indent=1))
elif module == "EXPORT":
    print(json.dumps(exported, indent=1))
else:
    print("MARKER" + json.dumps(verification))
    print(json.dumps({"verification": verification, "export": exported if verdict == "PASS" else None}, indent=1))
sys.exit(0 if verdict == "PASS" else 1)
"""


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A trainer environment whose python plays the three tools; returns ``(set verdict, starts so far)``."""
    script = (
        STAND_IN.replace("VERIFY", verify.MODULE)
        .replace("EXPORT", export.MODULE)
        .replace("MARKER", verify_export.MARKER)
    )
    (tmp_path / "stand_in.py").write_text(script)
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} {tmp_path / "stand_in.py"} "$@"\n')
    python.chmod(0o755)
    monkeypatch.setenv("MULTISLICE_TRAINER_ENV", str(tmp_path / "env"))
    monkeypatch.setenv("STAND_IN_STARTS", str(tmp_path / "starts"))
    monkeypatch.setenv("STAND_IN_VERDICT", str(tmp_path / "verdict"))
    (tmp_path / "starts").write_text("")

    def set_verdict(verdict):
        (tmp_path / "verdict").write_text(verdict)

    def starts():
        return (tmp_path / "starts").read_text().split()

    set_verdict("PASS")
    return set_verdict, starts


@pytest.fixture
def plan(tmp_path):
    return make_plan(config.load_profile("local", {"run_name": "unit", "output_dir": str(tmp_path / "out")}))


def test_a_stage_with_export_is_verified_and_exported_by_one_process_and_the_export_step_takes_its_report(
    stand_in, plan
):
    _, starts = stand_in
    stage = plan.stages[1]
    assert stage.export == "huggingface"
    backend = LocalBackend(plan.run_dir)
    verified = verify_checkpoint.run(plan, stage, "run-a", backend=backend)
    assert verified.verdict == "PASS" and starts() == [verify_export.MODULE]
    exported = export_step.run(plan, stage, "run-a", backend=backend)
    assert exported.verdict == "PASS" and exported.export_dir == stage.export_dir
    assert starts() == [verify_export.MODULE]  # no second process: the verify step's export was taken
    assert storage.read_json(local_exporter.handoff_path(stage)) is None  # taken once
    # Run again on its own (a manual rerun of the step), it exports again, in a process of its own.
    assert export_step.run(plan, stage, "run-a", backend=backend).verdict == "PASS"
    assert starts() == [verify_export.MODULE, export.MODULE]


def test_a_failed_verification_exports_nothing_and_leaves_nothing_for_the_export_step(stand_in, plan):
    set_verdict, starts = stand_in
    set_verdict("FAIL")
    stage = plan.stages[1]
    with pytest.raises(verify_checkpoint.VerificationFailed, match="verdict FAIL: latest_step"):
        verify_checkpoint.run(plan, stage, "run-a", backend=LocalBackend(plan.run_dir))
    assert starts() == [verify_export.MODULE]
    assert storage.read_json(local_exporter.handoff_path(stage)) is None
    assert local_exporter.take_over(stage, "run-a") is None


def test_an_export_left_for_another_pipeline_run_is_not_taken(stand_in, plan):
    _, starts = stand_in
    stage = plan.stages[1]
    backend = LocalBackend(plan.run_dir)
    verify_checkpoint.run(plan, stage, "run-a", backend=backend)
    assert export_step.run(plan, stage, "run-b", backend=backend).verdict == "PASS"
    assert starts() == [verify_export.MODULE, export.MODULE]


def test_a_stage_without_export_runs_the_verifier_alone(stand_in, plan):
    _, starts = stand_in
    stage = plan.stages[0]
    assert not stage.export
    assert verify_checkpoint.run(plan, stage, "run-a", backend=LocalBackend(plan.run_dir)).verdict == "PASS"
    assert starts() == [verify.MODULE]
    assert storage.read_json(local_exporter.handoff_path(stage)) is None
