"""Run a command with the Hugging Face token from Secret Manager in ``$HF_TOKEN`` (the export pod, on Vertex AI).

Usage (trainer image)::

    python -m multislice.trainer.hub_token --secret-version projects/P/secrets/S/versions/V -- python -m ...

Reads the secret version with the pod's Google credentials (the trainer's Google service account through
Workload Identity; it needs ``roles/secretmanager.secretAccessor`` on the secret) through Secret Manager's REST
API (``projects.secrets.versions.access``: ``GET https://secretmanager.googleapis.com/v1/{name}:access``, the
payload base64 in ``payload.data``), as the exit handler reads its webhook URL
(:func:`multislice.delivery.notify.webhook_url`), then replaces itself with the command (``os.execvpe``), the
token in its environment only. The token is never printed, never an argument and never in a Kubernetes object.

Exit status 2, with one line naming the secret (not its value), when it cannot be read.
"""

from __future__ import annotations

import argparse
import base64
import os
import sys
from typing import Any

#: This module, as the trainer image runs it.
MODULE = "multislice.trainer.hub_token"
#: The variable the exporter (and huggingface_hub) read the token from.
ENV = "HF_TOKEN"
#: The key of a Kubernetes Secret holding the token (``exporter.hub_token_kubernetes_secret``).
SECRET_KEY = "token"
#: Secret Manager's REST endpoint (tests point it at a loopback fake).
SECRET_MANAGER_ENDPOINT = "https://secretmanager.googleapis.com"
TIMEOUT_SECONDS = 30.0


class TokenUnavailable(RuntimeError):
    """The secret version could not be read; the message names the secret, never its value."""


def command(secret_version: str, argv: list[str], python: str = "python") -> list[str]:
    """``argv`` run with ``$HF_TOKEN`` from ``secret_version`` (an argument list; the secret's name, not its value)."""
    return [python, "-m", MODULE, "--secret-version", secret_version, "--", *argv]


def read_secret(name: str, credentials: Any = None) -> str:
    """The payload of Secret Manager secret version ``name``, stripped, read with ``credentials`` (default: the
    environment's).

    Raises:
        TokenUnavailable: the request failed, was refused, or the payload is empty.
    """
    try:
        import google.auth
        from google.auth.transport.requests import AuthorizedSession

        if credentials is None:
            credentials, _ = google.auth.default(scopes=["https://www.googleapis.com/auth/cloud-platform"])
        url = f"{SECRET_MANAGER_ENDPOINT}/v1/{name}:access"
        answer = AuthorizedSession(credentials).get(url, timeout=TIMEOUT_SECONDS)
    except Exception as error:  # noqa: BLE001 - named, without the value
        raise TokenUnavailable(f"could not read {name} from Secret Manager: {type(error).__name__}") from None
    if answer.status_code != 200:
        raise TokenUnavailable(f"Secret Manager answered HTTP {answer.status_code} for {name}")
    try:
        value = base64.b64decode(answer.json()["payload"]["data"]).decode("utf-8").strip()
    except (KeyError, ValueError) as error:
        raise TokenUnavailable(f"{name} has no readable payload ({type(error).__name__})") from None
    if not value:
        raise TokenUnavailable(f"{name} is empty")
    return value


def main(argv: list[str] | None = None, credentials: Any = None) -> int:
    """CLI entry: read the token, then ``exec`` the command after ``--``. Returns 2 when the token is unavailable."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv or argv.index("--") == len(argv) - 1:
        print(f"usage: python -m {MODULE} --secret-version NAME -- COMMAND ...", file=sys.stderr)
        return 2
    own, rest = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--secret-version", required=True, help="projects/P/secrets/S/versions/V")
    options = parser.parse_args(own)
    try:
        token = read_secret(options.secret_version, credentials)
    except TokenUnavailable as error:
        print(f"error: {error}; fix: give the trainer's Google service account roles/secretmanager.secretAccessor "
              "on the secret, and check exporter.hub_token_secret", file=sys.stderr)  # fmt: skip
        return 2
    os.execvpe(rest[0], rest, {**os.environ, ENV: token})
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
