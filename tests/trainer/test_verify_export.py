"""The verifier and the exporter in one process (``multislice.trainer.verify_export``): its command, its output.

The passing path (verified, then exported and its logits checked) runs on the shared end-to-end run's exported
stage (``tests/e2e/test_lineage.py``); here, what the backends read from it and that a failed verification
exports nothing.
"""

import json
import subprocess

from multislice.backends.local.environment import trainer_process_env
from multislice.trainer import export, verify_export

VERIFIED = {"verdict": "PASS", "latest_step": 19, "checks": []}
EXPORTED = {"verdict": "PASS", "export_dir": "/out/huggingface"}


def test_its_command_is_the_exporters_with_this_module():
    options = {"dtype": "bfloat16", "hub_repo": "org/model", "report": "gs://b/r/export/report.json",
               "card": {"run": "r1", "stage": "s", "steps": 20, "train_loss": None}}  # fmt: skip
    combined = verify_export.command("gs://b/r/s/checkpoints", 19, "gs://b/r/s/export/huggingface", ["a=1"], **options)
    alone = export.command("gs://b/r/s/checkpoints", 19, "gs://b/r/s/export/huggingface", ["a=1"], **options)
    assert combined[:3] == ["python", "-m", verify_export.MODULE] and combined[3:] == alone[3:]
    assert combined[combined.index("--step") + 1] == "19" and combined[-2:] == ["--", "a=1"]


def test_the_verification_is_read_from_the_marker_line_before_the_export_ends():
    running = "jax noise\n" + verify_export.MARKER + json.dumps(VERIFIED) + "\nconverting layer group 0\n{\n"
    assert verify_export.reports_in(running) == (VERIFIED, None)


def test_both_reports_are_read_from_the_last_document():
    done = (
        verify_export.MARKER + json.dumps(VERIFIED) + "\nloader output\n"
        + json.dumps({"verification": VERIFIED, "export": EXPORTED}, indent=1) + "\n"
    )  # fmt: skip
    assert verify_export.reports_in(done) == (VERIFIED, EXPORTED)
    failed = json.dumps({"verification": {**VERIFIED, "verdict": "FAIL"}, "export": None}, indent=1)
    assert verify_export.reports_in(failed) == ({**VERIFIED, "verdict": "FAIL"}, None)


def test_nothing_is_read_from_a_log_without_either():
    assert verify_export.reports_in("") == (None, None)
    assert verify_export.reports_in("Traceback (most recent call last):\n  ...\n") == (None, None)
    assert verify_export.reports_in(verify_export.MARKER + "{not json\n") == (None, None)


def test_a_checkpoint_that_fails_verification_is_not_exported(trainer_python, tmp_path):
    """A stage directory without checkpoints: verdict FAIL (exit 1), printed first on the marker line and last
    beside ``export`` null; no export directory and no export report are written."""
    checkpoints = tmp_path / "stage" / "checkpoints"
    checkpoints.mkdir(parents=True)
    argv = verify_export.command(
        str(checkpoints), 19, str(tmp_path / "stage" / "export" / "huggingface"), ["base_emb_dim=64"],
        str(trainer_python), report=str(tmp_path / "stage" / "export" / "report.json"),
    )  # fmt: skip
    done = subprocess.run(
        argv, capture_output=True, text=True, env=trainer_process_env(trainer_python.parent.parent), timeout=600
    )
    assert done.returncode == 1, done.stderr[-3000:]
    verification, exported = verify_export.reports_in(done.stdout)
    assert verification is not None and exported is None
    assert verification["verdict"] == "FAIL" and verification["latest_step"] is None
    assert verify_export.reports_in(done.stdout.split("\n{\n")[0]) == (verification, None)  # the marker line alone
    assert not (tmp_path / "stage" / "export").exists()
