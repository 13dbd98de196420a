"""preflight: AOT-compile every stage for the target TPU topology; fail before provision if one does not fit.

Runs after plan and before provision, so no node pool is asked for and no TPU
hour is spent on a config that cannot work. For each stage it writes a report
(:class:`multislice.reports.PreflightReport`: verdict, bytes per chip, HBM per
chip, headroom, compile seconds, model FLOPs, cost estimate, the exact MaxText
arguments) to ``reports/<stage>/preflight.json``. When a stage does not fit,
the planner looks for the nearest config that does (fewest changes, AOT-verified)
and the step fails with the numbers and that alternative. A pipeline parameter
(``skip_preflight``) skips it.

The compiles run where the backend runs trainer-image work
(:meth:`multislice.backends.base.Backend.aot_session`): a trainer-environment
process of this machine (local), or one Job of the trainer image per compile
on a CPU node (GKE). The CLI compiles on this machine whatever the profile's
backend (``multislice preflight``), unless told ``--on-cluster``.
"""

from __future__ import annotations

from multislice import cancel
from multislice.backends import Backend
from multislice.delivery import artifacts
from multislice.plan import Plan, StagePlan
from multislice.preflight import PreflightFailed, check_stages, default_cache_dir, planner, summary_line
from multislice.reports import PreflightReport, report_path
from multislice.steps import backend_of, cancellable, say, teller, write_report


def alternative_message(
    plan: Plan, report: PreflightReport, session, budget_seconds: float, timeout: float
) -> tuple[str, dict | None]:
    """Search the nearest fitting config to a stage that does not fit; returns (message, candidate data)."""
    spec = plan.spec
    stage = spec.stage(report.stage)
    found = planner.search(
        spec,
        stage,
        session,
        want=1,
        nearest=True,
        budget_seconds=budget_seconds,
        compile_timeout=timeout,
        on_progress=lambda line: say("preflight", f"alternative search: {line}", stage.name),
    )
    if found.fitting:
        best = found.fitting[0]
        # A fitting candidate carries its AOT report, and a report that fits its bytes per chip.
        assert best.report is not None and best.report.bytes_per_chip is not None
        hbm = best.report.bytes_per_chip.total
        return (
            f"nearest fitting alternative (AOT-verified, {hbm / 2**30:.2f} GiB per chip): "
            + "; ".join(best.changes)
            + f" -- i.e. {best.describe()}",
            best.as_dict(),
        )
    why = "time budget spent" if not found.exhausted else f"no config fits on up to {found.slices_tried[-1]} slices"
    return f"no fitting alternative found ({why}); run `multislice plan` for a wider search", None


def run(
    plan: Plan,
    stages: list[StagePlan] | None = None,
    pipeline_run_id: str = "manual",
    *,
    backend: Backend | None = None,
    cache_dir: str | None = None,
    write_reports: bool = True,
) -> dict[str, PreflightReport]:
    """Check every stage of the plan (or ``stages``); returns ``{stage name: report}``.

    Args:
        plan: The plan.
        stages: The stages to check; default all of the plan's.
        pipeline_run_id: Labels the compile Jobs on GKE (cleanup deletes them with the run's other objects).
        backend: Where the compiles run (:meth:`~multislice.backends.base.Backend.aot_session`); default the plan's.
        cache_dir: The verdict cache (local or ``gs://``); default :func:`multislice.preflight.default_cache_dir`.
        write_reports: Write each stage's report to the run directory (the CLI, which is no run, does not).

    Raises:
        multislice.preflight.PreflightFailed: a stage does not fit, or MaxText rejected its config.
        multislice.preflight.PreflightError: the compile could not run.
        multislice.backends.local.TrainerEnvMissing: (local) no trainer environment.
    """
    stages = stages if stages is not None else plan.stages
    if plan.spec.preflight.skip:
        say("preflight", "skipped (skip_preflight=true): no AOT check of HBM use before provision")
        return {s.name: write_report(plan, PreflightReport(stage=s.name, verdict="skipped"), s) for s in stages}
    with cancellable("preflight", plan=plan, run_id=pipeline_run_id) as removal:
        removal.backend = backend = backend_of(plan, backend, "preflight")
        cache = cache_dir or default_cache_dir(plan)
        timings = backend.timings
        say(
            "preflight",
            f"AOT-compiling {len(stages)} stage(s) for {plan.spec.num_slices} x {plan.spec.tpu_type} "
            f"({plan.spec.slice_type.maxtext_topology} x {plan.spec.num_slices}) on the {backend.name} backend; "
            f"verdict cache {cache}",
        )
        with backend.aot_session(plan, cache, pipeline_run_id, teller("preflight")) as session:
            found = check_stages(
                plan, stages, session, timings.compile_timeout,
                on_report=lambda r: say("preflight", summary_line(r), r.stage), tell=teller("preflight"),
            )  # fmt: skip
            reports, problems = [], []
            for report in found:
                if report.verdict != "fits":
                    line = f"stage {report.stage}: {summary_line(report)}"
                    if report.verdict == "does_not_fit" and plan.spec.preflight.suggest_alternative:
                        message, alternative = alternative_message(
                            plan, report, session, timings.alternative_budget, timings.compile_timeout
                        )
                        report = report.model_copy(update={"alternative": alternative})
                        line += f"\n    {message}"
                    problems.append(line)
                shrinks = [v for v in report.elastic if v.verdict in ("does_not_fit", "error")]
                if shrinks:
                    problems.append(
                        f"stage {report.stage} cannot shrink to "
                        + ", ".join(f"{v.slices} slice(s) ({v.verdict.replace('_', ' ')})" for v in shrinks)
                        + f": set elastic.min_slices to {max(v.slices for v in shrinks) + 1} "
                        "(or remove elastic) so that a shrink never meets an HBM OOM"
                    )
                reports.append(report)
        cancel.point("preflight:report")
        by_name = {s.name: s for s in stages}
        for report in reports if write_reports else []:
            write_report(plan, report, by_name[report.stage])
        if problems:
            raise PreflightFailed(
                "preflight: not every stage fits in HBM, so nothing was provisioned:\n  " + "\n  ".join(problems),
                reports,
                "change the stage (per_device_batch_size, remat_policy, ici/dcn, maxtext_overrides) and rerun, "
                "or set skip_preflight=true to provision anyway",
            )
        return {r.stage: r for r in reports}


#: Columns of the HBM table in the pipelines UI: key -> header.
PAGE_COLUMNS = {
    "stage": "stage",
    "verdict": "verdict",
    "target": "target",
    "hbm_gib": "HBM per chip (GiB)",
    "usable_gib": "usable per chip (GiB)",
    "headroom_gib": "headroom (GiB)",
    "argument_gib": "arguments (GiB)",
    "temp_gib": "temporaries (GiB)",
    "host_gib": "host-offloaded (GiB)",
    "compile_seconds": "compile (s)",
    "cached": "from cache",
    "step_seconds": "step (s, est.)",
    "tokens_per_second": "tokens/s/device (est.)",
    "mfu": "MFU (est.)",
    "bound": "bound by",
    "chip_hours": "chip-hours (est.)",
    "cost": "cost (est.)",
}


def result_page(plan: Plan, reports: list[PreflightReport]) -> str:
    """An HTML page with a table of HBM use per stage (GiB per chip) for the pipelines UI.

    Also written to ``<run_dir>/reports/<stage>/preflight.html`` for each stage.
    """

    def gib(value: float | None) -> float | None:
        return None if value is None else round(value / 2**30, 2)

    rows = []
    for r in reports:
        used = r.bytes_per_chip
        cost = r.cost
        est = r.step_time
        rows.append(
            {
                "stage": r.stage,
                "verdict": r.verdict,
                "target": f"{r.target.num_slices} x {r.target.tpu_type}" if r.target else "",
                "hbm_gib": gib(r.used_bytes_per_chip),
                "usable_gib": gib(r.hbm_bytes_per_chip),
                "headroom_gib": gib(r.headroom_bytes_per_chip),
                "argument_gib": gib(used.argument) if used else None,
                "temp_gib": gib(used.temp) if used else None,
                "host_gib": gib(used.host_argument + used.host_temp) if used else None,
                "compile_seconds": r.compile_seconds,
                "cached": r.cached,
                "step_seconds": est.step_seconds if est else None,
                "tokens_per_second": est.tokens_per_second_per_device if est else None,
                "mfu": f"{est.mfu:.1%}" if est and est.mfu is not None else "",
                "bound": est.bound if est else "",
                "chip_hours": cost.chip_hours if cost else None,
                "cost": f"{cost.estimated_cost:,.2f} {cost.currency}" if cost and cost.price_per_chip_hour else "",
            }
        )
    note = (
        "<p>AOT compile of each stage's train step for its TPU topology (MaxText train_compile, libtpu); "
        "GiB = 2<sup>30</sup> bytes. Cost: the estimated step time x steps x chips x price per chip-hour from "
        "the profile (without a step-time estimate: model FLOPs / (peak bf16 FLOP/s x the profile's assumed "
        "MFU) as the step time). Step time: the compiled program's roofline (FLOPs, HBM bytes, "
        "ICI and DCN collectives over the generation's peak figures, overlapped) over an efficiency fitted on "
        "MaxText's published recipe runs.</p>"
    )
    page = artifacts.html_page("preflight: HBM per chip", note + artifacts.html_table(rows, PAGE_COLUMNS))
    for r in reports:
        artifacts.write_text(report_path(plan, "preflight.html", r.stage), page)
    return page
