"""The CLI's user-facing output, compared with its golden transcripts (``make goldens`` rewrites them).

Each command runs as a user would, in a subprocess with no cloud credentials
and no kubeconfig to be found. Expected errors (a bad config, an unknown
profile, a missing checkpoint, no credentials, an unreachable cluster, a
stage that does not fit) print their cause and fix, never a traceback, and
exit 2 for bad input or 1 for a run that failed.
"""

import pytest

from tests.golden import CLI_COMMANDS, cli_golden, cli_transcript

#: Transcript -> the exit status it must end with.
EXIT = {
    "render": 0, "compile": 0, "preflight-does-not-fit": 1, "bad-config": 2, "unknown-profile": 2,
    "missing-checkpoint": 2, "cleanup-unknown-run": 2, "no-credentials": 2, "unreachable-cluster": 2,
    "run-help": 0, "submit-dry-run": 0, "schedule-create-help": 0, "submit-placeholders": 2,
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(CLI_COMMANDS))
def test_cli_output_matches_its_golden_transcript(name):
    text = cli_transcript(name)
    assert "Traceback" not in text
    assert text.rstrip().endswith(f"(exit {EXIT[name]})")
    if EXIT[name]:
        assert "\nerror: " in text and ("\nfix: " in text or "invalid run spec" in text)
    assert text == cli_golden(name).read_text(encoding="utf-8"), f"run `make goldens` and review {cli_golden(name)}"


def test_the_readme_preflight_example_names_the_verdict_without_credentials():
    text = cli_golden("preflight-does-not-fit").read_text(encoding="utf-8")
    assert "does not fit on 2 x v6e-16: needs 50.33 GiB per chip, 31.24 GiB available" in text
    assert "on the local backend" in text  # compiled on this machine, though the profile's backend is gke


def test_the_help_transcripts_list_the_parameters_and_end_with_examples():
    run_help = cli_golden("run-help").read_text(encoding="utf-8")
    assert "run parameters: --set NAME=VALUE (repeatable); profile local's values" in run_help
    assert "\n  stage1_steps=20 (int; sets stages.0.steps)\n" in run_help
    assert "\nexamples:\n  multislice run --profile local " in run_help
    create_help = cli_golden("schedule-create-help").read_text(encoding="utf-8")
    assert create_help.startswith("$ multislice schedule create --help\nusage: multislice schedule create ")
    assert "--cron CRON" in create_help and "\nexamples:\n  multislice schedule create " in create_help


def test_a_dry_run_submission_needs_no_credentials_and_shows_what_would_be_sent():
    text = cli_golden("submit-dry-run").read_text(encoding="utf-8")  # written with no credentials to be found
    assert "dry run: run nightly would be submitted to vertex; nothing was sent" in text
    assert "  pipeline root:        gs://my-bucket/runs/pipeline-root\n" in text
    assert "  labels:               multislice-pipeline=multislice-training, team=ml-platform\n" in text
    assert "  stage1_steps = 4\n" in text and "checkpoint_period follows steps=4" in text


def test_submitting_the_packaged_profile_names_each_placeholder_and_its_fix():
    text = cli_golden("submit-placeholders").read_text(encoding="utf-8")
    fixes = [("output_dir", "--set output_dir=gs://BUCKET/PATH"), ("cluster_project", "--set cluster_project="),
             ("cluster_name", "--set cluster_name="), ("trainer_image", "multislice images build"),
             ("images.pipeline", "--set images.pipeline=")]  # fmt: skip
    for field, fix in fixes:
        assert any(line.startswith(f"  - {field}: ") and fix in line for line in text.splitlines()), field
