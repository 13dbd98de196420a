"""What the sub-commands share: a profile and its ``--set`` overrides, output paths checked before
anything is written, a run found by name, a dry run's request printed.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from multislice import config, identity, reports, storage
from multislice.delivery import submission
from multislice.errors import InputError
from multislice.plan import Plan, make_plan


def with_profile(p: argparse.ArgumentParser, required: bool = True) -> None:
    """Give a sub-command ``--profile`` (a name in ``configs/`` or a ``.yaml`` path) and ``--set KEY=VALUE``."""
    p.add_argument("--profile", required=required, help="profile name in configs/ or a path to a .yaml")
    p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a parameter or field (repeatable)")


def profile_and_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(profile as data, overrides)`` of ``--profile`` and ``--set``, not yet validated together.

    Raises:
        ConfigError: an unknown profile, a profile file that does not parse, or a ``--set`` that is not KEY=VALUE.
    """
    return config.read_profile(args.profile), config.parse_set_arguments(args.set or [])


def check_output(option: str, value: str, *, directory: bool, suffixes: tuple[str, ...] = ()) -> Path:
    """The local path an option names for writing, checked before anything is read or written.

    Refused: an empty path, a control character, a path under ``/proc``, ``/sys`` or ``/dev``, an existing
    path of the wrong kind (a file for a directory, or the reverse), a parent that is a file, and for a
    file a name not ending in one of ``suffixes``.

    Raises:
        InputError: naming the option and what to give instead.
    """
    what = "directory" if directory else "file"
    fix = f"give {option} a writable {what} path" + (f" ending in {' or '.join(suffixes)}" if suffixes else "")
    if not value.strip():
        raise InputError(f"{option} is empty (it would write into the current directory)", fix)
    if problem := config.values.control_problem(value):
        raise InputError(f"{option}: {problem}", fix)
    if suffixes and not value.endswith(suffixes):
        raise InputError(f"{option} {value!r} does not end in {' or '.join(suffixes)}", fix)
    path = Path(os.path.abspath(value))
    for root in config.values.FORBIDDEN_LOCAL_ROOTS:
        if path == Path(root) or Path(root) in path.parents:
            raise InputError(f"{option} {value!r} is under {root}, a pseudo file system, not storage", fix)
    try:
        if path.exists() and path.is_dir() != directory:
            raise InputError(f"{option} {value!r} is an existing {'file' if directory else 'directory'}", fix)
        blocking = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
    except OSError as error:
        raise InputError(f"{option} {value!r} cannot be inspected: {error.strerror}", fix) from None
    if blocking is not None:
        raise InputError(f"{option} {value!r} is under {blocking}, which is a file, not a directory", fix)
    return path


def check_output_dir(option: str, value: str | None, what: str) -> None:
    """An ``--output-dir`` option (None: not given) checked as a run spec's ``output_dir`` is
    (:func:`multislice.config.values.output_dir_problem`): not empty, ``gs://`` with a bucket name, no control
    character, not a file or a link that leads nowhere.

    Raises:
        InputError: naming ``option`` and what to give (``what``).
    """
    if value is not None and (problem := config.values.output_dir_problem(value)):
        raise InputError(f"{option}: {problem}", f"give {option} {what}: a directory or gs://BUCKET/PATH")


def check_cache_dir(option: str, value: str, *, remote_ok: bool) -> None:
    """A verdict cache directory, checked before anything is compiled: ``gs://`` (where ``remote_ok``) or a
    local directory that exists and is writable, or can be created in a writable directory.

    Raises:
        InputError: naming ``option``, the path and why it cannot hold the cache.
    """
    fix = f"give {option} a writable directory (it is created when missing)"
    if value.startswith("gs://"):
        if not remote_ok:
            raise InputError(f"{option} {value!r}: this machine's compiles keep their verdicts on local disk", fix)
        if problem := config.values.gcs_path_problem(value):
            raise InputError(f"{option}: {problem}", fix)
        return
    path = check_output(option, value, directory=True)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{option} {value!r}: {existing} is not writable by this user", fix)


def write_json(path: str | None, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` (local or ``gs://``) when a path is given (a ``--report`` option)."""
    if path:
        storage.write_json(path, data)


def preflight_plan(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> tuple[Plan, list]:
    """The plan to check and its stages: the profile's, or the one ``--stage`` names (example stages too)."""
    profile, overrides = profile_and_overrides(args)
    spec = config.load_spec(profile, {**overrides, **(extra or {})})
    if args.stage:
        try:
            stage = spec.stage(args.stage)
        except KeyError as error:
            raise config.ConfigError([("--stage", str(error).strip("'\""))]) from None
        if stage not in spec.stages:  # an example stage: validate it against the slice shape now
            spec = config.load_spec(config.spec_to_data(spec.with_stages(stage)))
        plan = make_plan(spec)
        return plan, [plan.stage(args.stage)]
    plan = make_plan(spec)
    return plan, list(plan.stages)


def run_spec_of(run_dir: str) -> dict[str, Any] | None:
    """The run spec (as data) a run directory's plan reports hold, or None when it has none."""
    base = storage.path(storage.join(run_dir, "reports"))
    if not base.is_dir():
        return None
    for found in [base / reports.PlanReport.file_name, *sorted(base.glob(f"*/{reports.PlanReport.file_name}"))]:
        data = storage.read_json(str(found))
        if data is not None:
            return config.spec_to_data(reports.parse(reports.PlanReport, data).plan.spec)
    return None


def locate_run(args: argparse.Namespace) -> tuple[dict[str, Any] | None, identity.RunIdentity]:
    """The profile's spec for ``--run`` (None without ``--profile``) and where the run is: ``<output_dir>/<run>``.

    ``output_dir`` is ``--output-dir``, else the profile's.

    Raises:
        InputError: ``--run`` is not a run name (:func:`multislice.config.values.run_name_problem`), ``--output-dir``
            is not an output directory (:func:`multislice.config.values.output_dir_problem`: empty, ``gs://`` without
            a bucket...), or neither it nor the profile gives one.
    """
    if problem := config.values.run_name_problem(args.run or ""):
        raise InputError(f"--run {problem}", "give the run_name of the run (the last path part of its run directory)")
    check_output_dir("--output-dir", args.output_dir, "the run's output_dir")
    spec: dict[str, Any] | None = None
    if args.profile:
        profile, overrides = profile_and_overrides(args)
        spec = config.spec_to_data(config.load_spec(profile, {**overrides, "run_name": args.run}))
    output_dir = args.output_dir or (spec or {}).get("output_dir")
    if not output_dir:
        raise InputError("--output-dir is missing", "give --output-dir (the run's output_dir) or --profile")
    return spec, identity.run_identity(args.run, output_dir)


def print_request(request: submission.Request, headline: str) -> None:
    """Print what a ``--dry-run`` would have sent: the headline, the pipeline, the settings, every parameter."""
    print(f"dry run: {headline}; nothing was sent (no client built, no credentials read)")
    for note in request.notes:
        print(f"note: {note}")
    if request.template_bytes:
        print(f"pipeline: {request.pipeline}; compiled, {request.template_bytes:,} bytes")
    else:
        print(f"request: {request.pipeline}")
    for key, value in request.settings.items():
        shown = ", ".join(f"{k}={v}" for k, v in value.items()) if isinstance(value, dict) else value
        print(f"  {key + ':':<21} {shown}")
    if request.parameters:
        print(f"parameters ({len(request.parameters)}):")
        for name, value in request.parameters.items():
            print(f"  {name} = {value!r}")
