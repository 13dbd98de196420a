"""Recurring runs: a Vertex AI ``PipelineJobSchedule`` or a KFP recurring run (``multislice schedule``).

One cron syntax for users: the 5 standard fields ``minute hour day-of-month
month day-of-week`` (numbers, ``*``, ranges ``a-b``, lists ``a,b``, steps
``*/n``, 3-letter month and day names), plus an optional IANA time zone.
:class:`Cron` validates it (croniter) and converts it:

* Vertex AI: the same 5 fields, prefixed ``TZ=<zone> `` when a zone is given
  (Vertex AI docs, "Schedule a pipeline run": ``cron`` accepts an optional
  ``TZ=`` or ``CRON_TZ=`` prefix).
* KFP: 6 fields with seconds first (``0 <the 5 fields>``), as KFP's
  ScheduledWorkflow controller parses cron with robfig/cron's seconds field
  (``kfp.Client.create_recurring_run`` docs, "using 6 space-separated
  fields"). KFP takes no time zone in the expression: the controller's zone
  (UTC on GKE) applies, so a zone other than UTC is refused with the fix.

Each scheduled run gets its own run name: the schedule sends
``unique_run_name=true``, and the plan step appends the pipeline run's ID to
``run_name`` (:func:`multislice.identity.unique_run_name`), so two runs
never write the same checkpoints. ``continue_run=True`` instead keeps one
fixed run name for every run of the schedule: each run resumes the same
run's checkpoints (MaxText restores the latest step; a stage whose final
checkpoint exists is skipped), which is how one long training run is
continued by a schedule; it needs ``max_concurrent_runs=1`` so that two runs
never write the same checkpoint directory at once.

Sources: google-cloud-aiplatform ``PipelineJobSchedule.create`` (``cron``,
``max_concurrent_run_count``, ``allow_queueing``, ``max_run_count``,
``start_time``, ``end_time``), ``pause``, ``resume``, ``list``, ``delete``;
kfp 2.17 ``Client.create_recurring_run`` (``cron_expression``,
``max_concurrency``, ``no_catchup``), ``disable_recurring_run``,
``enable_recurring_run``, ``list_recurring_runs``, ``delete_recurring_run``.
"""

from __future__ import annotations

import datetime
import re
import tempfile
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multislice import config, identity
from multislice.config import ConfigError
from multislice.delivery import submission
from multislice.delivery.submission import KfpTarget, VertexTarget

_FIELD = re.compile(r"^[0-9A-Za-z*/,\-]+$")
#: Characters of the pipeline run's id each scheduled run appends to run_name
#: (:func:`multislice.identity.unique_run_name`).
SUFFIX_CHARACTERS = 8
FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")


@dataclass(frozen=True)
class Cron:
    """A validated 5-field cron expression with an optional IANA time zone.

    Attributes:
        expression: ``minute hour day-of-month month day-of-week``, single-spaced.
        timezone: IANA zone name (``Europe/Paris``) or None (the scheduler's: UTC).
    """

    expression: str
    timezone: str | None = None

    @classmethod
    def parse(cls, expression: str, timezone: str | None = None) -> Cron:
        """Validate a user's cron expression and zone.

        Raises:
            ConfigError: (field ``cron``) not 5 fields, a field with other
                characters, or an out-of-range value; (field ``timezone``) an
                unknown zone.
        """
        from croniter import croniter

        fields = expression.split()
        if len(fields) != 5:
            raise ConfigError(
                [("cron", f"{expression!r} has {len(fields)} fields; give 5: {' '.join(FIELD_NAMES)} "
                          "(e.g. '0 3 * * *' for 03:00 every day); seconds are added for KFP, and a time zone "
                          "goes in --timezone")]
            )  # fmt: skip
        for name, value in zip(FIELD_NAMES, fields, strict=True):
            if not _FIELD.fullmatch(value):
                raise ConfigError([("cron", f"{name} field {value!r}: use numbers, *, a-b, a,b, */n or names")])
        normal = " ".join(fields)
        if not croniter.is_valid(normal):
            raise ConfigError([("cron", f"{normal!r} is not a valid cron expression ({' '.join(FIELD_NAMES)})")])
        if timezone:
            try:
                zoneinfo.ZoneInfo(timezone)
            except (zoneinfo.ZoneInfoNotFoundError, ValueError):
                raise ConfigError(
                    [("timezone", f"unknown time zone {timezone!r}; use an IANA name such as UTC or Europe/Paris")]
                ) from None
        return cls(normal, timezone or None)

    def vertex(self) -> str:
        """The Vertex AI ``cron``: ``TZ=<zone> <5 fields>`` or the 5 fields."""
        return f"TZ={self.timezone} {self.expression}" if self.timezone else self.expression

    def kfp(self) -> str:
        """The KFP ``cron_expression``: ``0 <5 fields>`` (seconds first).

        Raises:
            ConfigError: a time zone other than UTC (KFP's controller uses its own zone).
        """
        if self.timezone and self.timezone not in ("UTC", "Etc/UTC"):
            raise ConfigError(
                [("timezone", f"KFP recurring runs take no time zone (the controller's, UTC on GKE, applies); "
                              f"convert the times to UTC and leave out --timezone {self.timezone}")]
            )  # fmt: skip
        return f"0 {self.expression}"

    def next_times(self, count: int = 3, start: datetime.datetime | None = None) -> list[datetime.datetime]:
        """The next ``count`` fire times after ``start`` (default now), in the schedule's zone (UTC if none)."""
        from croniter import croniter

        zone = zoneinfo.ZoneInfo(self.timezone or "UTC")
        base = (start or datetime.datetime.now(datetime.UTC)).astimezone(zone)
        it = croniter(self.expression, base)
        return [it.get_next(datetime.datetime) for _ in range(count)]


@dataclass(frozen=True)
class Schedule:
    """A created or listed schedule.

    Attributes:
        target: ``vertex`` or ``kfp``.
        schedule_id: Vertex: the Schedule's resource name; KFP: the recurring run ID.
        name: Display name.
        cron: The cron expression as the service holds it.
        state: ``ACTIVE``/``PAUSED`` (Vertex) or ``ENABLE``/``DISABLE`` (KFP), as the service reports.
        parameters: The parameter values each run gets.
    """

    target: str
    schedule_id: str
    name: str
    cron: str
    state: str = ""
    parameters: Mapping[str, Any] | None = None


def schedule_parameters(
    profile: Mapping[str, Any], values: Mapping[str, Any] | None, target: str, continue_run: bool
) -> tuple[config.RunSpec, dict[str, Any]]:
    """Validated parameter values for every run of a schedule.

    Without ``continue_run``: ``unique_run_name=true`` and ``run_name`` is the
    base name (the profile's unless given); each run appends its own ID.
    With it: ``unique_run_name=false`` and ``run_name`` fixed.

    Raises:
        ConfigError: as :func:`multislice.delivery.submission.prepare`, and (without ``continue_run``)
            a run name that is too long once each run's suffix is appended.
    """
    values = dict(values or {})
    values.setdefault("run_name", str(profile.get("run_name", "run")))
    values["unique_run_name"] = not continue_run
    prepared = submission.prepare(profile, values, target)
    if not continue_run:
        # Each run's plan step appends "-<8 characters of its run id>": check the name every run will have.
        suffixed = identity.unique_run_name(str(values["run_name"]), "0" * SUFFIX_CHARACTERS)
        try:
            config.load_spec(profile, {**values, "run_name": suffixed, "unique_run_name": False})
        except ConfigError as error:
            issues = [
                (
                    field,
                    f"every scheduled run appends '-' and {SUFFIX_CHARACTERS} characters of its run id "
                    f"(as {suffixed!r}): {message}"
                    if field == "run_name"
                    else message,
                )
                for field, message in error.issues
            ]
            raise ConfigError(issues) from None
    return prepared


def create(
    profile: str | Mapping[str, Any],
    parameters: Mapping[str, Any] | None = None,
    *,
    target: str,
    cron: str,
    timezone: str | None = None,
    name: str | None = None,
    max_concurrent_runs: int = 1,
    allow_queueing: bool = False,
    max_runs: int | None = None,
    start_time: str | None = None,
    end_time: str | None = None,
    continue_run: bool = False,
    vertex: VertexTarget | None = None,
    kfp: KfpTarget | None = None,
) -> Schedule:
    """Create a schedule of the profile's pipeline.

    Args:
        profile: A profile name, a path to a ``.yaml``, or its content.
        parameters: Pipeline parameter values every run gets.
        target: ``vertex`` or ``kfp``.
        cron: 5-field cron (see the module doc); ``timezone`` an IANA zone.
        name: Display name; default ``<run_name>-schedule``.
        max_concurrent_runs: Runs of this schedule at once (Vertex
            ``max_concurrent_run_count``, KFP ``max_concurrency``), at least 1.
        allow_queueing: A run due while ``max_concurrent_runs`` are running
            waits instead of being skipped (Vertex ``allow_queueing``; KFP
            ``no_catchup=False``, which starts the missed runs later).
        max_runs: Stop after this many runs (Vertex only); None for no limit.
        start_time, end_time: RFC 3339 times bounding the schedule; None for none.
        continue_run: Every run continues one run name (see the module doc).
        vertex, kfp: The target's settings (:mod:`multislice.delivery.submission`).

    Returns:
        The created :class:`Schedule`.

    Raises:
        ConfigError: bad cron, zone, counts or parameters, before anything is sent.
    """
    data = config.read_profile(profile) if isinstance(profile, str) else dict(profile)
    when = Cron.parse(cron, timezone)
    issues = []
    if max_concurrent_runs < 1:
        issues.append(("max_concurrent_runs", f"{max_concurrent_runs} is below 1; give 1 or more"))
    if continue_run and max_concurrent_runs != 1:
        issues.append(("max_concurrent_runs", "continue_run needs 1: two runs would write the same checkpoints"))
    if max_runs is not None and (target == "kfp" or max_runs < 1):
        issues.append(("max_runs", "give a count of 1 or more (Vertex AI only; KFP has no run limit)"))
    if target not in ("vertex", "kfp") or (target == "vertex" and vertex is None) or (target == "kfp" and kfp is None):
        issues.append(("target", f"target {target!r} needs to be vertex (with vertex=...) or kfp (with kfp=...)"))
    if issues:
        raise ConfigError(issues)
    cron_sent = when.vertex() if target == "vertex" else when.kfp()
    spec, arguments = schedule_parameters(data, parameters, target, continue_run)
    display = name or f"{spec.run_name}-schedule"
    with tempfile.TemporaryDirectory() as tmp:
        template = submission.compile_for(data, target, tmp)
        if target == "vertex":
            from google.cloud import aiplatform

            job = submission.vertex_job(template, spec, arguments, vertex)
            created = aiplatform.PipelineJobSchedule(
                pipeline_job=job, display_name=display, credentials=vertex.credentials
            )
            created.create(
                cron=cron_sent,
                start_time=start_time,
                end_time=end_time,
                allow_queueing=allow_queueing,
                max_run_count=max_runs,
                max_concurrent_run_count=max_concurrent_runs,
                service_account=vertex.service_account,
                network=vertex.network,
            )
            return Schedule("vertex", created.resource_name, display, cron_sent, "ACTIVE", arguments)
        client = kfp.make_client()
        version = submission.submission_id(display)  # unique: KFP refuses a version name given twice
        pipeline_id, version_id = submission._kfp_upload(client, template, version, f"schedule {display}")
        experiment = client.create_experiment(kfp.experiment, namespace=kfp.namespace)
        recurring = client.create_recurring_run(
            experiment_id=experiment.experiment_id,
            job_name=display,
            cron_expression=cron_sent,
            start_time=start_time,
            end_time=end_time,
            max_concurrency=max_concurrent_runs,
            no_catchup=not allow_queueing,
            pipeline_id=pipeline_id,
            version_id=version_id,
            params=arguments,
            enable_caching=False,
            service_account=kfp.service_account,
        )
        return Schedule("kfp", recurring.recurring_run_id, display, cron_sent, "ENABLE", arguments)


def _vertex_schedule(schedule_id: str, where: VertexTarget) -> Any:
    from google.cloud import aiplatform

    return aiplatform.PipelineJobSchedule.get(
        schedule_id, project=where.project, location=where.location, credentials=where.credentials
    )


def list_schedules(target: str, *, vertex: VertexTarget | None = None, kfp: KfpTarget | None = None) -> list[Schedule]:
    """The target's schedules (Vertex: PipelineJobSchedules of the location; KFP: recurring runs, first 100)."""
    if target == "vertex":
        from google.cloud import aiplatform

        found = aiplatform.PipelineJobSchedule.list(
            project=vertex.project, location=vertex.location, credentials=vertex.credentials
        )
        return [Schedule("vertex", s.resource_name, s.display_name, s.cron, s.state.name) for s in found]
    response = kfp.make_client().list_recurring_runs(page_size=100, namespace=kfp.namespace)
    return [
        Schedule("kfp", r.recurring_run_id, r.display_name, r.trigger.cron_schedule.cron, str(r.mode))
        for r in response.recurring_runs or []
    ]


def change(
    action: str, schedule_id: str, target: str, *, vertex: VertexTarget | None = None, kfp: KfpTarget | None = None
) -> None:
    """``pause``, ``resume`` or ``delete`` one schedule by its ID (Vertex resource name or ID; KFP recurring run ID).

    A resumed schedule does not start the runs it missed while paused.

    Raises:
        ConfigError: an unknown action.
    """
    if action not in ("pause", "resume", "delete"):
        raise ConfigError([("action", f"unknown action {action!r}; use pause, resume or delete")])
    if target == "vertex":
        found = _vertex_schedule(schedule_id, vertex)
        {"pause": found.pause, "resume": lambda: found.resume(catch_up=False), "delete": found.delete}[action]()
        return
    client = kfp.make_client()
    {
        "pause": client.disable_recurring_run,
        "resume": client.enable_recurring_run,
        "delete": client.delete_recurring_run,
    }[action](schedule_id)
