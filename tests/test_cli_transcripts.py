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
