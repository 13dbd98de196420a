"""Preflight: prove each stage fits in HBM by AOT-compiling it for the target TPU topology.

config -> plan -> **preflight** -> provision: nothing is provisioned until every
stage compiles for ``num_slices`` x ``tpu_type`` within the HBM XLA allows per
chip. A compile runs where MaxText is, through a backend's
:class:`CompileSession`: a trainer-environment process
of this machine (:mod:`multislice.backends.local.aot`) or a Job of the trainer
image on the cluster (:mod:`multislice.backends.gke.aot`); both run
:mod:`multislice.trainer.aot` (MaxText's own ``train_compile`` path with
libtpu's topology description; no TPU is needed). Verdicts are cached
(``PreflightSpec.cache_dir``, local or ``gs://``), keyed by MaxText, libtpu and
JAX versions and a hash of the compile-relevant arguments, so a rerun
recompiles nothing.

Each stage's report (:func:`stage_report`, a
:class:`multislice.reports.PreflightReport`) states its units: bytes per
chip, with GiB (2**30 bytes; XLA's ``G``) for reading. A stage that fits also
gets an estimated step time, tokens/s/device and MFU from its compiled
program's costs (:mod:`.step_time`). The memory model and
the planner that searches fitting configs are :mod:`multislice.memory` and :mod:`.planner`.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from multislice import memory, storage
from multislice.errors import RunFailed
from multislice.heartbeat import heartbeat
from multislice.plan import Plan, StagePlan
from multislice.preflight import step_time
from multislice.reports import (
    CostEstimate,
    ElasticVerdict,
    HbmUse,
    PreflightReport,
    PreflightTarget,
    StepTimeEstimate,
)

GIB = 1024**3
AOT_MODULE = "multislice.trainer.aot"
RESULT_PREFIX = "AOT_RESULT "


class CompileSession(Protocol):
    """Where preflight's AOT compiles run: a trainer-environment process, or Jobs of the trainer image.

    Each backend gives one (:meth:`multislice.backends.base.Backend.aot_session`); defined here, by its user, so
    that preflight needs nothing of the backends.

    A context manager; :meth:`compile` answers one request of
    :func:`request_for` with the result dict of
    :mod:`multislice.trainer.aot`.
    """

    def __enter__(self) -> CompileSession: ...

    def __exit__(self, *exc: object) -> None: ...

    def compile(self, request: dict[str, Any], timeout: float) -> dict[str, Any]: ...


class PreflightError(RunFailed):
    """The AOT compile could not run or gave no verdict (not a does-not-fit); the message says why."""


class CompileTimeout(PreflightError):
    """An AOT compile ran past its time limit and was stopped (the session restarts for the next one)."""


class PreflightFailed(RunFailed):
    """A stage does not fit in HBM (or MaxText rejected its config); nothing was provisioned.

    ``reports`` holds every stage's report; the message gives the per-chip
    numbers and the nearest fitting alternative when one was found.
    """

    def __init__(self, message: str, reports: list[PreflightReport], fix: str = ""):
        super().__init__(message, fix)
        self.reports = reports


def gib(value: float | None) -> str:
    """Bytes as ``12.34 GiB``, or ``56.7 MiB`` below 1 GiB (None as ``?``)."""
    if value is None:
        return "?"
    return f"{value / GIB:.2f} GiB" if abs(value) >= GIB else f"{value / 2**20:.1f} MiB"


def default_cache_dir(plan: Plan) -> str:
    """The verdict cache of a plan: ``preflight.cache_dir``, else ``<output_dir>/preflight-cache`` (shared by runs)."""
    return plan.spec.preflight.cache_dir or f"{plan.spec.output_dir.rstrip('/')}/preflight-cache"


def user_cache_dir() -> str:
    """The CLI's verdict cache on this machine: ``$XDG_CACHE_HOME/multislice-pipelines/preflight``."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(base) / "multislice-pipelines" / "preflight")


def request_for(plan: Plan, stage: StagePlan) -> dict[str, Any]:
    """The AOT request of one stage: its MaxText arguments for ``num_slices`` x the slice's topology.

    ``libtpu_flags`` (name -> value) are the flags the stage's TPU pods get in ``LIBTPU_INIT_ARGS``
    (:mod:`multislice.libtpu_flags`): the compile process runs with the same ones, so the HBM figure is the
    run's and a flag libtpu does not know fails here.
    """
    return {
        "name": stage.name,
        "compile_topology": plan.spec.slice_type.maxtext_topology,
        "num_slices": plan.spec.num_slices,
        "maxtext_args": list(stage.maxtext_args),
        "libtpu_flags": dict(stage.libtpu_flags),
    }


#: What libtpu prints before exiting on a flag it does not know (libtpu 0.0.52).
UNKNOWN_FLAG = re.compile(r"Unknown command line flag '(?P<name>[^']+)'")


def unknown_flag_fix(log: str) -> str:
    """The fix for a compile that libtpu ended over an unknown flag (named in ``log``), or ``''``."""
    match = UNKNOWN_FLAG.search(log)
    if not match:
        return ""
    return (
        f"libtpu does not know the flag --{match.group('name')} (LIBTPU_INIT_ARGS): take it out of the profile's or "
        "the stage's libtpu_flags.add, or list it in libtpu_flags.remove if it comes from the recipe table "
        "(multislice.libtpu_flags), or use a libtpu version that has it"
    )


def compile_stage(
    plan: Plan, stage: StagePlan, session: CompileSession, timeout: float, tell: Callable[[str], object] | None
) -> dict[str, Any]:
    """``session.compile`` of the stage's request (:func:`request_for`); while it works, a line naming what
    compiles and for how long every 30 s (:func:`multislice.heartbeat.heartbeat`) through ``tell`` (none if None).
    """
    request = request_for(plan, stage)
    if tell is None:
        return session.compile(request, timeout=timeout)
    what = (
        f"AOT-compiling stage {stage.name} for {plan.spec.num_slices} x {plan.spec.tpu_type} "
        f"({plan.spec.slice_type.maxtext_topology}), at most {timeout:.0f} s"
    )
    with heartbeat(what, tell):
        return session.compile(request, timeout=timeout)


def cost_estimate(
    plan: Plan, stage: StagePlan, result: dict[str, Any], estimated: StepTimeEstimate | None = None
) -> CostEstimate | None:
    """Chip-hours and price of the stage's steps: one figure, from the step-time estimate when there is one.

    step seconds = the compiled program's estimated step time (``estimated``, :func:`step_time.estimate`, whose MFU
    the report carries) when there is one (``basis="step_time"``); else model TFLOP per step per chip x 1e12 /
    (peak bf16 FLOP/s per chip x the profile's ``cost.assumed_mfu``) (``basis="assumed_mfu"``).
    chip-hours = steps x step seconds x chips / 3600; cost = chip-hours x ``cost.price_per_chip_hour``.
    Returns None when the compile gave no FLOP count.
    """
    tflops = result.get("model_tflops_per_step_per_device")
    if not tflops:
        return None
    cost = plan.spec.cost
    peak = plan.spec.slice_type.peak_bf16_flops_per_chip
    if estimated is not None and estimated.step_seconds > 0:
        step_seconds, mfu, basis = estimated.step_seconds, estimated.mfu, "step_time"
    else:
        step_seconds, mfu, basis = tflops * 1e12 / (peak * cost.assumed_mfu), cost.assumed_mfu, "assumed_mfu"
    chip_hours = stage.steps * step_seconds * plan.total_chips / 3600
    return CostEstimate(
        basis=basis,
        assumed_mfu=cost.assumed_mfu if mfu is None else mfu,
        peak_bf16_flops_per_chip=peak,
        estimated_step_seconds=round(step_seconds, 3),
        steps=stage.steps,
        chips=plan.total_chips,
        chip_hours=float(f"{chip_hours:.4g}"),
        price_per_chip_hour=cost.price_per_chip_hour,
        currency=cost.currency,
        price_source=cost.price_source,
        estimated_cost=float(f"{chip_hours * cost.price_per_chip_hour:.4g}"),
    )


def stage_report(plan: Plan, stage: StagePlan, result: dict[str, Any]) -> PreflightReport:
    """The preflight report of one stage from its AOT result (:mod:`multislice.trainer.aot`'s dict).

    ``hbm_bytes_per_chip`` is what XLA lets a program use (the catalog's
    usable HBM, or the compiler's own figure when it reports one);
    ``headroom_bytes_per_chip`` is negative when the stage does not fit.
    """
    shape = plan.spec.slice_type
    available = shape.usable_hbm_bytes_per_chip
    verdict = result.get("verdict", "error")
    estimated = step_time.estimate(result, shape)
    fields: dict[str, Any] = {}
    if verdict == "fits":
        memory = HbmUse.model_validate(result["memory"])
        fields.update(bytes_per_chip=memory, headroom_bytes_per_chip=available - memory.total)
    elif verdict == "does_not_fit":
        oom = result.get("oom", {})
        available = oom.get("available_bytes") or available
        required = oom.get("required_bytes")
        fields.update(
            required_bytes_per_chip=required,
            headroom_bytes_per_chip=None if required is None else available - required,
            compiler_message=oom.get("message"),
        )
    else:
        verdict = "error"
        fields["error"] = result.get("error", "no verdict")
    return PreflightReport(
        stage=stage.name,
        verdict=verdict,
        target=PreflightTarget(
            tpu_type=shape.name,
            compile_topology=shape.maxtext_topology,
            num_slices=plan.spec.num_slices,
            chips=plan.total_chips,
        ),
        hbm_bytes_per_chip=available,
        compile_seconds=result.get("compile_seconds"),
        cached=bool(result.get("cached")),
        model_tflops_per_step_per_device=result.get("model_tflops_per_step_per_device"),
        tokens_per_step_per_device=result.get("tokens_per_step_per_device"),
        mesh=result.get("mesh"),
        versions=result.get("versions"),
        maxtext_args=result.get("maxtext_args", list(stage.maxtext_args)),
        cost=cost_estimate(plan, stage, result, estimated),
        step_time=estimated,
        **fields,
    )


def summary_line(report: PreflightReport) -> str:
    """One line for a stage's report: verdict and per-chip numbers with units."""
    if report.verdict == "skipped":
        return "skipped (skip_preflight=true): no AOT check of HBM use"
    hbm = report.hbm_bytes_per_chip
    target = report.target
    where = f"{target.num_slices} x {target.tpu_type}" if target else "?"
    took = f"{report.compile_seconds} s"
    took = f"from the cache (first compile {took})" if report.cached else took
    if report.verdict == "fits" and (b := report.bytes_per_chip) is not None:  # a fits report has its bytes
        line = (
            f"fits on {where}: {gib(b.total)} of {gib(hbm)} HBM per chip (arguments {gib(b.argument)}, "
            f"temporaries {gib(b.temp)}, outputs {gib(b.output)}, aliased {gib(b.alias)}, "
            f"code {gib(b.generated_code)}"
            + (f", host-offloaded {gib(b.host_argument + b.host_temp)}" if b.host_argument else "")
            + f"); headroom {gib(report.headroom_bytes_per_chip)}; compile {took}"
        )
    elif report.verdict == "does_not_fit":
        line = (
            f"does not fit on {where}: needs {gib(report.required_bytes_per_chip)} per chip, "
            f"{gib(hbm)} available (over by {gib(-(report.headroom_bytes_per_chip or 0))}); compile {took}"
        )
    else:
        line = f"no verdict on {where}: {(report.error or '')[:300]}"
    if report.step_time is not None:
        line += "; " + step_time.line(report.step_time)
    cost = report.cost
    if cost and report.verdict == "fits":
        basis = (
            "at that step time"
            if cost.basis == "step_time"
            else f"at an assumed {cost.assumed_mfu:.0%} MFU (no step-time estimate)"
        )
        line += (
            f"; about {cost.chip_hours:,.3g} chip-hours"
            + (f" ({cost.estimated_cost:,.3g} {cost.currency})" if cost.price_per_chip_hour else "")
            + f" for {cost.steps} steps {basis}"
        )
    if report.elastic:
        line += "; " + elastic_line(report.elastic)
    return line


def memory_floor_bytes(plan: Plan, stage: StagePlan, slices: int) -> int | None:
    """The memory model's lower bound of HBM per chip for ``stage`` on ``slices`` slices, bytes; None if unknown.

    :func:`multislice.memory.estimate`'s lower bound (parameters, moments, gradients), plus one more
    set of gradients when the count accumulates (MaxText's ``gradient_accumulation_loss_and_grad`` carries the
    running sum through its ``scan``, ``maxtext/utils/gradient_accumulation.py``).
    """
    spec_stage = plan.spec.stage(stage.name)
    dims = memory.model_dims(spec_stage)
    if dims is None:
        return None
    count = stage.on_slices(slices)
    found = memory.estimate(
        dims, memory.Knobs.from_stage(spec_stage, stage.ici, count.dcn), spec_stage.max_target_length
    )
    extra = found.parts["gradients"] if count.gradient_accumulation_steps > 1 else 0
    return found.lower_bound_bytes + extra


def check_elastic(
    plan: Plan,
    stage: StagePlan,
    session: CompileSession,
    timeout: float,
    tell: Callable[[str], object] | None = None,
) -> list[ElasticVerdict]:
    """Verdicts for every slice count an elastic stage may shrink to, most slices first (``[]`` if not elastic).

    ``tell`` gets a heartbeat line every 30 s of each compile (:func:`compile_stage`).

    The full count is the stage's own report. Each smaller runnable count is first checked against the memory
    model's lower bound (:func:`memory_floor_bytes`): over the usable HBM, it is ``does_not_fit`` without a
    compile; otherwise it is AOT-compiled for that many slices of the topology, with its gradient accumulation.
    """
    usable = plan.slice.usable_hbm_bytes_per_chip
    verdicts = []
    for count in stage.elastic:
        if count.slices == plan.spec.num_slices:
            continue
        known = {
            "slices": count.slices,
            "gradient_accumulation_steps": count.gradient_accumulation_steps,
            "global_batch_size": count.global_batch_size,
        }
        if not count.runnable:
            verdicts.append(ElasticVerdict(**known, verdict="not_runnable", source="plan", reason=count.reason))
            continue
        floor = memory_floor_bytes(plan, stage, count.slices)
        if floor is not None and floor > usable:
            verdicts.append(
                ElasticVerdict(
                    **known,
                    verdict="does_not_fit",
                    source="memory_model",
                    used_bytes_per_chip=floor,
                    headroom_bytes_per_chip=usable - floor,
                    reason=f"the memory model's lower bound is {gib(floor)} per chip, over the {gib(usable)} usable",
                )
            )
            continue
        smaller, target = plan.on_slices(stage, count.slices)
        report = stage_report(smaller, target, compile_stage(smaller, target, session, timeout, tell))
        verdicts.append(
            ElasticVerdict(
                **known,
                verdict=report.verdict if report.verdict != "skipped" else "error",
                used_bytes_per_chip=report.used_bytes_per_chip,
                headroom_bytes_per_chip=report.headroom_bytes_per_chip,
                compile_seconds=report.compile_seconds,
                cached=report.cached,
                reason=report.error or report.compiler_message,
            )
        )
    return verdicts


def elastic_line(verdicts: list[ElasticVerdict]) -> str:
    """The elastic counts' verdicts in one line, e.g. ``on 1 slice (gradient accumulation 2): fits, 22.9 GiB``."""
    parts = []
    for v in verdicts:
        head = f"on {v.slices} slice" + ("s" if v.slices != 1 else "")
        head += f" (gradient_accumulation_steps {v.gradient_accumulation_steps})"
        if v.verdict == "fits":
            parts.append(f"{head}: fits, {gib(v.used_bytes_per_chip)} per chip" + (" (cached)" if v.cached else ""))
        elif v.verdict == "does_not_fit":
            how = "memory model" if v.source == "memory_model" else "AOT"
            parts.append(f"{head}: does not fit ({how}: needs {gib(v.used_bytes_per_chip)} per chip)")
        else:
            parts.append(f"{head}: {v.verdict.replace('_', ' ')} ({(v.reason or '')[:200]})")
    return "elastic: " + "; ".join(parts)


def check_stages(
    plan: Plan,
    stages: list[StagePlan],
    session: CompileSession,
    timeout: float,
    on_report: Callable[[PreflightReport], None] | None = None,
    tell: Callable[[str], object] | None = None,
) -> list[PreflightReport]:
    """AOT-compile each stage in ``session`` (each within ``timeout`` seconds); their reports in order.

    ``tell`` gets a line naming the stage compiling and its elapsed time every 30 s while it compiles
    (:func:`compile_stage`); a compile takes minutes on a loaded machine.
    """
    reports = []
    for stage in stages:
        report = stage_report(plan, stage, compile_stage(plan, stage, session, timeout, tell))
        if stage.elastic and report.verdict == "fits":
            report = report.model_copy(update={"elastic": check_elastic(plan, stage, session, timeout, tell)})
        reports.append(report)
        if on_report:
            on_report(report)
    return reports


def work_dir_for(plan: Plan) -> Path:
    """Local scratch for compiles on this machine: in the run directory when it is local, else a temporary one.

    The temporary one is new for each call (``<TMPDIR>/multislice-preflight/<run_name>-XXXX``): two processes
    checking the same profile at once (a CLI preflight beside a test, or two CI jobs) must not read each
    other's results file.
    """
    if not storage.is_remote(plan.run_dir):
        return Path(plan.run_dir) / "preflight"
    base = Path(os.environ.get("TMPDIR", "/tmp")) / "multislice-preflight"
    base.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f"{plan.spec.run_name}-", dir=base))
