"""``multislice cleanup``: remove what a crashed or cancelled run left (its JobSets and pods)."""

from __future__ import annotations

import argparse
from typing import Any

from multislice import backends, config, storage
from multislice.cli.common import locate_run, run_spec_of, with_profile
from multislice.errors import InputError

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "cleanup": "multislice cleanup --run local-demo-20261201-030000 --profile local",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice cleanup`` with its handler (``argv``: the command line)."""
    clean = sub.add_parser("cleanup", help="remove what a crashed or cancelled run left (its JobSets and pods)")
    clean.add_argument("--run", required=True, help="the run's run_name")
    clean.add_argument("--output-dir", help="the run's output_dir (default: the profile's)")
    with_profile(clean, required=False)
    clean.add_argument("--pipeline-run-id", help="only what this pipeline run created (its pipeline/runid label)")
    clean.set_defaults(func=cmd_cleanup)


def cmd_cleanup(args: argparse.Namespace) -> int:
    """Remove what a crashed or cancelled run left: its unfinished JobSets (local: their supervisors and pods).

    The run is found as the pipeline's cleanup step finds it: ``<output_dir>/<run_name>``, with
    ``output_dir`` from ``--output-dir``, else the profile's. Its backend, namespace and cluster come
    from ``--profile``, else from the run's plan report, else local. Deleted: what is still going of
    every pipeline run of that run name whose owner is gone (:meth:`Backend.delete_abandoned`): locally
    the run directory's JobSets except the live owner's (``multislice run`` still holding the
    directory, :mod:`multislice.ownership`); on GKE what carries the run's name label
    (``multislice-pipelines/run-name``) except workloads whose Lease is still renewed, JobSets not
    Completed and unfinished Jobs; with ``--pipeline-run-id``, only that run's. What is kept is printed.
    """
    if args.pipeline_run_id is not None and (problem := config.values.pipeline_run_id_problem(args.pipeline_run_id)):
        raise InputError(
            f"--pipeline-run-id: {problem}",
            "give the pipeline run id its workloads carry (label pipeline/runid, e.g. from `kubectl get jobsets "
            "--show-labels`), or leave --pipeline-run-id out to clean up every abandoned run of --run",
        )
    spec, found = locate_run(args)  # --run and --output-dir checked first
    spec = spec or run_spec_of(found.run_dir)
    backend_name = (spec or {}).get("backend", "local")
    if backend_name == "local" and not storage.path(found.run_dir).is_dir():
        raise InputError(
            f"--run {args.run}: no run directory {found.run_dir}",
            "check --run and --output-dir (runs are <output_dir>/<run_name>)",
        )
    backend = backends.create(
        backend_name, run_dir=found.run_dir, namespace=(spec or {}).get("namespace", "default"),
        cluster=(spec or {}).get("cluster"), say=print,
    )  # fmt: skip
    removed, kept = backend.delete_abandoned(args.run, lambda line: None, args.pipeline_run_id or "")
    for line in removed:
        print(f"removed {line}")
    for line in kept:
        print(f"kept {line}")
    if not removed and not kept:
        print(f"run {args.run} ({backend_name}, {found.run_dir}): nothing left")
    return 0
