"""Recurring runs: a Vertex AI ``PipelineJobSchedule`` or a KFP recurring run (``multislice schedule``).

One cron syntax for users: the 5 standard fields ``minute hour day-of-month
month day-of-week`` (numbers, ``*``, ranges ``a-b``, lists ``a,b``, steps
``*/n``, 3-letter month and day names), plus an optional IANA time zone.
:class:`Cron` validates it (croniter) and converts it:

* Vertex AI: the same 5 fields, prefixed ``TZ=<zone> `` when a zone is given
  (Vertex AI docs, "Schedule a pipeline run": ``cron`` accepts an optional
  ``TZ=`` or ``CRON_TZ=`` prefix).
* KFP: 6 fields with seconds first (``0 <the 5 fields>``), as KFP's
  ScheduledWorkflow controller parses cron with robfig/cron v1's ``cron.Parse``
  (kubeflow/pipelines ``backend/src/crd/controller/scheduledworkflow/util/
  cron_schedule.go``): seconds required, day-of-week 0-6 only (``7`` refused),
  no ``L``/``W``/``#``. KFP takes no time zone in the expression: the
  controller's zone applies, which is its ``CRON_SCHEDULE_TIMEZONE``
  environment variable (UTC when unset, as on a default install; a platform
  such as Charmed Kubeflow sets it from its ``timezone`` option), so a zone
  other than UTC is refused with the fix, and the times printed assume UTC.
  KFP also takes an interval trigger (``interval_second``) instead of a cron.

Each target's own dialect is checked before anything is sent
(:func:`check_dialect`): croniter alone accepts expressions (``0 3 * * 7``,
``0 3 L * *``) that KFP's controller rejects after the pipeline version has
been uploaded. Vertex AI documents "unix-cron" (``ScheduleConfig.cron``,
Wikipedia's cron): the same 5-field subset is accepted there (numbers, ``*``,
ranges, lists, steps, names; day-of-week 0-6), anything else is refused.

Concurrency and catch-up are two separate, explicit settings:

* concurrency: ``max_concurrent_runs`` (Vertex ``max_concurrent_run_count``,
  KFP ``max_concurrency``) and, on Vertex only, ``allow_queueing`` (a run due
  at the limit waits instead of being skipped);
* catch-up: ``catch_up`` (KFP ``no_catchup = not catch_up``; Vertex
  ``resume(catch_up=...)``). Off by default: with it, KFP starts every run
  missed since ``start_time`` or while paused (a backfill of multi-hour
  training runs). Turning it on warns (:class:`CatchUpWarning`) with the
  number of runs it would start now.

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
``start_time``, ``end_time``), ``pause``, ``resume(catch_up)``, ``update``,
``list``, ``delete``; kfp 2.17 ``Client.create_recurring_run``
(``cron_expression``, ``interval_second``, ``max_concurrency``,
``no_catchup``), ``get_recurring_run``, ``disable_recurring_run``,
``enable_recurring_run``, ``list_recurring_runs``, ``delete_recurring_run``.
"""

from __future__ import annotations

import datetime
import re
import tempfile
import warnings
import zoneinfo
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from multislice import config, identity
from multislice.config import ConfigError
from multislice.delivery import checks, submission
from multislice.delivery.submission import KfpTarget, VertexTarget

_FIELD = re.compile(r"^[0-9A-Za-z*?/,\-]+$")
#: Characters of the pipeline run's id each scheduled run appends to run_name
#: (:func:`multislice.identity.unique_run_name`).
SUFFIX_CHARACTERS = identity.UNIQUE_SUFFIX_CHARACTERS
FIELD_NAMES = ("minute", "hour", "day-of-month", "month", "day-of-week")
#: Ranges of robfig/cron v1 (parser.go ``seconds``..``dow`` bounds), the same in unix-cron.
_BOUNDS = {"minute": (0, 59), "hour": (0, 23), "day-of-month": (1, 31), "month": (1, 12), "day-of-week": (0, 6)}
_NAMES = {
    "month": {m: i + 1 for i, m in enumerate("jan feb mar apr may jun jul aug sep oct nov dec".split())},
    "day-of-week": {d: i for i, d in enumerate("sun mon tue wed thu fri sat".split())},
}
#: Most runs counted for a catch-up warning (the count says "at least" beyond it).
CATCH_UP_COUNT_LIMIT = 10_000


class CatchUpWarning(UserWarning):
    """Catch-up is on: the schedule starts the runs it missed, counted in the message."""


def check_dialect(expression: str, target: str) -> None:
    """Refuse a 5-field cron that the target's scheduler would not accept.

    KFP: robfig/cron v1 ``cron.Parse`` (kubeflow/pipelines
    ``scheduledworkflow/util/cron_schedule.go``); its fields accept ``*``,
    ``?``, ``a-b``, ``a,b``, ``/n`` and 3-letter names within the ranges of
    ``_BOUNDS`` (so ``7`` for Sunday and ``L``/``W``/``#`` are refused).
    Vertex AI: unix-cron as documented (same set, without ``?``).

    Raises:
        ConfigError: (field ``cron``) the field, its value and the fix.
    """
    for name, value in zip(FIELD_NAMES, expression.split(), strict=True):
        low, high = _BOUNDS[name]
        for part in value.split(","):
            rng, _, step = part.partition("/")
            if step and not step.isdigit():
                raise ConfigError([("cron", f"{name} field {value!r}: the step after / must be a number")])
            if rng in ("*", "?"):
                if rng == "?" and (target != "kfp" or name not in ("day-of-month", "day-of-week")):
                    raise ConfigError([("cron", f"{name} field {value!r}: '?' is not accepted here; use *")])
                continue
            for bound in rng.split("-", 1):
                number = _NAMES.get(name, {}).get(bound.lower()) if not bound.isdigit() else int(bound)
                if number is None:
                    raise ConfigError(
                        [("cron", f"{name} field {value!r}: {bound!r} is not accepted by {target} "
                                  f"(its cron has no L, W, # or other special characters); use numbers "
                                  f"{low}-{high}, *, ranges, lists or steps")]
                    )  # fmt: skip
                if not low <= number <= high:
                    fix = "; use 0 for Sunday" if name == "day-of-week" and number == 7 else ""
                    raise ConfigError(
                        [("cron", f"{name} field {value!r}: {number} is outside {low}-{high} for {target}{fix}")]
                    )


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
            ConfigError: (field ``cron``) a control or format character (a
                trailing newline, a tab: refused, never stripped), not 5 fields,
                a field with other characters, or an out-of-range value; (field
                ``timezone``) an unknown zone.
        """
        from croniter import croniter

        if problem := config.values.control_problem(expression):
            raise ConfigError([("cron", f"{problem}: separate the 5 fields with spaces, e.g. '0 3 * * *'")])
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
        if not croniter.is_valid(normal.replace("?", "*")):
            check_dialect(normal.replace("?", "*"), "cron")  # names the field and its range when one is out of it
            raise ConfigError(
                [("cron", f"{normal!r} is not a valid cron expression; give 5 fields, {' '.join(FIELD_NAMES)}, "
                          "e.g. '0 3 * * *' for 03:00 every day or '30 2 * * mon-fri'")]
            )  # fmt: skip
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
        it = croniter(self.expression.replace("?", "*"), base)
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
        request: With ``dry_run``: what would have been sent (nothing was); None otherwise.
    """

    target: str
    schedule_id: str
    name: str
    cron: str
    state: str = ""
    parameters: Mapping[str, Any] | None = None
    request: submission.Request | None = None


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
    # With unique_run_name the run spec's checks count each run's suffix (multislice.config.checks).
    prepared = submission.prepare(profile, values, target)
    return prepared


def create(
    profile: str | Mapping[str, Any],
    parameters: Mapping[str, Any] | None = None,
    *,
    target: str,
    cron: str | None = None,
    timezone: str | None = None,
    interval_seconds: int | None = None,
    name: str | None = None,
    max_concurrent_runs: int = 1,
    allow_queueing: bool = False,
    catch_up: bool = False,
    max_runs: int | None = None,
    start_time: str | None = None,
    end_time: str | None = None,
    continue_run: bool = False,
    vertex: VertexTarget | None = None,
    kfp: KfpTarget | None = None,
    now: datetime.datetime | None = None,
    dry_run: bool = False,
) -> Schedule:
    """Create a schedule of the profile's pipeline (``dry_run``: check and compile it, send nothing).

    Args:
        profile: A profile name, a path to a ``.yaml``, or its content.
        parameters: Pipeline parameter values every run gets.
        target: ``vertex`` or ``kfp``.
        cron: 5-field cron (see the module doc), checked against the target's
            dialect; ``timezone`` an IANA zone (Vertex only).
        interval_seconds: KFP only, instead of ``cron``: a run every N seconds
            (KFP ``periodic_schedule.interval_second``).
        name: Display name; default ``<run_name>-schedule``.
        max_concurrent_runs: Runs of this schedule at once (Vertex
            ``max_concurrent_run_count``, KFP ``max_concurrency``), at least 1.
        allow_queueing: Vertex only: a run due while ``max_concurrent_runs``
            are running waits instead of being skipped (``allow_queueing``).
            KFP has no queue (its controller starts a due run once a slot is
            free only through catch-up), so it is refused there.
        catch_up: Start the runs missed since a past ``start_time`` (KFP
            ``no_catchup=False``); off by default. When on and runs were
            missed, a :class:`CatchUpWarning` gives their number.
        max_runs: Stop after this many runs (Vertex only); None for no limit.
        start_time, end_time: RFC 3339 times bounding the schedule; None for none.
        continue_run: Every run continues one run name (see the module doc).
        vertex, kfp: The target's settings (:mod:`multislice.delivery.submission`).
        now: The current time for the catch-up count (tests); default now.
        dry_run: Validate and compile as for a real create, build no client and send nothing: the
            :class:`Schedule` returned has no ``schedule_id`` and its ``request`` says what would be sent.

    Returns:
        The created :class:`Schedule` (with ``dry_run``: the one that would be).

    Raises:
        ConfigError: bad cron, zone, counts or parameters, before anything is sent.
    """
    where = submission.check_target(target, vertex, kfp)
    # Every problem at once: a bad cron does not hide a bad count, a placeholder or a bad parameter.
    issues: list[tuple[str, str]] = []
    if (cron is None) == (interval_seconds is None):
        issues.append(("cron", "give either a cron expression or (KFP only) an interval in seconds"))
    when = None
    if cron is not None:
        try:
            if not isinstance(cron, str):
                raise ConfigError([("cron", f"{cron!r} is not a cron expression (a string such as '0 3 * * *')")])
            when = Cron.parse(cron, timezone)
            check_dialect(when.expression, target)
        except ConfigError as error:
            issues += error.issues
            when = None
    start = end = None
    try:
        start = parse_time("start_time", start_time)
    except ConfigError as error:
        issues += error.issues
    try:
        end = parse_time("end_time", end_time)
    except ConfigError as error:
        issues += error.issues
    if start and end and end <= start:
        issues.append(("end_time", f"{end_time} is not after start_time {start_time}; give a later end_time"))
    elif when is not None and (
        problem := checks.cron_problem(when.expression, when.timezone, _since(start, catch_up, now), end)
    ):
        issues.append(("cron", problem))
    if interval_seconds is not None and (
        target != "kfp" or checks.count_problem(interval_seconds, 1, checks.INT64_MAX)
    ):
        issues.append(
            ("interval_seconds", f"an interval of 1 to {checks.INT64_MAX:,} seconds, on KFP only (Vertex AI takes a "
                                 f"cron); got {interval_seconds!r}")
        )  # fmt: skip
    if name is not None and (problem := checks.display_name_problem(name)):
        issues.append(("name", problem))
    if allow_queueing and target == "kfp":
        issues.append(
            ("allow_queueing", "KFP has no queue for recurring runs: a run due at max_concurrency is skipped, "
                               "or started later only with catch_up; leave out allow_queueing (Vertex AI only)")
        )  # fmt: skip
    if catch_up and target == "vertex":
        issues.append(
            ("catch_up", "Vertex AI catches up only when a paused schedule is resumed: use resume with catch_up")
        )
    if problem := checks.max_concurrent_runs_problem(max_concurrent_runs, target):
        issues.append(("max_concurrent_runs", problem))
    elif continue_run and max_concurrent_runs != 1:
        issues.append(("max_concurrent_runs", "continue_run needs 1: two runs would write the same checkpoints"))
    if max_runs is not None and (target == "kfp" or checks.count_problem(max_runs, 1, checks.INT64_MAX)):
        issues.append(
            ("max_runs", f"give a count of 1 to {checks.INT64_MAX:,} (Vertex AI only; KFP has no run limit); "
                         f"got {max_runs!r}")
        )  # fmt: skip
    data = config.read_profile(profile) if isinstance(profile, str) else dict(profile)
    prepared = None
    try:
        prepared = schedule_parameters(data, parameters, target, continue_run)
    except ConfigError as error:
        issues += error.issues
    if issues or prepared is None:
        raise ConfigError(issues)
    spec, arguments = prepared
    cron_sent = (when.vertex() if target == "vertex" else when.kfp()) if when else f"every {interval_seconds}s"
    if catch_up:
        warn_catch_up(when, interval_seconds, start, end, now)
    display = name or f"{spec.run_name}-schedule"
    # Credentials and the endpoint before the compile (seconds to minutes of CPU); a dry run reaches nothing.
    reached: Any = None if dry_run else submission.connect(where)
    with tempfile.TemporaryDirectory() as tmp:
        template = submission.compile_for(submission.compiled_profile(data, parameters), target, tmp)
        if dry_run:
            notes = tuple(f.describe() for f in config.followed_checkpoint_periods(data, dict(parameters or {})))
            request = submission.request_for(spec, arguments, template, where, notes)
            zone = f" (zone {when.timezone})" if when and when.timezone else ""
            each = (
                f"continues run {spec.run_name}"
                if continue_run
                else f"a new run named {spec.run_name}-<its run id, {SUFFIX_CHARACTERS} characters>"
            )
            request.settings.update(
                {
                    "schedule name": display,
                    "cron": cron_sent + zone,
                    "each run": each,
                    "max concurrent runs": max_concurrent_runs,
                    "allow queueing": allow_queueing,
                    "catch up": catch_up,
                    "start time": start_time or "(now)",
                    "end time": end_time or "(none)",
                    "max runs": max_runs or "(no limit)",
                }
            )
            return Schedule(target, "", display, cron_sent, "not created (dry run)", arguments, request)
        if isinstance(reached, VertexTarget):
            from google.cloud import aiplatform

            job = submission.vertex_job(template, spec, arguments, reached)
            created = aiplatform.PipelineJobSchedule(
                pipeline_job=job, display_name=display, credentials=reached.credentials
            )
            created.create(
                cron=cron_sent,
                start_time=start_time,
                end_time=end_time,
                allow_queueing=allow_queueing,
                max_run_count=max_runs,
                max_concurrent_run_count=max_concurrent_runs,
                service_account=reached.service_account,
                network=reached.network,
            )
            return Schedule("vertex", created.resource_name, display, cron_sent, "ACTIVE", arguments)
        assert isinstance(where, KfpTarget)
        client = reached
        pipeline_id, version_id, _ = submission._kfp_upload(
            client, template, submission._compiled_by(), where.namespace
        )
        experiment = client.create_experiment(where.experiment, namespace=where.namespace)
        recurring = client.create_recurring_run(
            experiment_id=experiment.experiment_id,
            job_name=display,
            cron_expression=cron_sent if when else None,
            interval_second=interval_seconds,
            start_time=start_time,
            end_time=end_time,
            max_concurrency=max_concurrent_runs,
            no_catchup=not catch_up,
            pipeline_id=pipeline_id,
            version_id=version_id,
            params=arguments,
            enable_caching=False,
            service_account=where.service_account,
        )
        return Schedule("kfp", recurring.recurring_run_id, display, cron_sent, "ENABLE", arguments)


def _since(start: datetime.datetime | None, catch_up: bool, now: datetime.datetime | None) -> datetime.datetime:
    """From when a schedule's runs count: ``start_time`` with catch-up (missed runs start), else the later of
    ``start_time`` and now."""
    current = now or datetime.datetime.now(datetime.UTC)
    if start is None:
        return current
    return start if catch_up else max(start, current)


def parse_time(field: str, value: str | None) -> datetime.datetime | None:
    """An RFC 3339 time with its zone (``2026-12-01T03:00:00Z``), or None.

    Raises:
        ConfigError: (field ``field``) not such a time.
    """
    if value is None:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(value)
    except ValueError:
        parsed = None
    if parsed is None or parsed.tzinfo is None:
        raise ConfigError([(field, f"{value!r} is not an RFC 3339 time with a zone; e.g. 2026-12-01T03:00:00Z")])
    return parsed


def missed_runs(
    when: Cron | None,
    interval_seconds: int | None,
    since: datetime.datetime,
    end: datetime.datetime | None = None,
    now: datetime.datetime | None = None,
) -> int:
    """How many fire times fall in ``(since, min(now, end)]``: the runs a catch-up starts at once.

    Counting stops at :data:`CATCH_UP_COUNT_LIMIT`.
    """
    until = (
        min(now or datetime.datetime.now(datetime.UTC), end) if end else (now or datetime.datetime.now(datetime.UTC))
    )
    if until <= since:
        return 0
    if interval_seconds:
        return min(int((until - since).total_seconds()) // interval_seconds, CATCH_UP_COUNT_LIMIT)
    if when is None:
        raise ValueError("missed_runs needs a cron (when) or an interval (interval_seconds)")
    from croniter import croniter

    it = croniter(when.expression.replace("?", "*"), since.astimezone(zoneinfo.ZoneInfo(when.timezone or "UTC")))
    count = 0
    while count < CATCH_UP_COUNT_LIMIT and it.get_next(datetime.datetime) <= until:
        count += 1
    return count


def warn_catch_up(
    when: Cron | None,
    interval_seconds: int | None,
    since: datetime.datetime | None,
    end: datetime.datetime | None = None,
    now: datetime.datetime | None = None,
) -> int:
    """Warn (:class:`CatchUpWarning`) that catch-up is on, with the runs it would start now; returns the count."""
    count = missed_runs(when, interval_seconds, since, end, now) if since else 0
    more = "at least " if count >= CATCH_UP_COUNT_LIMIT else ""
    warnings.warn(
        CatchUpWarning(
            f"catch-up is on: the schedule starts {more}{count} missed run(s) at once"
            + (f" (every fire time since {since.isoformat()})" if since else "")
            + ", and later every run missed while paused or at the concurrency limit"
        ),
        stacklevel=3,
    )
    return count


def _vertex_schedule(schedule_id: str, where: VertexTarget) -> Any:
    from google.cloud import aiplatform

    return aiplatform.PipelineJobSchedule.get(
        schedule_id, project=where.project, location=where.location, credentials=where.credentials
    )


def list_schedules(target: str, *, vertex: VertexTarget | None = None, kfp: KfpTarget | None = None) -> list[Schedule]:
    """The target's schedules (Vertex: PipelineJobSchedules of the location; KFP: recurring runs, first 100).

    Raises:
        ConfigError: a bad target setting (:func:`multislice.delivery.submission.check_target`), before any request.
    """
    where = submission.check_target(target, vertex, kfp)
    if isinstance(where, VertexTarget):
        from google.cloud import aiplatform

        found = aiplatform.PipelineJobSchedule.list(
            project=where.project, location=where.location, credentials=where.credentials
        )
        return [Schedule("vertex", s.resource_name, s.display_name, s.cron, _state_name(s.state)) for s in found]
    response = where.make_client().list_recurring_runs(page_size=100, namespace=where.namespace)
    return [
        Schedule("kfp", r.recurring_run_id, r.display_name, _kfp_trigger(r.trigger), str(r.mode))
        for r in response.recurring_runs or []
    ]


def _state_name(state: Any) -> str:
    """A Vertex AI schedule's state by name (aiplatform types ``PipelineJobSchedule.state`` as optional)."""
    return "STATE_UNSPECIFIED" if state is None else state.name


def _kfp_trigger(trigger: Any) -> str:
    """A KFP recurring run's cron, or ``every Ns`` for an interval trigger."""
    if trigger.cron_schedule and trigger.cron_schedule.cron:
        return trigger.cron_schedule.cron
    return f"every {trigger.periodic_schedule.interval_second}s"


def change(
    action: str,
    schedule_id: str,
    target: str,
    *,
    catch_up: bool = False,
    vertex: VertexTarget | None = None,
    kfp: KfpTarget | None = None,
    now: datetime.datetime | None = None,
) -> None:
    """``pause``, ``resume`` or ``delete`` one schedule by its ID (Vertex resource name or ID; KFP recurring run ID).

    Resume does not start the runs missed while paused unless ``catch_up`` is
    given (Vertex ``resume(catch_up=...)``, counted from the schedule's
    ``last_pause_time`` in a :class:`CatchUpWarning`). A KFP recurring run
    fixes catch-up when it is created (``no_catchup``), and enabling it again
    backfills every missed run when that was off: such a resume is refused
    unless ``catch_up=True`` says so, and ``catch_up=True`` is refused on one
    created without catch-up.

    Raises:
        ConfigError: an unknown action, or a KFP resume whose catch-up differs from the recurring run's.
    """
    if action not in ("pause", "resume", "delete"):
        raise ConfigError([("action", f"unknown action {action!r}; use pause, resume or delete")])
    where = submission.check_target(target, vertex, kfp)
    if problem := schedule_id_problem(schedule_id, target):
        raise ConfigError([("SCHEDULE_ID", problem)])
    if catch_up and action != "resume":
        raise ConfigError([("catch_up", f"catch_up applies to resume only, not {action}")])
    if isinstance(where, VertexTarget):
        found = _vertex_schedule(schedule_id, where)
        if action == "resume":
            if catch_up:
                paused = found._gca_resource.last_pause_time
                when = Cron.parse(*_split_tz(found.cron))
                warn_catch_up(when, None, paused if paused and paused.year > 1970 else None, None, now)
            # aiplatform's PipelineJobSchedule.resume(catch_up=...) does not send catch_up (1.x: it calls
            # resume_schedule(name=...) only), so the request is sent here with the field set.
            found.api_client.resume_schedule(request={"name": found.resource_name, "catch_up": catch_up})
            return
        {"pause": found.pause, "delete": found.delete}[action]()
        return
    client = where.make_client()
    if action == "resume":
        recurring = client.get_recurring_run(schedule_id)
        backfills = not recurring.no_catchup
        if backfills and not catch_up:
            raise ConfigError(
                [("catch_up", f"recurring run {schedule_id} was created with catch-up: enabling it starts every "
                              "run missed while it was disabled; pass catch_up (--catch-up) to accept that, or "
                              "delete it and create it again without catch-up")]
            )  # fmt: skip
        if catch_up and not backfills:
            raise ConfigError(
                [("catch_up", f"recurring run {schedule_id} was created without catch-up and KFP cannot change "
                              "it; delete it and create it again with catch_up")]
            )  # fmt: skip
        if catch_up:
            cron = recurring.trigger.cron_schedule
            since = recurring.updated_at or recurring.created_at
            when = Cron.parse(cron.cron.split(" ", 1)[1]) if cron and cron.cron else None
            interval = recurring.trigger.periodic_schedule.interval_second if not when else None
            warn_catch_up(when, interval, since, None, now)
    {
        "pause": client.disable_recurring_run,
        "resume": client.enable_recurring_run,
        "delete": client.delete_recurring_run,
    }[action](schedule_id)


#: A Vertex AI schedule: its resource name ``projects/P/locations/L/schedules/ID`` or the numeric ID alone.
_VERTEX_SCHEDULE_ID = re.compile(r"(projects/[a-z0-9-]{1,30}/locations/[a-z0-9-]{1,40}/schedules/)?[0-9]{1,20}")
#: A KFP recurring run ID (a UUID from the API server): letters, digits and '-', safe in a request path.
_KFP_RECURRING_RUN_ID = re.compile(r"[0-9A-Za-z][0-9A-Za-z-]{0,63}")


def schedule_id_problem(schedule_id: Any, target: str) -> str | None:
    """Why ``schedule_id`` is not a schedule's ID on ``target`` (Vertex: resource name or number; KFP: UUID), or None.

    The ID goes into a request path, so anything else (a ``/``, ``..``, a control character) is refused here.
    """
    pattern = _KFP_RECURRING_RUN_ID if target == "kfp" else _VERTEX_SCHEDULE_ID
    if isinstance(schedule_id, str) and pattern.fullmatch(schedule_id):
        return None
    shape = (
        "a recurring run ID (letters, digits and '-')"
        if target == "kfp"
        else "projects/P/locations/L/schedules/ID or the number ID"
    )
    return f"{schedule_id!r} is not {shape}; copy it from `multislice schedule list`"


def _split_tz(cron: str) -> tuple[str, str | None]:
    """``TZ=<zone> <fields>`` or ``CRON_TZ=<zone> <fields>`` to (fields, zone)."""
    if cron.startswith(("TZ=", "CRON_TZ=")):
        zone, _, fields = cron.partition(" ")
        return fields, zone.split("=", 1)[1]
    return cron, None


def update(
    schedule_id: str,
    target: str,
    *,
    cron: str | None = None,
    timezone: str | None = None,
    name: str | None = None,
    max_concurrent_runs: int | None = None,
    allow_queueing: bool | None = None,
    max_runs: int | None = None,
    start_time: str | None = None,
    end_time: str | None = None,
    vertex: VertexTarget | None = None,
    kfp: KfpTarget | None = None,
    dry_run: bool = False,
) -> Schedule:
    """Change a Vertex AI schedule in place (``PipelineJobSchedule.update``); only the given fields are sent.

    ``dry_run``: every check, no client built and nothing sent; the :class:`Schedule` returned carries the
    changes that would be sent as its ``request``.

    KFP's v2beta1 API has no update for recurring runs (RecurringRunService:
    create, get, list, enable, disable, delete), so it is refused with the fix.

    Raises:
        ConfigError: KFP; nothing to change; a bad cron (Vertex dialect), zone, time or count.
    """
    if target != "vertex":
        raise ConfigError(
            [("target", "KFP recurring runs cannot be updated (no update in its API); delete the recurring run "
                        "and create it again with the new settings")]
        )  # fmt: skip
    where = submission.check_target(target, vertex, kfp)
    assert isinstance(where, VertexTarget)  # target is "vertex", checked above
    if problem := schedule_id_problem(schedule_id, target):
        raise ConfigError([("SCHEDULE_ID", problem)])
    cron_sent = None
    start, end = parse_time("start_time", start_time), parse_time("end_time", end_time)
    if start and end and end <= start:
        raise ConfigError([("end_time", f"{end_time} is not after start_time {start_time}; give a later end_time")])
    if cron is not None:
        if not isinstance(cron, str):
            raise ConfigError([("cron", f"{cron!r} is not a cron expression (a string such as '0 3 * * *')")])
        when = Cron.parse(cron, timezone)
        check_dialect(when.expression, target)
        if problem := checks.cron_problem(when.expression, when.timezone, _since(start, False, None), end):
            raise ConfigError([("cron", problem)])
        cron_sent = when.vertex()
    if name is not None and (problem := checks.display_name_problem(name)):
        raise ConfigError([("name", problem)])
    if max_concurrent_runs is not None and (problem := checks.max_concurrent_runs_problem(max_concurrent_runs, target)):
        raise ConfigError([("max_concurrent_runs", problem)])
    if max_runs is not None and (problem := checks.count_problem(max_runs, 1, checks.INT64_MAX)):
        raise ConfigError([("max_runs", problem)])
    changes = {
        "display_name": name, "cron": cron_sent, "start_time": start_time, "end_time": end_time,
        "allow_queueing": allow_queueing, "max_run_count": max_runs, "max_concurrent_run_count": max_concurrent_runs,
    }  # fmt: skip
    if all(v is None for v in changes.values()):
        raise ConfigError([("update", "nothing to change; give --cron, --name, --max-concurrent-runs, ...")])
    if dry_run:
        sent = {k: v for k, v in changes.items() if v is not None}
        settings = {"project": where.project, "location": where.location, "schedule": schedule_id,
                    **{f"change {k.replace('_', ' ')}": v for k, v in sent.items()}}  # fmt: skip
        request = submission.Request(target, "", "PipelineJobSchedule.update (the schedule's pipeline job "
                                     "is not changed)", 0, {}, settings)  # fmt: skip
        return Schedule(target, schedule_id, name or "", cron_sent or "", "not updated (dry run)", request=request)
    found = _vertex_schedule(schedule_id, where)
    found.update(**changes)
    return Schedule("vertex", found.resource_name, found.display_name, found.cron, found.state.name)
