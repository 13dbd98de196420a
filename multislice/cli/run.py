"""``multislice run``: compile the profile's pipeline and run it here with kfp.local; print a summary."""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import re
import signal
import sys
import time
import warnings
from pathlib import Path
from typing import Any, TextIO

from multislice import cancel, config, identity, ownership, storage
from multislice.cli.common import profile_and_overrides, with_profile
from multislice.cli.summary import run_files, summary_lines
from multislice.config import parameters
from multislice.errors import UserError
from multislice.plan import Plan, make_plan

#: Examples at the end of ``--help`` (:func:`multislice.cli.app.build_parser`).
EXAMPLES: dict[str, str] = {
    "run": "multislice run --profile local                      # what `make run` does\n"
    "multislice run --profile local --set stage1_steps=4 --set stage2_steps=4 --set run_name=short\n"
    "multislice run --profile elastic                    # `make run PROFILE=elastic`: an elastic stage",
}


STEPS = "plan|preflight|provision|admit|launch|train|verify_checkpoint|export|cleanup"
PROGRESS = re.compile(rf"^\s*\[({STEPS})[ \]]|Executing task|finished with status")
ERROR_LINE = re.compile(
    r"^\s*([\w.]+\.)?[A-Z]\w*(Error|Failed|Exception|Invalid|Missing|Exists|Unavailable|Capacity)\b.*"
)


def add_parser(sub: Any, argv: list[str] | None) -> None:
    """Register ``multislice run`` with its handler (``argv``: the command line)."""
    run = sub.add_parser(
        "run",
        help="run the pipeline locally with kfp.local (what `make run` does)",
        epilog=lambda: run_parameters_help(_profile_in(argv)),
    )
    with_profile(run)
    run.set_defaults(func=cmd_run)


class _ProgressTee(io.TextIOBase):
    """Write everything to a log file; echo progress lines to the terminal."""

    def __init__(self, log: TextIO, terminal: TextIO):
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
    profile, overrides = profile_and_overrides(args)
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
        # The steps (and the JobSet supervisors they start) end the run if this process ends unannounced (SIGKILL):
        # multislice.cancel.watch_driver.
        os.environ[cancel.ENV_DRIVER] = cancel.driver_value()
        try:
            return _run_owned(spec, plan, run_dir, run_id, claim, started)
        finally:
            os.environ.pop(ownership.ENV_CLAIM, None)
            os.environ.pop(cancel.ENV_DRIVER, None)


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
        for child in cancel.step_pids(os.getpid()):
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
