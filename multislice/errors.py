"""Expected errors: what went wrong and what to do, never a traceback.

Every error a user can act on derives from :class:`UserError`: its message
says what went wrong (naming the field, object or path), ``fix`` says what to
do. The CLI prints both as two lines and exits with ``exit_code``: 2 for bad
input or a machine that is not set up (:class:`InputError`), 1 for a run
that was tried and failed (:class:`RunFailed`). Anything else is a bug and
keeps its traceback.
"""

from __future__ import annotations


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
