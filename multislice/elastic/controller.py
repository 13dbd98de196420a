"""The elastic resize controller: follow a stage's workload, shrink it when a slice is lost, grow it back.

The train step hands its stage here (:func:`follow`). A fixed-size stage, or a backend that does not resize
(:attr:`multislice.backends.base.Backend.elastic`), is followed once. An elastic stage is followed poll by poll: a
:class:`Watch` observes the workload (a lost slice, the slices available, the latest committed checkpoint), asks the
policy (:func:`multislice.elastic.policy.decide`) and, on a relaunch, interrupts the follow; the controller then
records the :class:`~multislice.elastic.policy.Resize` and relaunches the stage on the new count
(:meth:`multislice.plan.Plan.on_slices`, :meth:`~multislice.backends.base.Backend.relaunch`). MaxText resumes from
the latest committed checkpoint and Orbax restores it onto the new mesh.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from multislice import storage
from multislice.backends import Backend
from multislice.backends.base import Finished
from multislice.elastic.policy import Decision, Resize, decide, discard_unlogged_checkpoints
from multislice.plan import Plan, StagePlan

__all__ = ["Watch", "follow"]

Tell = Callable[[str], None]
OnRecord = Callable[[dict[str, Any]], None]


def follow(
    plan: Plan,
    stage: StagePlan,
    backend: Backend,
    records: list[dict[str, Any]],
    on_line: Callable[[str], None],
    tell: Tell,
    on_record: OnRecord | None = None,
) -> tuple[Finished, list[Resize]]:
    """Follow the stage's workload to its end; ``(how it ended, the resizes made)``.

    ``on_line`` reads one line of the leader's log and appends its metrics record, if any, to ``records``; each new
    record is then passed to ``on_record`` (tests, fault injection). An elastic stage on a backend that resizes is
    followed by :func:`follow_elastic` (its records also get ``slices``); any other once, by
    :meth:`~multislice.backends.base.Backend.follow`, with ``[]`` resizes.
    """
    if stage.elastic and backend.elastic:
        resizes: list[Resize] = []
        return follow_elastic(plan, stage, backend, records, on_line, tell, resizes, on_record), resizes
    if stage.elastic:
        tell(f"the {backend.name} backend does not resize workloads yet: training on a fixed size")

    def hooked(line: str) -> None:
        before = len(records)
        on_line(line)
        if on_record is not None:
            for record in records[before:]:
                on_record(record)

    return backend.follow(plan, stage, hooked, tell), []


class Watch:
    """What :func:`follow_elastic` observes of one workload between polls, and the decision it reaches.

    Args:
        plan, stage: The stage as planned (``num_slices``: the full count).
        backend: Where it runs (:meth:`~multislice.backends.base.Backend.lost_slice`,
            :meth:`~multislice.backends.base.Backend.available_slices`).
        running: Slices the watched workload was launched on.
        runnable: The stage's runnable slice counts, most first (:meth:`multislice.plan.StagePlan.runnable_counts`).
        wait_seconds: How long a lost slice's capacity is waited for before shrinking, seconds.
        tell: Where to say what it saw.
        records: The step records read so far (growing back waits until the checkpoint's own step was logged).
    """

    def __init__(
        self,
        plan: Plan,
        stage: StagePlan,
        backend: Backend,
        running: int,
        runnable: list[int],
        wait_seconds: float,
        tell: Tell,
        records: list[dict[str, Any]],
    ) -> None:
        self.plan, self.stage, self.backend, self.tell, self.records = plan, stage, backend, tell, records
        self.running, self.runnable, self.wait_seconds = running, runnable, wait_seconds
        self.lost_at: float | None = None
        self.capacity_at: float | None = None
        self.checkpoint_then: int | None = None
        self.checkpoint_at_decision: int | None = None
        self.decision: Decision | None = None
        self.detected = 0.0

    def interrupt(self) -> bool:
        """Observe, decide (:func:`multislice.elastic.policy.decide`); True to stop following and relaunch."""
        now = time.monotonic()
        lost = self.backend.lost_slice(self.stage.workload)
        available = self.backend.available_slices(self.plan) or 0
        if lost and self.lost_at is None:
            self.lost_at = now
            self.tell(f"slice lost: {lost}; waiting up to {self.wait_seconds:g} s for its capacity")
        elif not lost:
            self.lost_at = None
        latest = storage.latest_committed_step(self.stage.checkpoint_dir)
        if available > self.running and self.capacity_at is None:
            self.capacity_at, self.checkpoint_then = now, latest
            self.tell(f"capacity for {available} slice(s) available; growing back at the next checkpoint")
        elif available <= self.running:
            self.capacity_at = None
        then = -1 if self.checkpoint_then is None else self.checkpoint_then
        # Grow back at a checkpoint whose own step line has been read: MaxText prints a step's metrics one step
        # late, so relaunching as soon as checkpoint S commits would leave step S's loss unlogged (the verifier's
        # final_loss check reads the last steps' losses).
        logged = max((int(r["step"]) for r in self.records if "step" in r), default=-1)
        since = self.capacity_at is not None and latest is not None and latest > then and logged >= latest
        decision = decide(
            self.runnable,
            running=self.running,
            lost_at=self.lost_at,
            available=available,
            now=now,
            wait_seconds=self.wait_seconds,
            checkpoint_since_capacity=since,
        )
        if decision.action == "relaunch" and decision.slices != self.running:
            self.decision, self.detected = decision, self.lost_at or self.capacity_at or now
            self.checkpoint_at_decision = latest
            return True
        return False


def follow_elastic(
    plan: Plan,
    stage: StagePlan,
    backend: Backend,
    records: list[dict[str, Any]],
    on_line: Callable[[str], None],
    tell: Tell,
    resizes: list[Resize],
    on_record: OnRecord | None = None,
) -> Finished:
    """Follow an elastic stage to its end, relaunching it on fewer or more slices as
    :func:`multislice.elastic.policy.decide` says; each step record gets ``slices`` (the count it was trained on) and
    each resize is appended to ``resizes``.

    After each poll of the workload a :class:`Watch` observes: whether the workload lost a slice and waits for its
    capacity (:meth:`~multislice.backends.base.Backend.lost_slice`), how many slices are available
    (:meth:`~multislice.backends.base.Backend.available_slices`) and the latest committed checkpoint (growing back
    waits for one committed after the capacity returned). A relaunch
    (:meth:`~multislice.backends.base.Backend.relaunch`) deletes the workload and creates it for the new count with
    its gradient accumulation (:meth:`multislice.plan.Plan.on_slices`); MaxText resumes from the latest committed
    checkpoint and Orbax restores it onto the new mesh. Returns how the last workload ended (``restarts`` summed over
    every workload).
    """
    runnable = stage.runnable_counts()
    wait_seconds = stage.wait_for_lost_slice_seconds or 0.0
    started = time.monotonic()
    current: dict[str, Any] = {"slices": runnable[0], "restarts": 0, "causes": []}
    pending: dict[str, Resize | None] = {"resize": None}

    def tagged(line: str) -> None:
        before = len(records)
        on_line(line)
        for record in records[before:]:
            record["slices"] = current["slices"]
            resize = pending["resize"]
            if resize is not None and "step" in record:  # a step record (eval records have eval_after_step)
                resize.resumed_at_seconds = round(time.monotonic() - started, 1)
                resize.resumed_from_step = int(record["step"]) - 1
                if resize.last_step_before is not None:
                    resize.steps_lost = max(0, resize.last_step_before - resize.resumed_from_step)
                resize.cost_seconds = round(resize.resumed_at_seconds - resize.detected_at_seconds, 1)
                resize.first_loss_after = record["learning/loss"]
                pending["resize"] = None
            if on_record is not None:
                on_record(record)

    while True:
        running = current["slices"]
        target_plan, target_stage = plan.on_slices(stage, running)
        watch = Watch(plan, stage, backend, running, runnable, wait_seconds, tell, records)
        finished = backend.follow(target_plan, target_stage, tagged, tell, interrupt=watch.interrupt)
        current["restarts"] += finished.restarts
        current["causes"] += finished.restart_causes
        if finished.phase != "Interrupted" or watch.decision is None:
            return Finished(phase=finished.phase, restarts=current["restarts"], leader_logs=finished.leader_logs,
                            restart_causes=current["causes"])  # fmt: skip
        resize = _resize(stage, running, watch, watch.decision, records, started)
        resizes.append(resize)
        pending["resize"] = resize
        tell(f"resize {running} -> {resize.to_slices} slice(s): {resize.cause}")
        if resize.checkpoints_discarded:
            tell(
                f"checkpoint(s) {resize.checkpoints_discarded} committed while the workload stopped, their step "
                f"line never logged: deleted, training resumes from an earlier one"
            )
        backend.relaunch(*plan.on_slices(stage, resize.to_slices), tell)
        current["slices"] = resize.to_slices


def _resize(
    stage: StagePlan, running: int, watch: Watch, decision: Decision, records: list[dict[str, Any]], started: float
) -> Resize:
    """The resize ``decision`` as the train report records it, the unlogged checkpoints deleted
    (:func:`multislice.elastic.policy.discard_unlogged_checkpoints`)."""
    last = next((r for r in reversed(records) if "step" in r), None)
    resize = Resize(
        from_slices=running,
        to_slices=decision.slices,
        cause=decision.cause,
        detected_at_seconds=round(watch.detected - started, 1),
        last_step_before=int(last["step"]) if last else None,
        last_loss_before=last["learning/loss"] if last else None,
    )
    resize.checkpoints_discarded = discard_unlogged_checkpoints(
        stage.checkpoint_dir, resize.last_step_before, watch.checkpoint_at_decision
    )
    return resize
