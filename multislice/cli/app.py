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
import io
import math
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from multislice import backends, config, identity, names, ownership, preflight, reports, storage, timings, tpu
from multislice.cli import calls
from multislice.config import parameters
from multislice.config.values import INT32_MAX, MAX_TIMEOUT_SECONDS
from multislice.delivery import images, schedule, submission
from multislice.delivery.submission import add_target_arguments
from multislice.delivery.targets import KubernetesConfig
from multislice.errors import InputError, UserError, expected_error
from multislice.plan import Plan, make_plan
from multislice.preflight import planner, user_cache_dir
from multislice.steps import preflight as preflight_step

STEPS = "plan|preflight|provision|admit|launch|train|verify_checkpoint|export|cleanup"
PROGRESS = re.compile(rf"^\s*\[({STEPS})[ \]]|Executing task|finished with status")
ERROR_LINE = re.compile(
    r"^\s*([\w.]+\.)?[A-Z]\w*(Error|Failed|Exception|Invalid|Missing|Exists|Unavailable|Capacity)\b.*"
)


def _profile_and_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    return config.read_profile(args.profile), config.parse_set_arguments(args.set or [])


def _check_output(option: str, value: str, *, directory: bool, suffixes: tuple[str, ...] = ()) -> Path:
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


def cmd_render(args: argparse.Namespace) -> int:
    """Write every manifest of a profile, validated: Kueue objects, each stage's JobSet for TPU and CPU and,
    for backend gke, the RBAC objects and the node pool plan (the GKE API requests provision would send)."""
    from multislice.backends import manifests  # jsonschema and the CRDs: only for render (0.6 s)

    _check_output("--output", args.output, directory=True)
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
        from multislice.backends.gke import nodepool  # the GKE clients (2-3 s): only for a gke profile

        accounts = plan.spec.service_accounts
        writer = (
            f"the trainer's Google service account {accounts.trainer_gcp_service_account} (Workload Identity, "
            "no hostNetwork)"
            if accounts.tpu_workload_identity
            else "the TPU nodes' service account (hostNetwork pods get no Workload Identity), with the nodes' "
            f"scopes {', '.join(plan.spec.node_pools.oauth_scopes)}"
        )
        print(f"TPU pods write {plan.spec.output_dir} as {writer}; IAM bindings it needs (not applied):")
        for line in nodepool.iam_bindings(plan):
            print(f"  {line}")
    return 0


def cmd_compile(args: argparse.Namespace) -> int:
    """Compile the profile's pipeline to YAML (overrides become the parameters' defaults)."""
    from pipelines.multislice_training import compile_pipeline  # kfp (2-5 s): only for the verbs that compile

    _check_output("--output", args.output, directory=False, suffixes=(".yaml", ".yml"))
    if args.base_image and (problem := config.values.image_problem(args.base_image)):
        raise InputError(f"--base-image: {problem}", "give a container image reference")
    profile, overrides = _profile_and_overrides(args)
    built = images.built_references(args.images)
    if "trainer" in built and not any(k in overrides for k in ("trainer_image", "images.trainer")):
        overrides["images.trainer"] = built["trainer"]
        print(f"trainer image (by digest, from {args.images}): {built['trainer']}")
    if "pipeline" in built and not args.base_image:
        args.base_image = built["pipeline"]
        print(f"pipeline image (by digest, from {args.images}): {built['pipeline']}")
    data = config.spec_to_data(config.load_spec(profile, overrides))
    kubernetes = None
    if args.node_selector:
        selector = _node_selector(args.node_selector)
        kubernetes = KubernetesConfig(node_selector=selector)
    Path(args.output).parent.mkdir(parents=True, exist_ok=True)
    compile_pipeline(data, args.output, args.base_image, target=args.target, kubernetes=kubernetes)
    print(f"pipeline for profile {args.profile} compiled for {args.target} to {args.output}")
    return 0


def _node_selector(pairs: list[str]) -> dict[str, str]:
    """``--node-selector KEY=VALUE`` pairs as a node selector: Kubernetes label keys and values, as written.

    Raises:
        ConfigError: a pair without ``=``, or a key or value that is not a valid label key or value.
    """
    selector: dict[str, str] = {}
    issues = []
    for pair in pairs:
        key, sep, value = pair.partition("=")
        problem = (
            f"{pair!r} is not KEY=VALUE" if not sep else config.values.label_key_problem(key)
        ) or config.values.label_value_problem(value)
        if problem:
            issues.append(("--node-selector", f"{problem}; e.g. --node-selector cloud.google.com/gke-nodepool=cpu"))
        selector[key] = value
    if issues:
        raise config.ConfigError(issues)
    return selector


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
    run_name = overrides.get("run_name") or identity.timestamped_run_name(str(profile.get("run_name", "run")))
    found = identity.run_identity(str(run_name), str(overrides.get("output_dir", profile.get("output_dir", ""))))
    overrides.update(run_name=found.run_name, output_dir=found.output_dir)
    spec = config.load_spec(profile, overrides)
    plan = make_plan(spec)
    for followed in config.followed_checkpoint_periods(profile, overrides):
        print(followed.describe())
    # The compiled pipeline, the full log and kfp.local's files stay on this machine: in the
    # run directory when it is local, else under build/runs/<run_name>. Each run's own files are
    # named by its run id, and the run directory is claimed first: a run directory another live
    # run owns is refused here, before anything is written (multislice.ownership).
    local = not storage.is_remote(plan.run_dir)
    run_dir = Path(plan.run_dir) if local else Path("build", "runs", spec.run_name).absolute()
    run_id = ownership.new_run_id()
    with ownership.claim(plan.run_dir, run_id) as claim:
        os.environ[ownership.ENV_CLAIM] = run_id  # the plan step records its pipeline run id in the owner record
        try:
            return _run_owned(spec, plan, run_dir, run_id, claim, started)
        finally:
            os.environ.pop(ownership.ENV_CLAIM, None)


def _run_owned(
    spec: config.RunSpec, plan: Plan, run_dir: Path, run_id: str, claim: ownership.Claim, started: float
) -> int:
    """``multislice run`` once its run directory is claimed: compile, run with kfp.local, summarise."""
    run_dir.mkdir(parents=True, exist_ok=True)

    from kfp import components, local  # kfp (2-5 s): only for the verbs that compile

    from pipelines.multislice_training import compile_pipeline  # kfp (2-5 s): only for the verbs that compile

    compiled, log_path = run_files(run_dir, run_id)
    compile_pipeline(config.spec_to_data(spec), str(compiled), remote=False, retries=False)  # a local failure is final
    pipeline = components.load_component_from_file(str(compiled))
    where = "emulated on this machine" if spec.backend == "local" else f"on backend {spec.backend}"
    print(f"run {spec.run_name}: {len(spec.stages)} stages on {spec.num_slices} x {spec.tpu_type} slices, {where}")
    print(f"compiled pipeline: {compiled}")
    print(f"full log: {log_path}")
    # kfp.local ignores display names and runs components in this environment rather than their
    # image; both are expected here, so its warnings about them are noise.
    warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
    warnings.filterwarnings("ignore", message=".*non-Python base image.*")
    local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(run_dir / "kfp"))
    failure = None
    with open(log_path, "x", encoding="utf-8") as log:  # "x": never another run's log
        tee = _ProgressTee(log, sys.stdout)
        try:
            with contextlib.redirect_stdout(tee), _cancelling_children():
                pipeline(**run_arguments(spec))
        except KeyboardInterrupt:
            stopped = _stop_run(plan, claim.pipeline_run_id)
            print(f"interrupted: {stopped}", file=sys.stderr)
            return 130
        except Exception as error:  # noqa: BLE001 - reported below with the failing step's own error
            failure = re.sub(r"\x1b\[[0-9;]*m", "", str(error))
            _stop_run(plan, claim.pipeline_run_id)
    outcome = "FAILED" if failure else "SUCCEEDED"
    print("\n".join(summary_lines(plan, time.monotonic() - started, outcome, run_dir, run_id)))
    if failure:
        errors = [i for i, line in enumerate(tee.lines) if ERROR_LINE.match(line)]
        print(f"\nFAILED: {failure}", file=sys.stderr)
        if errors:
            print(f"cause: {tee.lines[errors[-1]].strip()}", file=sys.stderr)
            after = tee.lines[errors[-1] + 1].strip() if errors[-1] + 1 < len(tee.lines) else ""
            if after.startswith("fix: "):
                print(after, file=sys.stderr)
        print(f"see {log_path}", file=sys.stderr)
        return 1
    return 0


def run_files(local_dir: Path, run_id: str) -> tuple[Path, Path]:
    """``(compiled pipeline, full log)`` of run ``run_id``: ``pipeline.<run id>.yaml`` and ``pipeline.<run id>.log``
    in ``local_dir``, so that a rerun of the same run_name (which resumes it) keeps the earlier run's."""
    return local_dir / f"pipeline.{run_id}.yaml", local_dir / f"pipeline.{run_id}.log"


def child_pids(pid: int) -> list[int]:
    """The direct children of a process (Linux ``/proc/<pid>/task/<tid>/children``)."""
    children: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return children


@contextlib.contextmanager
def _cancelling_children():
    """SIGTERM to ``multislice run`` is passed on to the step it is running, then ends the run as Ctrl-C does.

    A terminal's Ctrl-C reaches the whole foreground process group, the step
    processes kfp.local starts included; a SIGTERM (``kill``, a process
    manager, a CI timeout) reaches this process alone. Passing it on lets the
    running step cancel itself (:mod:`multislice.cancel`: it deletes what it
    created) instead of being orphaned.
    """

    def forward(signum: int, frame: object) -> None:
        for child in child_pids(os.getpid()):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signum)
        raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")

    previous = signal.signal(signal.SIGTERM, forward)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def _stop_run(plan: Plan, pipeline_run_id: str) -> str:
    """After an interrupted or failed local run: stop this pipeline run's JobSets that are still going.

    Only what carries ``pipeline_run_id`` (and was recorded as its own: :meth:`LocalBackend.cleanup`) is
    touched; without one (the plan step never ran) nothing was created. Returns what was done, in words.
    """
    if plan.spec.backend != "local" or not pipeline_run_id:
        return "nothing of this run was left running"
    from multislice.backends.local import LocalBackend  # jsonschema and the CRDs (0.5 s): local runs only

    deleted, _ = LocalBackend(plan.run_dir).cleanup(pipeline_run_id, lambda line: None)
    return f"deleted {', '.join(deleted)} (pipeline run {pipeline_run_id})" if deleted else (
        f"nothing of pipeline run {pipeline_run_id} was left running")  # fmt: skip


def elastic_lines(train: reports.TrainReport) -> list[str]:
    """An elastic stage's story for the summary: each resize (when, why, from and to, steps lost) and goodput.

    Empty for a stage that never resized and reports no goodput. Times are seconds since training began
    (:class:`multislice.elastic.Resize`); goodput is productive step time over wall time, 0-1.
    """
    lines = []
    for resize in train.resizes:
        resumed = (
            f"resumed from step {resize.resumed_from_step} at {resize.resumed_at_seconds:.0f} s"
            if resize.resumed_at_seconds is not None and resize.resumed_from_step is not None
            else "not resumed"
        )
        lines.append(
            f"  resized       at {resize.detected_at_seconds:.0f} s: {resize.from_slices} -> {resize.to_slices} "
            f"slices ({resize.cause}); {resumed}, {resize.steps_lost} steps lost"
        )
    if train.goodput is not None:
        lost = f", {train.steps_lost} steps trained again" if train.steps_lost else ""
        lines.append(f"  goodput       {train.goodput:.2f} (productive step time / wall time{lost})")
    return lines


def summary_lines(plan: Plan, seconds: float, outcome: str, local_dir: Path, run_id: str) -> list[str]:
    """The run summary: per stage steps, loss, throughput, checkpoint, verification; where outputs live.

    Read from the steps' reports in the run directory (local or ``gs://``);
    ``local_dir`` holds this machine's files of run ``run_id`` (compiled pipeline, full log: :func:`run_files`).
    """
    reports_dir = storage.join(plan.run_dir, "reports")
    compiled, log = run_files(local_dir, run_id)
    lines = [f"run {plan.spec.run_name}: {outcome} in {seconds / 60:.1f} min"]
    for stage in plan.stages:
        checked = reports.read(reports.PreflightReport, plan, stage)
        train = reports.read(reports.TrainReport, plan, stage)
        verify = reports.read(reports.VerificationReport, plan, stage)
        lines.append(f"stage {stage.index + 1} {stage.name} ({stage.model_label}):")
        prepared = reports.read(reports.PrepareDataReport, plan, stage)
        if prepared and not prepared.skipped:
            manifest = prepared.manifest
            lines.append(
                f"  data          {manifest.get('token_count', 0):,} tokens in {manifest.get('shard_count')} shards "
                f"({'reused' if prepared.reused else 'tokenized'} in {prepared.seconds} s) at {prepared.uri}"
            )
        if checked and checked.verdict == "fits":
            hbm = checked.bytes_per_chip.total
            lines.append(
                f"  preflight     fits: {hbm / 2**20:,.1f} MiB of {checked.hbm_bytes_per_chip / 2**30:.2f} GiB HBM "
                f"per chip on {checked.target.num_slices} x {checked.target.tpu_type} (AOT compile)"
            )
        elif checked:
            lines.append(f"  preflight     {checked.verdict}")
        if train and train.skipped:
            lines.append("  trained       nothing: its final checkpoint already existed")
        elif train and train.final_loss is not None:
            lines.append(
                f"  trained       {train.steps_trained}/{stage.steps} steps, loss {train.first_loss:.3f} -> "
                f"{train.final_loss:.3f}, {train.tokens_per_second_per_device:.1f} tokens/s per device, "
                + (
                    f"{train.restarts} Ray Train retries (launcher ray)"
                    if train.launcher == "ray"
                    else f"{train.restarts} JobSet restarts"
                )
            )
            lines.extend(f"  restart {n:<5} {cause}" for n, cause in enumerate(train.restart_causes, 1))
            lines.extend(elastic_lines(train))
            if train.evals:
                lines.append(
                    f"  eval          loss {train.first_eval_loss:.3f} -> {train.final_eval_loss:.3f} "
                    f"(perplexity {train.final_eval_perplexity:.1f}) over {train.evals} evals"
                )
        else:
            lines.append("  trained       not completed")
        if verify and verify.latest_step is not None:
            lines.append(f"  checkpoint    step {verify.latest_step} at {stage.checkpoint_dir}/{verify.latest_step}")
        if verify:
            written = verify.written_mesh or {}
            mesh = ", ".join(f"{k}={v}" for k, v in written.items()) if isinstance(written, dict) else written
            dcn = ", ".join(f"{k}={v}" for k, v in stage.dcn.items() if v != 1) or "none, one slice"
            passed = sum(c.passed for c in verify.checks)
            lines.append(
                f"  verification  {verify.verdict} ({passed}/{len(verify.checks)} checks, "
                f"{verify.parameter_count or 0:,} parameters, sharded over mesh {mesh}; DCN {dcn})"
            )
        else:
            lines.append("  verification  not run")
        if stage.export:
            exported = reports.read(reports.ExportReport, plan, stage)
            if exported and exported.logits_check:
                check = exported.logits_check
                loaders = check.get("loaders") or {"transformers": check}
                diffs = ", ".join(
                    f"{loader.get('transformers_version') or name} {loader.get('max_abs_diff', float('nan')):.2g}"
                    for name, loader in loaders.items()
                )
                dtype = f" ({exported.dtype})" if exported.dtype else ""
                lines.append(
                    f"  export        {exported.verdict}: {stage.export}{dtype} at {exported.export_dir}; logits vs "
                    f"MaxText's max |diff| by loader: {diffs} "
                    f"(tolerance {check.get('atol')} + {check.get('rtol')} x |logit|)"
                )
            else:
                lines.append(f"  export        {exported.verdict if exported else 'not run'}")
    lines += [
        f"outputs     {plan.run_dir}",
        f"reports     {reports_dir}/<stage>/(plan|prepare_data|preflight|admit|launch|train|verification).json",
        f"UI pages    {reports_dir}/<stage>/preflight.html (HBM per chip), train.html (loss and step-time plots), "
        "train.md, verification.md",
        f"pod logs    {backends.backend_class(plan.spec.backend).where_logs_are(plan)}",
        f"manifests   {plan.run_dir}/manifests/",
        f"pipeline    {compiled} (compiled), {log} (full log)",
    ]
    return lines


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
        _check_output("--report", args.report, directory=False, suffixes=(".json",))
    path = args.path.rstrip("/")
    checkpoint_dir = path if path.endswith("/checkpoints") or path == "checkpoints" else f"{path}/checkpoints"
    if not storage.path(checkpoint_dir).is_dir():
        raise InputError(
            f"no checkpoint directory at {checkpoint_dir}",
            "give a stage's directory (<output_dir>/<run_name>/<stage>) or its checkpoints directory",
        )
    if args.profile:
        profile, overrides = _profile_and_overrides(args)
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
    _write_json(args.report, report.to_dict())
    for check in report.checks:
        print(f"{'PASS' if check.passed else 'FAIL'} {check.name}: {check.detail}")
    print(f"verdict: {report.verdict}" + (f" ({report.error})" if report.error else ""))
    return status


def _run_spec_of(run_dir: str) -> dict[str, Any] | None:
    """The run spec (as data) a run directory's plan reports hold, or None when it has none."""
    base = storage.path(storage.join(run_dir, "reports"))
    if not base.is_dir():
        return None
    for found in [base / reports.PlanReport.file_name, *sorted(base.glob(f"*/{reports.PlanReport.file_name}"))]:
        data = storage.read_json(str(found))
        if data is not None:
            return config.spec_to_data(reports.parse(reports.PlanReport, data).plan.spec)
    return None


def _locate_run(args: argparse.Namespace) -> tuple[dict[str, Any] | None, identity.RunIdentity]:
    """The profile's spec for ``--run`` (None without ``--profile``) and where the run is: ``<output_dir>/<run>``.

    ``output_dir`` is ``--output-dir``, else the profile's.

    Raises:
        InputError: neither gives an output directory.
    """
    spec: dict[str, Any] | None = None
    if args.profile:
        profile, overrides = _profile_and_overrides(args)
        spec = config.spec_to_data(config.load_spec(profile, {**overrides, "run_name": args.run}))
    output_dir = args.output_dir or (spec or {}).get("output_dir")
    if not output_dir:
        raise InputError("--output-dir is missing", "give --output-dir (the run's output_dir) or --profile")
    return spec, identity.run_identity(args.run, output_dir)


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
    if not names.DNS1035_LABEL.match(args.run or ""):
        raise InputError(
            f"--run {args.run!r} is not a run name (a DNS-1035 label: lower-case letters, digits and '-', "
            "starting with a letter)",
            "give the run_name of the run to clean up, e.g. --run e2e (the last path part of its run directory)",
        )
    spec, found = _locate_run(args)
    spec = spec or _run_spec_of(found.run_dir)
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


def cmd_inject(args: argparse.Namespace) -> int:
    """Fault injection on the local backend: Spot-preempt one slice of a running stage, or give capacity back.

    ``preempt-slice`` withdraws slice ``--slice``'s capacity (for ``--for`` seconds, or until ``restore-capacity``)
    and SIGKILLs that slice's pods of the stage's JobSet (:func:`multislice.backends.local.capacity.preempt_slice`);
    ``restore-capacity`` gives the slice (or every slice) back. The run is ``<output_dir>/<run>``, with
    ``output_dir`` from ``--output-dir``, else the profile's; its slices and stages from its plan report, else the
    profile.
    """
    from multislice.backends.local import capacity  # jsonschema and the CRDs (0.5 s): local runs only

    if not names.DNS1035_LABEL.fullmatch(args.run or ""):
        raise InputError(f"--run {args.run!r} is not a run name (a DNS-1035 label)", "give the run's run_name")
    spec, found = _locate_run(args)
    spec = _run_spec_of(found.run_dir) or spec
    if spec is None or not storage.path(found.run_dir).is_dir():
        raise InputError(f"--run {args.run}: no run directory {found.run_dir}", "check --run and --output-dir")
    if spec.get("backend") != "local":
        raise InputError(
            f"run {args.run} is on the {spec.get('backend')} backend; fault injection is for the local backend",
            "on GKE, preempt a slice by deleting its node pool's nodes (or wait for Spot to do it)",
        )
    slices = int(spec["num_slices"])
    if args.action == "restore-capacity":
        ended = capacity.restore(found.run_dir, args.slice)
        print(f"run {args.run}: {ended} withdrawn slice(s) given back; {capacity.available(found.run_dir)} available")
        return 0
    stages = [s["name"] for s in spec["stages"]]
    if args.stage not in stages:
        raise InputError(f"--stage {args.stage!r} is not a stage of run {args.run}", f"use one of {', '.join(stages)}")
    if args.slice is None or not 0 <= args.slice < slices:
        raise InputError(f"--slice {args.slice} is not a slice of run {args.run}", f"give 0 to {slices - 1}")
    if args.seconds is not None and args.seconds < 0:
        raise InputError(
            f"--for {args.seconds:g} is negative", "give the seconds the capacity stays away, or leave out"
        )
    jobset = names.jobset_name(args.run, args.stage)
    for line in capacity.preempt_slice(found.run_dir, jobset, slices, args.slice, args.seconds):
        print(line)
    until = "until restore-capacity" if args.seconds is None else f"for {args.seconds:g} s"
    print(f"slice {args.slice} of run {args.run} preempted: capacity withdrawn {until}")
    return 0


def cmd_reap(args: argparse.Namespace) -> int:
    """Delete the unfinished JobSets of pipeline runs whose Lease expired (:func:`multislice.backends.gke.lease.reap`).

    The cluster's safety net for a cancelled run whose steps were killed before their handlers ran; the
    CronJob of :func:`multislice.backends.gke.lease.reaper_cronjob` runs it every minute. The cluster and
    namespace come from ``--profile`` (and ``--set``); ``--in-cluster`` uses the pod's service account.
    """
    from multislice.backends.gke import lease  # the GKE clients (2-3 s): only for reap

    profile, overrides = _profile_and_overrides(args)
    if args.in_cluster:
        overrides["cluster.access"] = "in-cluster"
    if args.namespace:
        overrides["namespace"] = args.namespace
    spec = config.load_spec(profile, {**overrides, "backend": "gke"})
    backend = backends.create("gke", run_dir="", namespace=spec.namespace, cluster=spec.cluster.model_dump(), say=print)
    deleted = lease.reap(backend.kube, tell=print)
    print(f"namespace {spec.namespace}: deleted {', '.join(deleted) if deleted else 'nothing (no expired Lease)'}")
    return 0


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
    """AOT-compile the profile's stages for the target topology; exit 1 when one does not fit.

    The compiles run on this machine (the trainer environment) whatever the
    profile's backend, so no cloud credentials are needed; ``--on-cluster``
    runs them as Jobs of the trainer image on the profile's cluster instead.
    """
    from multislice.backends.local import LocalBackend  # jsonschema and the CRDs (0.5 s): local runs only

    if args.report:
        _check_output("--report", args.report, directory=False, suffixes=(".json",))
    if args.cache_dir is not None:
        _check_cache_dir("--cache-dir", args.cache_dir, remote_ok=args.on_cluster)
    extra: dict[str, Any] = {"preflight.skip": False, "preflight.suggest_alternative": not args.no_alternative}
    plan, stages = _preflight_plan(args, extra)
    if args.on_cluster:
        cache = args.cache_dir or preflight.default_cache_dir(plan)
        backend = backends.backend_for(plan, say=print)
    else:
        cache = args.cache_dir or plan.spec.preflight.cache_dir or preflight.user_cache_dir()
        if not storage.is_remote(cache):
            _check_cache_dir("preflight.cache_dir" if not args.cache_dir else "--cache-dir", cache, remote_ok=False)
        backend = LocalBackend(plan.run_dir, timings.timings_for(plan.spec, "local"))
    try:
        found = preflight_step.run(plan, stages, backend=backend, cache_dir=cache, write_reports=False)
    except preflight.PreflightFailed as error:
        _write_json(args.report, {"verdict": "does_not_fit", "stages": [r.to_dict() for r in error.reports]})
        raise
    _write_json(args.report, {"verdict": "fits", "stages": [r.to_dict() for r in found.values()]})
    print(f"preflight: all {len(found)} stage(s) fit on {plan.spec.num_slices} x {plan.spec.tpu_type}")
    return 0


def _write_json(path: str | None, data: Any) -> None:
    if path:
        storage.write_json(path, data)


def _check_cache_dir(option: str, value: str, *, remote_ok: bool) -> None:
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
    path = _check_output(option, value, directory=True)
    existing = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{option} {value!r}: {existing} is not writable by this user", fix)


#: ``multislice plan``'s bounds: ``--want`` fitting configs (one slice count has at most 4 x 4 x 4 x 2 x 2 x 2 x 2
#: = 1,024 candidates, :func:`multislice.preflight.planner.candidates`); ``--max-target-length`` as the spec's
#: ``max_target_length``.
MAX_PLAN_WANT = 1024


def _plan_option_issues(args: argparse.Namespace, chips: int, first_slices: int) -> list[tuple[str, str]]:
    """``(option, message)`` for each bad ``multislice plan`` option, checked before the spec is changed.

    ``chips``: chips per slice of the planned TPU type; ``first_slices``: the slice count the search starts at.
    """
    issues: list[tuple[str, str]] = []

    def whole(option: str, value: int | None, low: int, high: int, what: str) -> None:
        if value is not None and not low <= value <= high:
            issues.append((option, f"{value} is not {what}; give {low} to {high:,}"))

    whole("--num-slices", args.num_slices, 1, INT32_MAX, "a slice count (0 slices cannot train)")
    whole("--max-slices", args.max_slices, 1, INT32_MAX, "a slice count")
    whole("--seq", args.seq, 1, 2**20, "a sequence length")
    whole("--want", args.want, 1, MAX_PLAN_WANT, "a count of fitting configs")
    whole("--global-batch", args.global_batch, 1, INT32_MAX, "a global batch (sequences per step)")
    if not (math.isfinite(args.budget) and 0 < args.budget <= MAX_TIMEOUT_SECONDS):
        issues.append(("--budget", f"{args.budget:g} s: give seconds of compiling, more than 0 and at most "
                                   f"{MAX_TIMEOUT_SECONDS:,}"))  # fmt: skip
    if args.global_batch is not None and not issues and not _batch_fits(args.global_batch, chips, first_slices,
                                                                        args.max_slices):  # fmt: skip
        last = max(first_slices, args.max_slices)
        issues.append(("--global-batch", f"{args.global_batch} sequences do not divide over the chips of any slice "
                                         f"count from {first_slices} to {last} ({chips} chips per slice); give a "
                                         f"multiple of {chips * first_slices}"))  # fmt: skip
    return issues


def _batch_fits(global_batch: int, chips: int, first: int, last: int) -> bool:
    """Whether ``global_batch`` divides over ``chips x s`` chips for some slice count ``s`` in ``first..last``."""
    if global_batch % chips:
        return False
    per_slice = global_batch // chips  # s must divide this; enumerate its divisors up to its square root
    divisor = 1
    while divisor * divisor <= per_slice:
        if per_slice % divisor == 0 and any(first <= d <= last for d in (divisor, per_slice // divisor)):
            return True
        divisor += 1
    return False


def _fixed_knobs(pairs: list[str]) -> dict[str, Any]:
    """``--fix KNOB=VALUE`` as the planner's fixed knobs, each checked against what the planner varies.

    Raises:
        ConfigError: (field ``--fix``) an unknown knob, or a value the planner would never try.
    """
    choices: dict[str, Any] = {
        "per_device_batch_size": "a number > 0",
        "remat_policy": planner.REMAT_CHOICES,
        "optimizer_offload": (True, False),
        "parameter_offload": (True, False),
        "weight_dtype": ("float32", "bfloat16"),
    }
    fixed, issues = {}, []
    try:
        parsed = config.parse_set_arguments(pairs)
    except config.ConfigError as error:
        fix = "give --fix KNOB=VALUE, e.g. --fix weight_dtype=float32"
        raise config.ConfigError([("--fix", f"{message.replace('--set', '--fix')}; {fix}")
                                  for _, message in error.issues]) from None  # fmt: skip
    for key, value in parsed.items():
        if key not in choices:
            issues.append(("--fix", f"{key!r} is not a knob the planner varies; fix one of {', '.join(choices)} "
                                    "(ICI and DCN: set stages.N.ici / stages.N.dcn in the profile)"))  # fmt: skip
            continue
        allowed = choices[key]
        if key == "per_device_batch_size":
            number = isinstance(value, (int, float)) and not isinstance(value, bool)
            ok = number and math.isfinite(value) and 0 < value <= 2**16
        else:
            ok = any(value is c if isinstance(c, bool) else value == c for c in allowed)
        if not ok:
            shown = allowed if isinstance(allowed, str) else ", ".join(str(c).lower() for c in allowed)
            issues.append(("--fix", f"{key}={value!r}: give {shown}"))
            continue
        fixed[key] = value
    if issues:
        raise config.ConfigError(issues)
    return fixed


def cmd_plan(args: argparse.Namespace) -> int:
    """Search fitting configs for a stage; prints them ranked, or the fewest slices that fit, or that none do.

    Every option is checked before anything is written or compiled (exit 2, the option and the fix named).
    """
    from multislice.backends.local.aot import AotSession  # jsonschema and the CRDs (0.5 s): local runs only

    if args.report:
        _check_output("--report", args.report, directory=False, suffixes=(".json",))
    if args.work_dir is not None:
        _check_output("--work-dir", args.work_dir, directory=True)
    if args.cache_dir is not None:
        _check_cache_dir("--cache-dir", args.cache_dir, remote_ok=False)
    fixed = _fixed_knobs(args.fix or [])
    plan, stages = _preflight_plan(args)
    spec, stage = plan.spec, plan.spec.stage(stages[0].name)
    try:
        slice_type = tpu.parse_tpu_type(args.tpu_type) if args.tpu_type is not None else spec.slice_type
    except (ValueError, KeyError, config.ConfigError) as error:
        raise config.ConfigError([("--tpu-type", str(error).strip("'\""))]) from None
    first = args.num_slices if args.num_slices is not None else spec.num_slices
    if issues := _plan_option_issues(args, slice_type.chips, first):
        raise config.ConfigError(issues)
    updates: dict[str, Any] = {}
    if args.model is not None:
        try:
            updates["model"] = config.ModelSpec(name=args.model)
        except ValueError as error:  # pydantic's ValidationError: the model name's own message
            messages = [e.get("msg", str(e)).removeprefix("Value error, ") for e in getattr(error, "errors", list)()]
            raise config.ConfigError([("--model", "; ".join(messages) or str(error))]) from None
    if args.seq is not None:
        updates["max_target_length"] = args.seq
    stage = stage.model_copy(update=updates)
    spec = spec.model_copy(
        update={k: v for k, v in (("tpu_type", args.tpu_type), ("num_slices", args.num_slices)) if v is not None}
    )
    try:
        spec = config.load_spec(config.spec_to_data(spec.with_stages(stage)), {"stages.0.dcn": {}, "stages.0.ici": {}})
    except config.ConfigError as error:  # name the option that set the field
        options = {"tpu_type": "--tpu-type", "num_slices": "--num-slices", "max_target_length": "--seq",
                   "model": "--model"}  # fmt: skip
        raise config.ConfigError(
            [(next((o for f, o in options.items() if f in field), field), message) for field, message in error.issues]
        ) from None
    stage = spec.stages[0]
    cache = args.cache_dir or spec.preflight.cache_dir or user_cache_dir()
    if not storage.is_remote(cache):
        _check_cache_dir("--cache-dir" if args.cache_dir else "preflight.cache_dir", cache, remote_ok=False)
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
            compile_timeout=timings.timings_for(spec, "local").compile_timeout,
        )
    _write_json(args.report, found.as_dict())
    if found.fitting:
        extra = "" if found.fewest_slices == spec.num_slices else f" (none on {spec.num_slices}: fewest that fit)"
        print(
            f"\n{len(found.fitting)} AOT-verified fitting config(s) on {found.fewest_slices} slices{extra}, best first:"
        )
        for rank, c in enumerate(found.fitting, 1):
            print(
                f"  {rank}. {c.describe()}: {c.report.bytes_per_chip.total / 2**30:.2f} GiB per chip, "
                f"estimated MFU {c.estimated_mfu:.0%}, {c.tokens_per_step_per_chip:g} tokens per step per chip"
            )
        print(f"searched in {found.seconds:.0f} s")
        return 0
    if not found.slices_tried:
        print(f"\nno slice count searched within the {args.budget:.0f} s budget; raise --budget")
    elif found.exhausted:
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
    profile, overrides = _profile_and_overrides(args)
    if args.dry_run:
        request = submission.dry_run(
            profile, overrides, target=args.target, continue_run=args.continue_run, **submission.targets_from_args(args)
        )
        print_request(request, f"run {request.run_name} would be submitted to {args.target}")
        return 0
    run = submission.submit(
        profile, overrides, target=args.target, continue_run=args.continue_run, **submission.targets_from_args(args)
    )
    print(f"submitted run {run.run_name} to {run.target}: {run.run_id}")
    for name, value in run.parameters.items():
        print(f"  {name} = {value!r}")
    return 0


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


def cmd_schedule(args: argparse.Namespace) -> int:
    """Create, list, pause, resume or delete schedules (:mod:`multislice.delivery.schedule`)."""
    where = submission.targets_from_args(args)
    if args.action == "create":
        missing = [("--profile", "required by `schedule create`")] if not args.profile else []
        if not args.cron and not args.interval:
            missing.append(("--cron", "required by `schedule create` (or --interval SECONDS on KFP)"))
        if missing:
            raise config.ConfigError(missing)
        profile, overrides = _profile_and_overrides(args)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", schedule.CatchUpWarning)
            made = schedule.create(
                profile, overrides, target=args.target, cron=args.cron, timezone=args.timezone,
                interval_seconds=args.interval, name=args.name,
                max_concurrent_runs=1 if args.max_concurrent_runs is None else args.max_concurrent_runs,
                allow_queueing=args.allow_queueing, catch_up=args.catch_up, max_runs=args.max_runs,
                start_time=args.start_time, end_time=args.end_time, continue_run=args.continue_run,
                dry_run=args.dry_run, **where,
            )  # fmt: skip
        _print_warnings(caught)
        if made.request is not None:
            print_request(made.request, f"schedule {made.name} would be created on {made.target}")
        else:
            print(f"schedule {made.name} created on {made.target}: {made.schedule_id}, cron {made.cron!r}")
        print(f"catch-up: {'on' if args.catch_up else 'off (missed runs are skipped)'}")
        if args.cron:
            next_times = schedule.Cron.parse(args.cron, args.timezone).next_times()
            zone = "" if args.timezone or args.target != "kfp" else " (UTC; KFP uses its CRON_SCHEDULE_TIMEZONE)"
            print("next runs: " + ", ".join(t.isoformat() for t in next_times) + zone)
    elif args.action == "list":
        for found in schedule.list_schedules(args.target, **where):
            print(f"{found.schedule_id}\t{found.name}\t{found.cron}\t{found.state}")
    elif args.action == "update":
        if not args.schedule_id:
            raise config.ConfigError([("SCHEDULE_ID", "`schedule update` needs the schedule's ID (see list)")])
        made = schedule.update(
            args.schedule_id, args.target, cron=args.cron, timezone=args.timezone, name=args.name,
            max_concurrent_runs=args.max_concurrent_runs, allow_queueing=args.allow_queueing or None,
            max_runs=args.max_runs, start_time=args.start_time, end_time=args.end_time, dry_run=args.dry_run,
            **where,
        )  # fmt: skip
        if made.request is not None:
            print_request(made.request, f"schedule {made.schedule_id} would be updated")
        else:
            print(f"schedule {made.schedule_id} updated: {made.name}, cron {made.cron!r}")
    else:
        if not args.schedule_id:
            raise config.ConfigError([("SCHEDULE_ID", f"`schedule {args.action}` needs the schedule's ID (see list)")])
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", schedule.CatchUpWarning)
            schedule.change(args.action, args.schedule_id, args.target, catch_up=args.catch_up, **where)
        _print_warnings(caught)
        print(f"schedule {args.schedule_id}: {args.action} sent")
    return 0


def _print_warnings(caught: list[warnings.WarningMessage]) -> None:
    """Print caught warnings on stderr, ``warning: <message>``."""
    for item in caught:
        print(f"warning: {item.message}", file=sys.stderr)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose ``epilog`` may be a function, called only when the help is printed
    (``run --help`` reads a profile for its parameter list; no other command pays for it)."""

    def format_help(self) -> str:
        if callable(self.epilog):
            self.epilog = self.epilog()
        return super().format_help()


#: Each sub-command's examples, shown at the end of its ``--help``.
EXAMPLES: dict[str, str] = {
    "render": "multislice render --profile gke-v6e-16x2 --output build/manifests/gke-v6e-16x2\n"
    "multislice render --profile local --output build/m --set num_slices=1 --set stages.1.dcn.fsdp=1",
    "compile": "multislice compile --profile gke-v6e-16x2 --output build/pipelines/gke-v6e-16x2.yaml\n"
    "multislice compile --profile gke-v6e-16x2 --target vertex --output build/pipelines/gke.vertex.yaml",
    "run": "multislice run --profile local                      # what `make run` does\n"
    "multislice run --profile local --set stage1_steps=4 --set stage2_steps=4 --set run_name=short\n"
    "multislice run --profile elastic                    # `make run PROFILE=elastic`: an elastic stage",
    "preflight": "multislice preflight --profile gke-v6e-16x2\n"
    "multislice preflight --profile gke-v6e-16x2 --stage seed-llama3-70b --no-alternative",
    "plan": "multislice plan --profile gke-v6e-16x2 --model llama3-70b --tpu-type v6e-16 --max-slices 4",
    "verify-checkpoint": "multislice verify-checkpoint output/runs/local-demo-20261201-030000/tiny-8b-recipe",
    "cleanup": "multislice cleanup --run local-demo-20261201-030000 --profile local",
    "inject": "multislice inject preempt-slice --run elastic-demo-20261201-030000 --profile elastic \\\n"
    "    --stage tiny-elastic --slice 1 --for 90\n"
    "multislice inject restore-capacity --run elastic-demo-20261201-030000 --profile elastic",
    "images": "multislice images build --cloud-build --project my-project "
    "--repo us-east5-docker.pkg.dev/my-project/multislice",
    "submit": "multislice submit --profile gke-v6e-16x2 --target vertex --project my-project --location us-east5 \\\n"
    "    --set output_dir=gs://my-bucket/runs --set stage1_steps=500 --dry-run\n"
    "multislice submit --profile gke-v6e-16x2 --target kfp --host http://localhost:8888 \\\n"
    "    --set output_dir=gs://my-bucket/runs",
    "reap": "multislice reap --profile gke-v6e-16x2",
    "schedule": "multislice schedule create --profile gke-v6e-16x2 --target kfp --host http://localhost:8888 \\\n"
    "    --cron '0 3 * * *' --set output_dir=gs://my-bucket/runs\n"
    "multislice schedule list --target kfp --host http://localhost:8888",
    "schedule create": "multislice schedule create --profile gke-v6e-16x2 --target vertex --project my-project \\\n"
    "    --location us-east5 --cron '0 3 * * 1-5' --timezone Europe/Paris \\\n"
    "    --set output_dir=gs://my-bucket/runs --dry-run\n"
    "multislice schedule create --profile gke-v6e-16x2 --target kfp --host http://localhost:8888 \\\n"
    "    --cron '0 3 * * *' --set output_dir=gs://my-bucket/runs",
    "schedule list": "multislice schedule list --target vertex --project my-project --location us-east5",
    "schedule update": "multislice schedule update SCHEDULE_ID --target vertex --project my-project "
    "--location us-east5 \\\n    --cron '0 4 * * *' --dry-run",
    "schedule pause": "multislice schedule pause SCHEDULE_ID --target kfp --host http://localhost:8888",
    "schedule resume": "multislice schedule resume SCHEDULE_ID --target vertex --project my-project "
    "--location us-east5 --catch-up",
    "schedule delete": "multislice schedule delete SCHEDULE_ID --target kfp --host http://localhost:8888",
    "env": "multislice env install ~/multislice-envs\n"
    "export MULTISLICE_TRAINER_ENV=~/multislice-envs/trainer   # then the notebook and run_local use it",
    "calls list": "multislice calls list --output-dir output\nmultislice calls list --output-dir gs://my-bucket/remote",
    "calls logs": "multislice calls logs remote-train-shard-c0ffee00 --follow\n"
    "multislice calls logs c0ffee00 --host 1,0 --output-dir gs://my-bucket/remote",
}


def _profile_in(argv: list[str] | None) -> str:
    """The ``--profile`` among the command's arguments, else ``local`` (what ``make run`` runs)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    for index, arg in enumerate(argv):
        if arg == "--profile" and index + 1 < len(argv):
            return argv[index + 1]
        if arg.startswith("--profile="):
            return arg.partition("=")[2]
    return "local"


def run_parameters_help(profile: str) -> str:
    """``multislice run --help``'s parameter list: every pipeline parameter with ``profile``'s value, its type and
    description (:func:`multislice.config.parameters.help_lines`), how to set them, and the examples."""
    try:
        spec: config.RunSpec | None = config.load_profile(profile)
        source = f"profile {profile}'s values" + (" (the default of `make run`)" if profile == "local" else "")
    except UserError as error:
        spec, source = None, f"profile {profile} does not load: {str(error).splitlines()[-1].strip()}"
    lines = [
        f"run parameters: --set NAME=VALUE (repeatable); {source}:",
        *parameters.help_lines(spec),
        "",
        "any other field of the profile by its dotted path, stages by index from 0 or by name:",
        "  --set stages.0.ici.fsdp=4  --set stages.1.checkpoint_period=10  --set timeouts.train=3600",
        "fewer steps than a stage's checkpoint_period lower the period to the steps (unless it is set too).",
        "a bad value stops the command before anything starts, naming the field and the fix.",
        "",
        "examples:",
        *(f"  {line}" for line in EXAMPLES["run"].splitlines()),
    ]
    return "\n".join(lines)


def _add_examples(sub: Any, prefix: str = "") -> None:
    """Give every sub-command of ``sub`` its examples (:data:`EXAMPLES`) and its one-line help as description."""
    helps = {action.dest: action.help for action in sub._choices_actions}
    for name, command in sub.choices.items():
        command.formatter_class = argparse.RawDescriptionHelpFormatter
        command.description = command.description or helps.get(name)
        key = f"{prefix}{name}"
        if command.epilog is None and key in EXAMPLES:
            command.epilog = "examples:\n" + "\n".join(f"  {line}" for line in EXAMPLES[key].splitlines())
        for action in command._actions:
            if isinstance(action, argparse._SubParsersAction):
                _add_examples(action, f"{key} ")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``multislice`` argument parser; ``argv`` (default ``sys.argv[1:]``) names the profile ``run --help``
    lists the parameters of."""
    parser = _Parser(prog="multislice", description=__doc__.split("\n")[0])
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
    comp.add_argument(
        "--images",
        default="build/images",
        metavar="DIR",
        help="where `multislice images build` / `make images PUSH=1` wrote <image>.json: pushed images are "
        "compiled in by digest (default build/images; ignored when absent)",
    )
    comp.set_defaults(func=cmd_compile)

    run = sub.add_parser(
        "run",
        help="run the pipeline locally with kfp.local (what `make run` does)",
        epilog=lambda: run_parameters_help(_profile_in(argv)),
    )
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
    pre.add_argument(
        "--on-cluster",
        action="store_true",
        help="compile as Jobs of the trainer image on the profile's cluster (default: on this machine)",
    )
    pre.add_argument("--report", help="also write the JSON report here")
    pre.set_defaults(func=cmd_preflight)

    pln = sub.add_parser("plan", help="search AOT-verified configs that fit in HBM, ranked by estimated speed")
    with_profile(pln)
    pln.add_argument("--stage", help="the stage to start from (default: the first)")
    pln.add_argument("--model", help="MaxText model_name instead of the stage's (e.g. llama3-70b)")
    pln.add_argument("--tpu-type", help="slice type instead of the profile's (e.g. v6e-16)")
    pln.add_argument("--num-slices", type=int, help="slice count to start from (default: the profile's)")
    pln.add_argument("--max-slices", type=int, default=8, help="most slices to try when fewer do not fit (default 8)")
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
    verify.add_argument("--report", help="also write the JSON report here (a .json file)")
    verify.set_defaults(func=cmd_verify_checkpoint)

    clean = sub.add_parser("cleanup", help="remove what a crashed or cancelled run left (its JobSets and pods)")
    clean.add_argument("--run", required=True, help="the run's run_name")
    clean.add_argument("--output-dir", help="the run's output_dir (default: the profile's)")
    with_profile(clean, required=False)
    clean.add_argument("--pipeline-run-id", help="only what this pipeline run created (its pipeline/runid label)")
    clean.set_defaults(func=cmd_cleanup)

    inject = sub.add_parser("inject", help="local backend: preempt a slice (Spot) or give its capacity back")
    inject.add_argument("action", choices=["preempt-slice", "restore-capacity"])
    inject.add_argument("--run", required=True, help="the run's run_name")
    inject.add_argument("--stage", help="the stage whose JobSet loses the slice (preempt-slice)")
    inject.add_argument("--slice", type=int, help="slice index, from 0 (restore-capacity: default every slice)")
    inject.add_argument("--for", dest="seconds", type=float, help="seconds the capacity stays away (default: until "
                        "restore-capacity)")  # fmt: skip
    inject.add_argument("--output-dir", help="the run's output_dir (default: the profile's)")
    with_profile(inject, required=False)
    inject.set_defaults(func=cmd_inject)

    env = sub.add_parser(
        "env",
        help="build the trainer environment (MaxText) that local runs and remote calls need, without a checkout",
        description="Build the trainer environment `make env` builds, from the lock files this package carries: "
        "DIR/trainer (MaxText 0.2.5 with JAX, Orbax, torch, Ray: about 8 GB; this package copied in) and "
        "DIR/loader-hf4 (the export check's transformers 4.57). Then set MULTISLICE_TRAINER_ENV=DIR/trainer.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env.add_argument("action", choices=["install"])
    env.add_argument("directory", metavar="DIR", help="where to create trainer/ and loader-hf4/")
    env.add_argument("--python", default=sys.executable, help="a Python 3.12 interpreter (default: this one)")
    env.add_argument("--requirements", metavar="FILE", help="trainer lock file (default: the packaged one, what "
                     "`make env` installs)")  # fmt: skip
    env.add_argument("--loader-requirements", metavar="FILE", help="the export check's loader lock file (default: "
                     "the packaged one)")  # fmt: skip
    env.set_defaults(func=cmd_env)
    _add_delivery_commands(sub, with_profile)
    calls.add_parser(sub)
    _add_examples(sub)
    return parser


def cmd_env(args: argparse.Namespace) -> int:
    """``multislice env install DIR``: :func:`multislice.backends.local.environment.install_trainer_env`."""
    from multislice.backends.local import environment

    locks = {"trainer_lock": args.requirements, "loader_lock": args.loader_requirements}
    environment.install_trainer_env(args.directory, python=args.python,
                                    **{k: Path(v) for k, v in locks.items() if v})  # fmt: skip
    return 0


def cmd_images(args: argparse.Namespace) -> int:
    """Build and push both images with Cloud Build (no Docker engine), writing build/images/<image>.json."""
    if not args.cloud_build:
        raise InputError(
            "multislice images build needs --cloud-build (the only builder it drives)",
            "run `multislice images build --cloud-build --project P --repo LOCATION-docker.pkg.dev/P/REPO`, "
            "or `make images` with a local Docker engine",
        )
    built = images.cloud_build(args.project, args.repo, tag=args.tag, bucket=args.source_bucket, output_dir=args.output)
    print(f"images written to {args.output}: `multislice compile` now uses them by digest")
    return 0 if len(built) == len(images.IMAGES) else 1


def _add_delivery_commands(sub: Any, with_profile: Any) -> None:
    imgs = sub.add_parser("images", help="build and push the pipeline and trainer images (Cloud Build: no Docker)")
    imgs.add_argument("action", choices=["build"])
    imgs.add_argument("--cloud-build", action="store_true", help="build with Cloud Build (the repository as source)")
    imgs.add_argument("--project", required=True, help="Google Cloud project that runs the build")
    imgs.add_argument(
        "--repo", required=True, help="Artifact Registry repository: LOCATION-docker.pkg.dev/PROJECT/REPO"
    )
    imgs.add_argument("--tag", help="image tag (default <package version>-<commit>)")
    imgs.add_argument("--source-bucket", help="bucket for the source tarball (default <project>_cloudbuild)")
    imgs.add_argument("--output", default="build/images", help="where <image>.json go (default build/images)")
    imgs.set_defaults(func=cmd_images)

    submit = sub.add_parser("submit", help="submit one run to Vertex AI Pipelines or a KFP endpoint")
    with_profile(submit)
    add_target_arguments(submit)
    submit.add_argument(
        "--continue",
        dest="continue_run",
        metavar="RUN",
        help="continue the earlier run RUN (its run_name as it ran): resume from its checkpoints instead of a new run",
    )
    submit.add_argument(
        "--dry-run", action="store_true", help="validate everything and print what would be sent; send nothing"
    )
    submit.set_defaults(func=cmd_submit)

    reaper = sub.add_parser("reap", help="delete unfinished JobSets whose Lease expired (a cancelled run's orphans)")
    with_profile(reaper)
    reaper.add_argument("--namespace", help="namespace of the JobSets (default the profile's)")
    reaper.add_argument("--in-cluster", action="store_true", help="use the pod's service account (the CronJob)")
    reaper.set_defaults(func=cmd_reap)

    sched = sub.add_parser("schedule", help="recurring runs: create, list, update, pause, resume, delete")
    actions = sched.add_subparsers(dest="action", required=True, metavar="ACTION")
    # Each action is its own sub-command, so that `schedule create --help` prints create's options.
    schedule_actions = {
        "create": "create a schedule of the profile's pipeline (--cron, or --interval on KFP)",
        "list": "list the schedules of the target",
        "update": "change a Vertex AI schedule in place (KFP cannot update: delete and create)",
        "pause": "pause a schedule", "resume": "resume a paused schedule", "delete": "delete a schedule",
    }  # fmt: skip
    for action, text in schedule_actions.items():
        act = actions.add_parser(action, help=text, description=text)
        if action == "create":
            with_profile(act)
        elif action != "list":
            act.add_argument("schedule_id", nargs="?", help="the schedule's ID (see `multislice schedule list`)")
        add_target_arguments(act)
        if action in ("create", "update"):
            _add_schedule_options(act, create=action == "create")
            act.add_argument(
                "--dry-run", action="store_true", help="validate everything and print what would be sent; send nothing"
            )
        if action == "resume":
            act.add_argument("--catch-up", action="store_true", help="start the runs missed while paused (Vertex)")
        taken = {a.dest for a in act._actions}
        act.set_defaults(func=cmd_schedule, **{k: None for k in _SCHEDULE_OPTIONS if k not in taken})


#: Every ``schedule`` option's destination, None where an action does not take it.
_SCHEDULE_OPTIONS = (
    "profile", "set", "schedule_id", "cron", "timezone", "interval", "name", "max_concurrent_runs", "allow_queueing",
    "catch_up", "start_time", "end_time", "max_runs", "continue_run", "dry_run",
)  # fmt: skip


def _add_schedule_options(act: argparse.ArgumentParser, create: bool) -> None:
    """The options of ``schedule create`` (``create``) or ``schedule update``."""
    act.add_argument("--cron", help="5 fields: minute hour day-of-month month day-of-week, e.g. '0 3 * * *'")
    act.add_argument(
        "--timezone", help="IANA time zone of --cron (Vertex only; KFP uses its controller's CRON_SCHEDULE_TIMEZONE)"
    )
    if create:
        act.add_argument("--interval", type=int, metavar="SECONDS", help="KFP only, instead of --cron: every N seconds")
    act.add_argument("--name", help="display name" + (" (default <run_name>-schedule)" if create else ""))
    default = " (default 1)" if create else ""
    act.add_argument("--max-concurrent-runs", type=int, help=f"runs of this schedule at once{default}")
    act.add_argument(
        "--allow-queueing", action="store_true", help="Vertex only: a run due at the concurrency limit waits"
    )
    if create:
        act.add_argument(
            "--catch-up",
            action="store_true",
            help="KFP: start the runs missed since --start-time and while disabled; off by default",
        )
    act.add_argument("--start-time", metavar="RFC3339", help="first run not before, e.g. 2026-12-01T03:00:00Z")
    act.add_argument("--end-time", metavar="RFC3339", help="no run after, e.g. 2027-03-01T00:00:00Z")
    act.add_argument("--max-runs", type=int, help="stop after this many runs (Vertex only)")
    if create:
        act.add_argument(
            "--continue-run",
            action="store_true",
            help="every run continues the same run_name (one long training run) instead of a new one",
        )


def report_error(error: UserError) -> int:
    """Print an expected error as ``error: <cause>`` and ``fix: <what to do>``; returns its exit status."""
    print(f"error: {error}", file=sys.stderr)
    return error.exit_code


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; returns the exit status.

    Expected errors (:class:`multislice.errors.UserError`: a bad config, a missing
    path or environment, no credentials, an unreachable cluster, a stage that does
    not fit, a failed run) print their cause and fix, never a traceback: exit 2
    for bad input, 1 for a run that failed. An interrupt exits 130.
    """
    args = build_parser(argv).parse_args(argv)
    try:
        return args.func(args)
    except UserError as error:
        return report_error(error)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as error:
        translated = expected_error(error)
        if translated is None:
            raise
        return report_error(translated)


if __name__ == "__main__":
    sys.exit(main())
