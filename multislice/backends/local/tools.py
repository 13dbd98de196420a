"""The trainer environment's one-shot tools (checkpoint verifier, Hugging Face exporter) as processes here.

Both tools are ``python -m multislice.trainer.<tool>`` processes of the trainer environment that print one JSON
report (:func:`multislice.trainer.verify.parse_report`); the GKE backend reads the same report from a Job's log.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from typing import Any

from multislice import cancel
from multislice.backends.base import VerifierTimeout
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.cancel import die_with_parent
from multislice.errors import RunFailed
from multislice.trainer.verify import parse_report

#: How a tool's command is run: :func:`run_tool`'s signature (``argv, timeout, cancel_point, what``) and result.
Runner = Callable[[list[str], float, str, str], subprocess.CompletedProcess]


def run_tool(argv: list[str], timeout: float, cancel_point: str, what: str) -> subprocess.CompletedProcess:
    """Run ``argv`` (a trainer-environment command) to its end and return its exit status and output.

    The process dies with this one (a SIGKILLed step takes its tool along) and is stopped on a timeout or a
    cancel at ``cancel_point`` (:func:`multislice.cancel.point`).

    Args:
        argv: the command, e.g. :func:`multislice.trainer.verify.command`'s.
        timeout: seconds it may run.
        cancel_point: the cancel point's name (``"<step>:<phase>"``).
        what: the tool and its input in words, for the timeout's message.

    Raises:
        VerifierTimeout: it ran past ``timeout`` seconds (it was stopped).
        multislice.cancel.Cancelled: the step was cancelled (it was stopped).
    """
    process = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=trainer_process_env(trainer_env()),
        preexec_fn=die_with_parent(),
    )  # fmt: skip
    try:
        cancel.point(cancel_point)
        stdout, stderr = process.communicate(timeout=timeout)
    except BaseException as error:  # a timeout, or a cancel (multislice.cancel.Cancelled): stop it first
        process.kill()
        process.communicate()
        if not isinstance(error, subprocess.TimeoutExpired):
            raise
        raise VerifierTimeout(
            f"{what} ran past {timeout:.0f} s and was stopped", "raise timeouts.verify if the checkpoint is that large"
        ) from None
    return subprocess.CompletedProcess(argv, process.returncode, stdout, stderr)


def report_of(done: subprocess.CompletedProcess, failed: type[RunFailed], tool: str) -> dict[str, Any]:
    """The JSON report ``done`` printed (a dict).

    Raises:
        failed: it printed none (it could not start); the message has its exit status and the end of its stderr.
    """
    found = parse_report(done.stdout)
    if found is None:
        raise failed(
            f"the {tool} wrote no report (exit {done.returncode}):\n{done.stderr[-3000:]}",
            "check the trainer environment (`make env`) and the checkpoint directory",
        )
    return found
