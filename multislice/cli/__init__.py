"""``multislice``: render manifests, compile the pipeline, run it locally, verify a checkpoint.

Every command that takes a profile also takes ``--set key=value`` (repeatable):
keys are pipeline parameter names (``run_name``, ``num_slices``,
``stage1_steps``...) or dotted paths into the profile (``stages.0.ici.fsdp``);
values go through the same validation as in the pipeline, and a bad one stops
the command before anything is created.

The console script (``multislice = "multislice.cli:main"``) and ``python -m multislice.cli`` run :func:`main`.
One module per sub-command (``render``, ``compile``, ``run``, ``preflight``, ``plan``, ``verify_checkpoint``,
``cleanup``, ``inject``, ``env``, ``images``, ``submit``, ``reap``, ``schedule``, ``calls``) registers its parser
and holds its handler; ``app`` builds the parser and turns expected errors into ``error:``/``fix:`` lines;
``common`` holds what several share (a profile with its overrides, checked output paths, a run found by name).
"""

from multislice.cli.app import build_parser, main

__all__ = ["build_parser", "main"]
