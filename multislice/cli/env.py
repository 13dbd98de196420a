"""``multislice env install``: the trainer environment local runs and remote calls need."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "env": "multislice env install ~/multislice-envs\n"
    "export MULTISLICE_TRAINER_ENV=~/multislice-envs/trainer   # then the notebook and run_local use it",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice env`` with its handler (``argv``: the command line)."""
    env = sub.add_parser(
        "env",
        help="build the trainer environment (MaxText) that local runs and remote calls need, without a checkout",
        description="Build the trainer environment `make env` builds, with uv (the `uv` package this one depends "
        "on, or uv on PATH) from the lock files this package carries: DIR/trainer (MaxText 0.2.5 with JAX, Orbax, "
        "torch, Ray: about 8 GB; this package copied in) and DIR/loader-hf4 (the export check's transformers "
        "4.57). uv's output is shown as it comes, with a line at least every 10 s; downloads stay in uv's cache, "
        "so an interrupted install resumes. Then set MULTISLICE_TRAINER_ENV=DIR/trainer.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env.add_argument("action", choices=["install"])
    env.add_argument("directory", metavar="DIR", help="where to create trainer/ and loader-hf4/")
    env.add_argument("--python", default=sys.executable, help="a Python 3.12 interpreter (default: this one)")
    env.add_argument("--requirements", metavar="FILE", help="trainer lock file (default: the packaged one, what "
                     "`make env` installs)")  # fmt: skip
    env.add_argument("--loader-requirements", metavar="FILE", help="the export check's loader lock file (default: "
                     "the packaged one)")  # fmt: skip
    env.set_defaults(func=cmd_env)


def cmd_env(args: argparse.Namespace) -> int:
    """``multislice env install DIR``: :func:`multislice.backends.local.environment.install_trainer_env`."""
    from multislice.backends.local import environment  # jsonschema and the CRDs (0.5 s): only for env install

    environment.install_trainer_env(
        args.directory,
        python=args.python,
        trainer_lock=Path(args.requirements) if args.requirements else environment.TRAINER_LOCK,
        loader_lock=Path(args.loader_requirements) if args.loader_requirements else environment.LOADER_HF4_LOCK,
    )
    return 0
