"""Expected errors: what went wrong and what to do, never a traceback.

Every error a user can act on derives from :class:`UserError`: its message
says what went wrong (naming the field, object or path), ``fix`` says what to
do. The CLI prints both as two lines and exits with ``exit_code``: 2 for bad
input or a machine that is not set up (:class:`InputError`), 1 for a run
that was tried and failed (:class:`RunFailed`). Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


class UserError(Exception):
    """An expected error: ``message`` is the cause, ``fix`` what to do ('' when the cause says it).

    ``str(error)`` is both, the fix on its own ``fix:`` line, so a pipeline task's
    log (which prints the exception) shows what to do as well as the CLI does.

    Attributes:
        message: What went wrong, naming the field, object or path.
        fix: One line: what the user should change or run.
        exit_code: The CLI's exit status for it.
    """

    exit_code = 1

    def __init__(self, message: str, fix: str = ""):
        super().__init__(message)
        self.message = message
        self.fix = fix

    def __str__(self) -> str:
        return f"{self.message}\nfix: {self.fix}" if self.fix else self.message


class InputError(UserError):
    """Bad input or a machine not set up for it (a profile, a path, credentials, an environment): exit 2."""

    exit_code = 2


class RunFailed(UserError):
    """Something was tried and failed (a stage does not fit, training or verification failed): exit 1."""

    exit_code = 1


class ConfigError(InputError, ValueError):
    """A run spec or override is invalid. ``issues`` holds ``(field, message)`` pairs, each naming its fix."""

    def __init__(self, issues: list[tuple[str, str]]):
        self.issues = issues
        lines = [f"  - {field}: {message}" if field else f"  - {message}" for field, message in issues]
        count = f"{len(issues)} problem" + ("s" if len(issues) != 1 else "")
        super().__init__(f"invalid run spec ({count}); nothing was created or started:\n" + "\n".join(lines))


def expected_error(error: BaseException) -> UserError | None:
    """An error of a client library that a user meets and can act on, as a :class:`UserError`; else None.

    Covers what the delivery commands and their Python API (``multislice.submit``,
    :mod:`multislice.delivery.results`) meet outside this package: no Google Cloud credentials
    (google-auth's ``DefaultCredentialsError``), a Google Cloud API refusal (google-api-core's
    ``GoogleAPICallError``), a KFP endpoint that cannot be reached or refuses (urllib3's ``HTTPError``,
    e.g. ``MaxRetryError``; kfp_server_api's ``ApiException``), and a path this machine cannot read or
    write (an ``OSError`` naming its file). The CLI prints the result as ``error:``/``fix:``; the
    Python API raises it (:func:`translated`).
    """
    try:  # the pipeline environment's client libraries (0.3 s, 0.2 s for urllib3): only on an error
        from google.api_core.exceptions import GoogleAPICallError
        from google.auth.exceptions import DefaultCredentialsError
        from urllib3.exceptions import HTTPError as Urllib3Error
    except ImportError:  # the trainer environment (no google-cloud clients): nothing of theirs to translate
        GoogleAPICallError = DefaultCredentialsError = Urllib3Error = ()  # type: ignore[assignment]  # noqa: N806

    if isinstance(error, DefaultCredentialsError):
        return InputError(
            f"no Google Cloud credentials: {error}",
            "run `gcloud auth application-default login`, or set GOOGLE_APPLICATION_CREDENTIALS to a key file",
        )
    if isinstance(error, GoogleAPICallError):
        return RunFailed(f"the Google Cloud API refused: {error}", "check the project, location and your IAM roles")
    if isinstance(error, Urllib3Error) or type(error).__name__ == "ApiException":
        return InputError(
            f"the endpoint did not answer as expected: {error}",
            "check the endpoint (--host, KfpTarget(host=...) or $KF_PIPELINES_ENDPOINT) and that it is reachable",
        )
    if isinstance(error, OSError) and error.filename is not None:
        return InputError(
            f"cannot use {error.filename}: {error.strerror or error}", "check the path and its permissions"
        )
    return None


def translated[**P, R](function: Callable[P, R]) -> Callable[P, R]:
    """Decorate a public Python API function: an error :func:`expected_error` knows is raised as its
    :class:`UserError` (cause and fix, as the CLI prints them), chained to the original (``__cause__``).

    Anything else passes through unchanged.
    """

    @functools.wraps(function)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return function(*args, **kwargs)
        except UserError:
            raise
        except Exception as error:
            found = expected_error(error)
            if found is None:
                raise
            raise found from error

    return call
