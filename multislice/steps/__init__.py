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

Every step is cancel-safe (:mod:`multislice.cancel`): its component installs
the SIGTERM/SIGINT handler before it imports anything else, the step runs
inside :func:`cancellable`, and a cancelled step removes what it may have
created, found by the run's and stage's labels (a JobSet, a trainer-image
Job), before it ends; its child processes (AOT compile, verifier) are stopped
on the way out and die with it if it is SIGKILLed.

On GKE every step of a pipeline run also holds the run (the run Lease,
:meth:`multislice.backends.base.Backend.holding_run`) while it runs, so that a
run terminated without its exit handler is ended by ``multislice reap``
(:func:`multislice.steps.cleanup.reap_runs`).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import Any

from multislice import cancel, names, ownership, reports
from multislice.backends import Backend, backend_for
from multislice.errors import UserError
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


class Removal:
    """What a cancelled step removes: every unfinished workload carrying ``labels``, through ``backend``.

    The step sets ``backend`` once it has one; before that it has created nothing.
    With ``labels`` None the step creates nothing a signal could leak (its child
    processes are stopped by the ``with`` blocks they run in). Setting ``backend``
    also starts holding the pipeline run (:meth:`multislice.backends.base.Backend.holding_run`:
    on GKE the run Lease is renewed until the step ends), when the step runs for one.
    """

    def __init__(self, labels: dict[str, str] | None):
        self.labels = labels
        self._backend: Backend | None = None
        self.remove: Callable[[], list[str]] | None = None  # instead of labels (cleanup: the whole run)
        self.holds = contextlib.ExitStack()
        self.hold_for: tuple[Plan, str, str, Callable[[str], None]] | None = None  # (plan, run id, step, tell)

    @property
    def backend(self) -> Backend | None:
        """The backend the step acts through (None until it has one)."""
        return self._backend

    @backend.setter
    def backend(self, backend: Backend | None) -> None:
        first = self._backend is None
        self._backend = backend
        if first and backend is not None and self.hold_for is not None:
            plan, run_id, step, tell = self.hold_for
            self.holds.enter_context(backend.holding_run(plan.spec.run_name, plan.run_dir, run_id, step, tell))


def stage_labels(plan: Plan, stage: StagePlan, pipeline_run_id: str | None = None) -> dict[str, str]:
    """Labels every workload of ``stage`` of this run carries (and, when known, of this pipeline run)."""
    labels = {names.LABEL_RUN_NAME: plan.spec.run_name, names.LABEL_STAGE: stage.name}
    if pipeline_run_id:
        labels[names.LABEL_PIPELINE_RUN_ID] = pipeline_run_id
    return labels


@contextlib.contextmanager
def cancellable(
    step: str,
    stage: StagePlan | None = None,
    labels: dict[str, str] | None = None,
    plan: Plan | None = None,
    remove: Callable[[], list[str]] | None = None,
    run_id: str | None = None,
) -> Iterator[Removal]:
    """Run a step's body so that SIGTERM or SIGINT at any instant leaves nothing behind.

    Within it the signals raise :class:`multislice.cancel.Cancelled`; the step's
    child processes stop as the ``with`` blocks they run in unwind, then every
    unfinished workload with ``labels`` (which must name the pipeline run id:
    without one nothing is deleted, as the step created nothing) is deleted (through the step's backend,
    or, before it has one, the plan's: a stage's JobSet may predate the step),
    or ``remove`` (the cleanup step: the whole run) is called instead; further
    signals are ignored meanwhile, and the ``Cancelled`` goes on (a KFP task
    ends failed; the CLI exits 130). While the step runs it renews its pipeline
    run's lease on the run directory, when the run holds one (:mod:`multislice.ownership`),
    and, once it sets ``removal.backend``, the run's hold on the cluster
    (:meth:`multislice.backends.base.Backend.holding_run`); ``run_id`` names the
    pipeline run for a step whose ``labels`` do not (plan, preflight, provision).

    Raises:
        multislice.cancel.Cancelled: the step was cancelled (after the removal).
    """
    removal = Removal(labels)
    removal.remove = remove
    tell = teller(step, stage)
    held_run = (labels or {}).get(names.LABEL_PIPELINE_RUN_ID) or run_id
    if plan is not None and held_run:
        removal.hold_for = (plan, held_run, step, tell)
    run_id = (labels or {}).get(names.LABEL_PIPELINE_RUN_ID)
    renewal = None
    if plan is not None and run_id:
        try:
            if ownership.renew(plan.run_dir, pipeline_run_id=run_id):
                renewal = ownership.Renewal(plan.run_dir, pipeline_run_id=run_id).start()  # a pipeline run's lease
        except OSError as error:  # the run storage: the step's own reads and writes will say what is wrong
            tell(f"could not renew this run's hold on {plan.run_dir}: {error}")
    with cancel.handling():
        try:
            cancel.point(f"{step}:start")
            yield removal
        except cancel.Cancelled as why:
            removed: list[Any] = []
            if removal.remove is not None:
                removed = removal.remove()
            elif removal.labels and names.LABEL_PIPELINE_RUN_ID not in removal.labels:
                pass  # no pipeline run id: the step created nothing (a skipped stage); nothing else is its to delete
            elif removal.labels and (removal.backend is not None or plan is not None):
                try:
                    backend = removal.backend
                    if backend is None:
                        assert plan is not None  # the condition above
                        backend = backend_for(plan, say=tell)
                    removed = backend.delete_matching(removal.labels, tell)
                except UserError as error:  # e.g. the cluster cannot be reached: say so, stay cancelled
                    tell(f"cancelled, but what it created could not be removed: {error}")
            tell(f"cancelled ({why.signame}): removed {', '.join(removed) if removed else 'nothing left running'}")
            raise
        finally:
            removal.holds.close()  # the run's hold stays as last renewed: the next step or the exit handler takes it
            if renewal is not None:
                renewal.stop()
