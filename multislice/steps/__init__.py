"""The pipeline's steps, one module each, named as in the pipeline graph.

plan -> preflight -> provision -> for each stage: admit -> launch -> train -> verify_checkpoint;
cleanup runs last whatever happened (exit handler).

Each step is a plain function called by a thin KFP component in
``components/`` (and directly by tests and the CLI). A step renders and
checks what is common, acts through a backend (:mod:`multislice.backends`;
it never asks which one), prints progress lines as ``[<step> <stage>]
message`` and writes its typed report (:mod:`multislice.reports`) to the run
directory, ``<run_dir>/reports/[<stage>/]<step>.json``, local or ``gs://``.
A step takes ``backend=`` to act through a given backend (tests hand in one
bound to an emulated API); by default it builds the plan's
(:func:`multislice.backends.backend_for`).
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from multislice import reports
from multislice.backends import Backend, backend_for
from multislice.plan import Plan, StagePlan


def say(step: str, message: str, stage: str | None = None) -> None:
    """Print one progress line for the step, flushed at once."""
    where = f"{step} {stage}" if stage else step
    print(f"[{where}] {message}", flush=True)
    sys.stdout.flush()


def teller(step: str, stage: StagePlan | None = None) -> Callable[[str], None]:
    """A progress callback printing as :func:`say` does for ``step`` (and ``stage``)."""
    return lambda message: say(step, message, stage.name if stage else None)


def write_report[R: reports.StepReport](plan: Plan, report: R, stage: StagePlan | None = None) -> R:
    """Write a step's report to ``<run_dir>/reports/[<stage>/]`` (local or ``gs://``) and return it."""
    reports.write(plan, report, stage)
    return report


def backend_of(plan: Plan, backend: Backend | None, step: str, stage: StagePlan | None = None) -> Backend:
    """``backend`` when given, else the plan's (API retry notices print as the step's lines)."""
    return backend if backend is not None else backend_for(plan, say=teller(step, stage))
