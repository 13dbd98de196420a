"""``multislice``: render manifests, compile the pipeline, run it locally, verify a checkpoint.

Every command that takes a profile also takes ``--set key=value`` (repeatable):
keys are pipeline parameter names (``run_name``, ``num_slices``,
``stage1_steps``...) or dotted paths into the profile (``stages.0.ici.fsdp``);
values go through the same validation as in the pipeline, and a bad one stops
the command before anything is created.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import os
import re
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

from multislice import config
from multislice.config import parameters
from multislice.plan import Plan, make_plan

STEPS = "plan|preflight|provision|admit|launch|train|verify_checkpoint|cleanup"
PROGRESS = re.compile(rf"^\s*\[({STEPS})[ \]]|Executing task|finished with status")
ERROR_LINE = re.compile(
    r"^\s*([\w.]+\.)?[A-Z]\w*(Error|Failed|Exception|Invalid|Missing|Exists|Unavailable|Capacity)\b.*"
)


def _profile_and_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    return config.read_profile(args.profile), config.parse_set_arguments(args.set or [])


def cmd_render(args: argparse.Namespace) -> int:
    """Write every manifest of a profile, validated: Kueue objects, each stage's JobSet in both flavours and,
    for backend gke, the RBAC objects and the node pool plan (the GKE API requests provision would send)."""
    from multislice.render import manifests

    profile, overrides = _profile_and_overrides(args)
    plan = make_plan(config.load_spec(profile, overrides))
    written = manifests.write_manifests(plan, Path(args.output), pipeline_run_id=args.pipeline_run_id)
    for path in written:
        print(path)
    print(
        f"{len(written)} files written to {args.output}; the JobSet and Kueue objects validate against the "
        "JobSet v0.12.0 / Kueue v0.19.2 CRDs, the RBAC objects against their API's fields"
    )
    if plan.spec.backend == "gke":
        plan_file = Path(args.output) / manifests.NODE_POOL_PLAN
        print(f"node pools provision would create (GKE API requests, not sent): {plan_file}")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile the profile's pipeline to YAML (overrides become the parameters' defaults)."""
    from pipelines.multislice_training import compile_pipeline

    profile, overrides = _profile_and_overrides(args)
    data = config.spec_to_data(config.load_spec(profile, overrides))
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    kubernetes = None
    if args.node_selector:
        from multislice.delivery.targets import KubernetesConfig

        selector = config.parse_set_arguments(args.node_selector)
        kubernetes = KubernetesConfig(node_selector={str(k): str(v) for k, v in selector.items()})
    compile_pipeline(data, args.output, args.base_image, target=args.target, kubernetes=kubernetes)
    print(f"pipeline for profile {args.profile} compiled for {args.target} to {args.output}")
    return 0


class _ProgressTee(io.TextIOBase):
    """Write everything to a log file; echo progress lines to the terminal."""

    def __init__(self, log: io.TextIOBase, terminal: io.TextIOBase):
        self.log, self.terminal, self.pending = log, terminal, ""
        self.lines: list[str] = []

    def write(self, text: str) -> int:
        self.log.write(text)
        self.pending += text
        *complete, self.pending = self.pending.split("\n")
        for line in complete:
            plain = re.sub(r"\x1b\[[0-9;]*m", "", line)
            self.lines.append(plain)
            if PROGRESS.search(plain):
                self.terminal.write(plain.strip() + "\n")
                self.terminal.flush()
        return len(text)

    def flush(self) -> None:
        self.log.flush()


def run_arguments(spec: config.RunSpec) -> dict[str, Any]:
    """Pipeline arguments for a spec: every named parameter with the spec's value."""
    return {name: value for name, (_, value) in parameters.parameter_values(spec).items()}


def cmd_run(args: argparse.Namespace) -> int:
    """Compile the profile's pipeline and run the compiled YAML with kfp.local; print a summary."""
    started = time.monotonic()
    profile, overrides = _profile_and_overrides(args)
    if "run_name" not in overrides:
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        overrides["run_name"] = f"{profile.get('run_name', 'run')}-{stamp}"
    spec = config.load_spec(profile, overrides)
    if spec.backend == "local" and not os.path.isabs(spec.output_dir):
        spec = config.load_spec(profile, {**overrides, "output_dir": os.path.abspath(spec.output_dir)})
    plan = make_plan(spec)
    # The compiled pipeline, the full log and kfp.local's files stay on this machine: in the
    # run directory when it is local, else under build/runs/<run_name>.
    run_dir = Path(plan.run_dir) if "://" not in plan.run_dir else Path("build", "runs", spec.run_name).absolute()
    run_dir.mkdir(parents=True, exist_ok=True)

    from kfp import components, local

    from pipelines.multislice_training import compile_pipeline

    compiled = run_dir / "pipeline.yaml"
    compile_pipeline(config.spec_to_data(spec), str(compiled))
    pipeline = components.load_component_from_file(str(compiled))
    where = "emulated on this machine" if spec.backend == "local" else f"on backend {spec.backend}"
    print(f"run {spec.run_name}: {len(spec.stages)} stages on {spec.num_slices} x {spec.tpu_type} slices, {where}")
    print(f"compiled pipeline: {compiled}")
    print(f"full log: {run_dir / 'pipeline.log'}")
    # kfp.local ignores display names and runs components in this environment rather than their
    # image; both are expected here, so its warnings about them are noise.
    warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
    warnings.filterwarnings("ignore", message=".*non-Python base image.*")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(run_dir / "kfp"))
    failure = None
    with open(run_dir / "pipeline.log", "w", encoding="utf-8") as log:
        tee = _ProgressTee(log, sys.stdout)
        try:
            with contextlib.redirect_stdout(tee):
                pipeline(**run_arguments(spec))
        except KeyboardInterrupt:
            _stop_run(plan)
            print("interrupted: every JobSet of this run was deleted", file=sys.stderr)
            return 130
        except Exception as error:  # noqa: BLE001 - reported below with the failing step's own error
            failure = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
            _stop_run(plan)
    outcome = "FAILED" if failure else "SUCCEEDED"
    print("\n".join(summary_lines(plan, time.monotonic() - started, outcome, run_dir)))
    if failure:
        errors = [line.strip() for line in tee.lines if ERROR_LINE.match(line)]
        print(f"\nFAILED: {failure}", file=sys.stderr)
        if errors:
            print(f"cause: {errors[-1]}", file=sys.stderr)
        print(f"see {run_dir / 'pipeline.log'}", file=sys.stderr)
        return 1
    return 0


def _stop_run(plan: Plan) -> None:
    from multislice.backends.local import LocalBackend

    if plan.spec.backend != "local":
        return
    backend = LocalBackend(plan.run_dir)
    for state in backend.list_jobsets():
        if not state.terminal:
            backend.delete_jobset(state.name)


def _read(path: Path) -> dict[str, Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}


def summary_lines(plan: Plan, seconds: float, outcome: str, local_dir: Path) -> list[str]:
    """The run summary: per stage steps, loss, throughput, checkpoint, verification; where outputs live.

    ``local_dir`` holds this machine's files of the run (compiled pipeline, full log).
    """
    reports = Path(plan.run_dir) / "reports"
    lines = [f"run {plan.spec.run_name}: {outcome} in {seconds / 60:.1f} min"]
    for stage in plan.stages:
        checked = _read(reports / stage.name / "preflight.json")
        train = _read(reports / stage.name / "train.json")
        verify = _read(reports / stage.name / "verification.json")
        lines.append(f"stage {stage.index + 1} {stage.name} ({stage.model_label}):")
        if checked.get("verdict") == "fits":
            hbm = checked["bytes_per_chip"]["total"]
            lines.append(
                f"  preflight     fits: {hbm / 2**20:,.1f} MiB of {checked['hbm_bytes_per_chip'] / 2**30:.2f} GiB HBM "
                f"per chip on {checked['target']['num_slices']} x {checked['target']['tpu_type']} (AOT compile)"
            )
        elif checked.get("verdict"):
            lines.append(f"  preflight     {checked['verdict']}")
        if train.get("skipped"):
            lines.append("  trained       nothing: its final checkpoint already existed")
        elif "final_loss" in train:
            lines.append(
                f"  trained       {train['steps_trained']}/{stage.steps} steps, loss {train['first_loss']:.3f} -> "
                f"{train['final_loss']:.3f}, {train['tokens_per_second_per_device']:.1f} tokens/s per device, "
                f"{train['restarts']} JobSet restarts"
            )
        else:
            lines.append("  trained       not completed")
        if verify.get("latest_step") is not None:
            lines.append(
                f"  checkpoint    step {verify['latest_step']} at {stage.checkpoint_dir}/{verify['latest_step']}"
            )
        mesh = ", ".join(f"{k}={v}" for k, v in verify.get("written_mesh", {}).items())
        dcn = ", ".join(f"{k}={v}" for k, v in stage.dcn.items() if v != 1)
        passed = sum(c["passed"] for c in verify.get("checks", []))
        lines.append(
            f"  verification  {verify['verdict']} ({passed}/{len(verify.get('checks', []))} checks, "
            f"{verify.get('parameter_count', 0):,} parameters, sharded over mesh {mesh}; DCN {dcn})"
            if verify.get("verdict")
            else "  verification  not run"
        )
    lines += [
        f"outputs     {plan.run_dir}",
        f"reports     {reports}/<stage>/(plan|preflight|admit|launch|train|verification).json",
        f"UI pages    {reports}/<stage>/preflight.html (HBM per chip), train.html (loss and step-time plots), "
        "train.md, verification.md",
        f"pod logs    {plan.run_dir}/jobsets/<jobset>/pods/<pod>.attempt-<N>.log",
        f"manifests   {plan.run_dir}/manifests/",
        f"pipeline    {local_dir}/pipeline.yaml (compiled), {local_dir}/pipeline.log (full log)",
    ]
    return lines


def _find_plan(checkpoint_path: Path) -> tuple[Plan, str]:
    stage_dir = checkpoint_path if checkpoint_path.name != "checkpoints" else checkpoint_path.parent
    plan_file = stage_dir.parent / "reports" / stage_dir.name / "plan.json"
    if not plan_file.exists():
        raise config.ConfigError(
            [("PATH", f"no plan found at {plan_file}; give --profile and --stage (and the --set values of the run)")]
        )
    return Plan.model_validate(json.loads(plan_file.read_text(encoding="utf-8"))["plan"]), stage_dir.name


def cmd_verify_checkpoint(args: argparse.Namespace) -> int:
    """Verify a stage's final checkpoint with the checkpoint verifier (trainer environment)."""
    from multislice.steps.verify_checkpoint import run_verifier

    if args.profile:
        profile, overrides = _profile_and_overrides(args)
        plan = make_plan(config.load_spec(profile, overrides))
        stage_name = args.stage or plan.stages[0].name
    else:
        plan, stage_name = _find_plan(Path(args.path))
    checkpoint_dir = args.path if Path(args.path).name == "checkpoints" else str(Path(args.path) / "checkpoints")
    with tempfile.TemporaryDirectory() as tmp:
        report_file = Path(args.report) if args.report else Path(tmp) / "verification.json"
        status, report = run_verifier(plan.stage(stage_name), checkpoint_dir, report_file)
    for check in report.get("checks", []):
        print(f"{'PASS' if check['passed'] else 'FAIL'} {check['name']}: {check['detail']}")
    print(f"verdict: {report['verdict']}" + (f" ({report['error']})" if "error" in report else ""))
    return status


def _preflight_plan(args: argparse.Namespace, extra: dict[str, Any] | None = None) -> tuple[Plan, list]:
    """The plan to check and its stages: the profile's, or the one ``--stage`` names (example stages too)."""
    profile, overrides = _profile_and_overrides(args)
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


def cmd_preflight(args: argparse.Namespace) -> int:
    """AOT-compile the profile's stages for the target topology; exit 1 when one does not fit."""
    from multislice import preflight
    from multislice.preflight import user_cache_dir
    from multislice.steps import preflight as step

    extra: dict[str, Any] = {"preflight.skip": False, "preflight.suggest_alternative": not args.no_alternative}
    if args.cache_dir or not config.read_profile(args.profile).get("preflight", {}).get("cache_dir"):
        extra["preflight.cache_dir"] = args.cache_dir or user_cache_dir()
    plan, stages = _preflight_plan(args, extra)
    try:
        reports = step.run(plan, stages)
    except preflight.PreflightFailed as error:
        print(f"\n{error}", file=sys.stderr)
        _write_json(args.report, {"verdict": "does_not_fit", "stages": error.reports})
        return 1
    _write_json(args.report, {"verdict": "fits", "stages": list(reports.values())})
    print(f"preflight: all {len(reports)} stage(s) fit on {plan.spec.num_slices} x {plan.spec.tpu_type}")
    return 0


def _write_json(path: str | None, data: Any) -> None:
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(data, indent=1, default=str), encoding="utf-8")


def cmd_plan(args: argparse.Namespace) -> int:
    """Search fitting configs for a stage; prints them ranked, or the fewest slices that fit, or that none do."""
    from multislice.preflight import AotSession, planner, user_cache_dir

    plan, stages = _preflight_plan(args)
    spec, stage = plan.spec, plan.spec.stage(stages[0].name)
    updates: dict[str, Any] = {}
    if args.model:
        updates["model"] = config.ModelSpec(name=args.model)
    if args.seq:
        updates["max_target_length"] = args.seq
    stage = stage.model_copy(update=updates)
    spec = spec.model_copy(
        update={k: v for k, v in (("tpu_type", args.tpu_type), ("num_slices", args.num_slices)) if v}
    )
    spec = config.load_spec(config.spec_to_data(spec.with_stages(stage)), {"stages.0.dcn": {}, "stages.0.ici": {}})
    stage = spec.stages[0]
    fixed = dict(config.parse_set_arguments(args.fix or []))
    cache = args.cache_dir or spec.preflight.cache_dir or user_cache_dir()
    work = Path(args.work_dir or Path("build", "plan", stage.name)).absolute()
    print(
        f"planning {stage.model.label}, sequence {stage.max_target_length}, on {spec.num_slices}..{args.max_slices} x "
        f"{spec.tpu_type} ({spec.slice_type.usable_hbm_bytes_per_chip / 2**30:.2f} GiB usable HBM per chip); "
        f"verdict cache {cache}"
    )
    with AotSession(cache, work) as session:
        found = planner.search(
            spec,
            stage,
            session,
            max_slices=args.max_slices,
            global_batch=args.global_batch,
            fixed=fixed,
            want=args.want,
            budget_seconds=args.budget,
        )
    _write_json(args.report, found.as_dict())
    if found.fitting:
        extra = "" if found.fewest_slices == spec.num_slices else f" (none on {spec.num_slices}: fewest that fit)"
        print(
            f"\n{len(found.fitting)} AOT-verified fitting config(s) on {found.fewest_slices} slices{extra}, best first:"
        )
        for rank, c in enumerate(found.fitting, 1):
            print(
                f"  {rank}. {c.describe()}: {c.report['bytes_per_chip']['total'] / 2**30:.2f} GiB per chip, "
                f"estimated MFU {c.estimated_mfu:.0%}, {c.tokens_per_step_per_chip:g} tokens per step per chip"
            )
        print(f"searched in {found.seconds:.0f} s")
        return 0
    if found.exhausted:
        print(
            f"\nnothing fits: no config of {stage.model.label} fits on "
            f"{found.slices_tried[0]}..{found.slices_tried[-1]} x {spec.tpu_type} "
            f"({sum(found.pruned.values())} candidates ruled out by the memory lower bound, "
            f"{len(found.tried)} by AOT compile). Use a TPU type with more HBM per chip, or more slices."
        )
    else:
        print(f"\nno fitting config verified within the {args.budget:.0f} s budget; raise --budget")
    return 1


def cmd_submit(args: argparse.Namespace) -> int:
    """Validate, compile and submit one run to Vertex AI Pipelines or KFP (:mod:`multislice.delivery.submission`)."""
    from multislice.delivery import submission

    profile, overrides = _profile_and_overrides(args)
    run = submission.submit(profile, overrides, target=args.target, **submission.targets_from_args(args))
    print(f"submitted run {run.run_name} to {run.target}: {run.run_id}")
    for name, value in run.parameters.items():
        print(f"  {name} = {value!r}")
    return 0


def cmd_schedule(args: argparse.Namespace) -> int:
    """Create, list, pause, resume or delete schedules (:mod:`multislice.delivery.schedule`)."""
    from multislice.delivery import schedule, submission

    where = submission.targets_from_args(args)
    if args.action == "create":
        missing = [(f"--{n}", "required by `schedule create`") for n in ("profile", "cron") if not getattr(args, n)]
        if missing:
            raise config.ConfigError(missing)
        profile, overrides = _profile_and_overrides(args)
        made = schedule.create(
            profile, overrides, target=args.target, cron=args.cron, timezone=args.timezone, name=args.name,
            max_concurrent_runs=args.max_concurrent_runs, allow_queueing=args.allow_queueing,
            max_runs=args.max_runs, continue_run=args.continue_run, **where,
        )  # fmt: skip
        print(f"schedule {made.name} created on {made.target}: {made.schedule_id}, cron {made.cron!r}")
        next_times = schedule.Cron.parse(args.cron, args.timezone).next_times()
        print("next runs: " + ", ".join(t.isoformat() for t in next_times))
    elif args.action == "list":
        for found in schedule.list_schedules(args.target, **where):
            print(f"{found.schedule_id}\t{found.name}\t{found.cron}\t{found.state}")
    else:
        if not args.schedule_id:
            raise config.ConfigError([("SCHEDULE_ID", f"`schedule {args.action}` needs the schedule's ID (see list)")])
        schedule.change(args.action, args.schedule_id, args.target, **where)
        print(f"schedule {args.schedule_id}: {args.action} sent")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``multislice`` argument parser."""
    parser = argparse.ArgumentParser(prog="multislice", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    def with_profile(p: argparse.ArgumentParser, required: bool = True) -> None:
        p.add_argument("--profile", required=required, help="profile name in configs/ or a path to a .yaml")
        p.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a parameter or field (repeatable)")

    render = sub.add_parser("render", help="write every manifest of a profile (dry run; no cluster needed)")
    with_profile(render)
    render.add_argument("--output", required=True, help="directory to write the YAML files to")
    render.add_argument("--pipeline-run-id", default="manual", help="value of the pipeline/runid label")
    render.set_defaults(func=cmd_render)

    comp = sub.add_parser("compile", help="compile the profile's pipeline to YAML")
    with_profile(comp)
    comp.add_argument("--output", required=True, help="YAML file to write")
    comp.add_argument("--base-image", help="image of the pipeline components (default: the profile's images.pipeline)")
    comp.add_argument(
        "--target",
        choices=["kfp", "vertex"],
        default="kfp",
        help="kfp: with kfp-kubernetes platform config (2 YAML documents); vertex: one document",
    )
    comp.add_argument(
        "--node-selector",
        action="append",
        metavar="KEY=VALUE",
        help="kfp target: node label the component pods must match (repeatable)",
    )
    comp.set_defaults(func=cmd_compile)

    run = sub.add_parser("run", help="run the pipeline locally with kfp.local (what `make run` does)")
    with_profile(run)
    run.set_defaults(func=cmd_run)

    pre = sub.add_parser("preflight", help="AOT-compile each stage for the TPU topology: does it fit in HBM?")
    with_profile(pre)
    pre.add_argument("--stage", help="check only this stage (or example stage, e.g. seed-llama3-70b)")
    pre.add_argument(
        "--cache-dir",
        help="verdict cache (default: the profile's preflight.cache_dir, else ~/.cache/multislice-pipelines)",
    )
    pre.add_argument("--no-alternative", action="store_true", help="do not search a fitting alternative")
    pre.add_argument("--report", help="also write the JSON report here")
    pre.set_defaults(func=cmd_preflight)

    pln = sub.add_parser("plan", help="search AOT-verified configs that fit in HBM, ranked by estimated speed")
    with_profile(pln)
    pln.add_argument("--stage", help="the stage to start from (default: the first)")
    pln.add_argument("--model", help="MaxText model_name instead of the stage's (e.g. llama3-70b)")
    pln.add_argument("--tpu-type", help="slice type instead of the profile's (e.g. v6e-16)")
    pln.add_argument("--num-slices", type=int, help="slice count to start from (default: the profile's)")
    pln.add_argument("--max-slices", type=int, default=8, help="most slices to try when fewer do not fit")
    pln.add_argument("--seq", type=int, help="sequence length (max_target_length)")
    pln.add_argument("--global-batch", type=int, help="fix sequences per step across all chips")
    pln.add_argument(
        "--fix", action="append", metavar="KNOB=VALUE", help="do not vary a knob (e.g. weight_dtype=float32)"
    )
    pln.add_argument("--want", type=int, default=3, help="fitting configs to verify")
    pln.add_argument("--budget", type=float, default=540, help="seconds of compiling to spend")
    pln.add_argument("--cache-dir", help="verdict cache (default: as for preflight)")
    pln.add_argument("--work-dir", help="scratch directory (default build/plan/<stage>)")
    pln.add_argument("--report", help="also write the JSON result here")
    pln.set_defaults(func=cmd_plan)

    verify = sub.add_parser("verify-checkpoint", help="verify a stage's final checkpoint")
    verify.add_argument("path", help="a stage's checkpoint directory (<output>/<run>/<stage>/checkpoints)")
    with_profile(verify, required=False)
    verify.add_argument("--stage", help="stage name (with --profile)")
    verify.add_argument("--report", help="also write the JSON report here")
    verify.set_defaults(func=cmd_verify_checkpoint)
    _add_delivery_commands(sub, with_profile)
    return parser


def _add_delivery_commands(sub: Any, with_profile: Any) -> None:
    from multislice.delivery.submission import add_target_arguments

    submit = sub.add_parser("submit", help="submit one run to Vertex AI Pipelines or a KFP endpoint")
    with_profile(submit)
    add_target_arguments(submit)
    submit.set_defaults(func=cmd_submit)

    sched = sub.add_parser("schedule", help="recurring runs: create, list, pause, resume, delete")
    sched.add_argument("action", choices=["create", "list", "pause", "resume", "delete"])
    sched.add_argument("schedule_id", nargs="?", help="the schedule's ID (pause, resume, delete)")
    with_profile(sched, required=False)
    add_target_arguments(sched)
    sched.add_argument("--cron", help="5 fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * *'")
    sched.add_argument("--timezone", help="IANA time zone of --cron (Vertex only; KFP schedules in UTC)")
    sched.add_argument("--name", help="display name (default <run_name>-schedule)")
    sched.add_argument("--max-concurrent-runs", type=int, default=1, help="runs of this schedule at once (default 1)")
    sched.add_argument("--allow-queueing", action="store_true", help="a run due at the limit waits, not skipped")
    sched.add_argument("--max-runs", type=int, help="stop after this many runs (Vertex only)")
    sched.add_argument(
        "--continue-run",
        action="store_true",
        help="every run continues the same run_name (one long training run) instead of a new one",
    )
    sched.set_defaults(func=cmd_schedule)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status. Config errors exit 2 with every bad field named."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except config.ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
