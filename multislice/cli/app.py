"""The ``multislice`` parser and entry point: each sub-command's module registers its parser, :func:`main` runs its
handler and turns an expected error into ``error:``/``fix:`` lines and an exit status."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from multislice.cli import (
    calls,
    cleanup,
    compile,
    env,
    images,
    inject,
    plan,
    preflight,
    reap,
    render,
    run,
    schedule,
    submit,
    verify_checkpoint,
)
from multislice.errors import UserError, expected_error

#: The first line of ``multislice --help``.
DESCRIPTION = "``multislice``: render manifests, compile the pipeline, run it locally, verify a checkpoint."

#: The sub-commands' modules, in the order ``multislice --help`` lists them. Each has ``add_parser(sub, argv)``,
#: which registers its sub-command with its handler as ``func``, and ``EXAMPLES`` (sub-command -> example lines).
VERBS = (render, compile, run, preflight, plan, verify_checkpoint, cleanup, inject, env, images, submit, reap, schedule,
         calls)  # fmt: skip


class _Parser(argparse.ArgumentParser):
    """An argument parser whose ``epilog`` may be a function, called only when the help is printed
    (``run --help`` reads a profile for its parameter list; no other command pays for it)."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


def _add_examples(sub: Any, examples: dict[str, str], prefix: str = "") -> None:
    """Give every sub-command of ``sub`` its examples (``examples``: each verb module's ``EXAMPLES``) and its
    one-line help as description."""
    helps = {action.dest: action.help for action in sub._choices_actions}
    for name, command in sub.choices.items():
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        command.description = command.description or helps.get(name)
        key = f"{prefix}{name}"
        if command.epilog is None and key in examples:
            command.epilog = "examples:\n" + "\n".join(f"  {line}" for line in examples[key].splitlines())
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_examples(action, examples, f"{key} ")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``multislice`` argument parser; ``argv`` (default ``sys.argv[1:]``) names the profile ``run --help``
    lists the parameters of."""
    parser = _Parser(prog="multislice", description=DESCRIPTION)
    sub = parser.add_subparsers(dest="command", required=True)
    examples: dict[str, str] = {}
    for verb in VERBS:
        verb.add_parser(sub, argv)
        examples.update(verb.EXAMPLES)
    _add_examples(sub, examples)
    return parser


def report_error(error: UserError) -> int:
    """Print an expected error as ``error: <cause>`` and ``fix: <what to do>``; returns its exit status."""
    print(f"error: {error}", file=sys.stderr)
    return error.exit_code


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status.

    Expected errors (:class:`multislice.errors.UserError`: a bad config, a missing
    path or environment, no credentials, an unreachable cluster, a stage that does
    not fit, a failed run) print their cause and fix, never a traceback: exit 2
    for bad input, 1 for a run that failed. An interrupt exits 130.
    """
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except UserError as error:
        return report_error(error)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        translated = expected_error(error)
        if translated is None:
            raise
        return report_error(translated)
