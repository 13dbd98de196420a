"""``multislice verify-checkpoint``: verify a stage's final checkpoint on this machine."""

from __future__ import annotations

import argparse
from typing import Any

from multislice import config, reports, storage, timings
from multislice.cli.common import check_output, profile_and_overrides, with_profile, write_json
from multislice.errors import InputError
from multislice.plan import Plan, make_plan

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "verify-checkpoint": "multislice verify-checkpoint output/runs/local-demo-20261201-030000/tiny-8b-recipe",
}


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice verify-checkpoint`` with its handler (``argv``: the command line)."""
    verify = sub.add_parser("verify-checkpoint", help="verify a stage's final checkpoint")
    verify.add_argument("path", help="a stage's checkpoint directory (<output>/<run>/<stage>/checkpoints)")
    with_profile(verify, required=False)
    verify.add_argument("--stage", help="stage name (with --profile)")
    verify.add_argument("--report", help="also write the JSON report here (a .json file)")
    verify.set_defaults(func=cmd_verify_checkpoint)


def _find_plan(checkpoint_dir: str) -> tuple[Plan, str]:
    """The plan and stage of ``<output>/<run>/<stage>/checkpoints``, from the run's plan report."""
    stage_dir = checkpoint_dir.rstrip("/").removesuffix("/checkpoints")
    run_dir, _, stage_name = stage_dir.rpartition("/")
    found = storage.read_json(reports.report_path(run_dir, reports.PlanReport.file_name, stage_name))
    if found is None:
        raise InputError(
            f"no plan report of stage {stage_name!r} in {run_dir}/reports",
            "give --profile and --stage (and the --set values of the run)",
        )
    return reports.parse(reports.PlanReport, found).plan, stage_name


def cmd_verify_checkpoint(args: argparse.Namespace) -> int:
    """Verify a stage's final checkpoint with the checkpoint verifier (trainer environment, this machine)."""
    from multislice.backends.local import verifier  # jsonschema and the CRDs (0.5 s): local runs only

    if problem := config.values.control_problem(args.path) or (
        args.path.startswith("gs://") and config.values.gcs_path_problem(args.path)
    ):
        raise InputError(f"checkpoint path: {problem}", "give a stage's directory or its checkpoints directory")
    if args.report:
        check_output("--report", args.report, directory=False, suffixes=(".json",))
    path = args.path.rstrip("/")
    checkpoint_dir = path if path.endswith("/checkpoints") or path == "checkpoints" else f"{path}/checkpoints"
    if not storage.path(checkpoint_dir).is_dir():
        raise InputError(
            f"no checkpoint directory at {checkpoint_dir}",
            "give a stage's directory (<output_dir>/<run_name>/<stage>) or its checkpoints directory",
        )
    if args.profile:
        profile, overrides = profile_and_overrides(args)
        plan = make_plan(config.load_spec(profile, overrides))
        stage_name = args.stage or plan.stages[0].name
    else:
        plan, stage_name = _find_plan(checkpoint_dir)
    try:
        stage = plan.stage(stage_name)
    except KeyError as error:
        raise config.ConfigError([("--stage", str(error).strip("'\""))]) from None
    wait = timings.timings_for(plan.spec, "local").verify_timeout
    status, report = verifier.run(stage, checkpoint_dir, wait)
    write_json(args.report, report.to_dict())
    for check in report.checks:
        print(f"{check.result} {check.name}: {check.detail}")
    skipped = [c.name for c in report.checks if c.skipped]
    print(
        f"verdict: {report.verdict}"
        + (f" ({report.error})" if report.error else "")
        + (f" (not checked: {', '.join(skipped)} SKIPPED)" if skipped else "")
    )
    return status
