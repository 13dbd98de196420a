"""preflight: AOT-compile every stage for the target TPU topology; fail before provision if one does not fit.

Runs after plan and before provision, so no node pool is asked for and no TPU
hour is spent on a config that cannot work. For each stage it writes a report
(:func:`multislice.preflight.stage_report`: verdict, bytes per chip, HBM per
chip, headroom, compile seconds, model FLOPs, cost estimate, the exact MaxText
arguments) to ``reports/<stage>/preflight.json``. When a stage does not fit,
the planner looks for the nearest config that does (fewest changes, AOT-verified)
and the step fails with the numbers and that alternative. A pipeline parameter
(``skip_preflight``) skips it.

The compiles run where MaxText and libtpu are: on the local backend a process
of this machine's trainer environment (``.venvs/trainer``); on GKE one Job of
the trainer image per compile, on a CPU node (:mod:`multislice.backends.gke.aot`).
"""

from __future__ import annotations

from typing import Any

from multislice.plan import Plan, StagePlan
from multislice.preflight import (
    AotSession,
    PreflightFailed,
    check_stages,
    default_cache_dir,
    planner,
    summary_line,
    work_dir_for,
)
from multislice.steps import gke_api, is_local_path, report_path, say, write_report

#: Seconds the nearest-alternative search may spend compiling.
ALTERNATIVE_BUDGET_SECONDS = 600


def alternative_message(plan: Plan, report: dict[str, Any], session: AotSession) -> tuple[str, dict | None]:
    """Search the nearest fitting config to a stage that does not fit; returns (message, candidate data)."""
    spec = plan.spec
    stage = spec.stage(report["stage"])
    found = planner.search(
        spec,
        stage,
        session,
        want=1,
        nearest=True,
        budget_seconds=ALTERNATIVE_BUDGET_SECONDS,
        on_progress=lambda line: say("preflight", f"alternative search: {line}", stage.name),
    )
    if found.fitting:
        best = found.fitting[0]
        hbm = best.report["bytes_per_chip"]["total"]
        return (
            f"nearest fitting alternative (AOT-verified, {hbm / 2**30:.2f} GiB per chip): "
            + "; ".join(best.changes)
            + f" -- i.e. {best.describe()}",
            best.as_dict(),
        )
    why = "time budget spent" if not found.exhausted else f"no config fits on up to {found.slices_tried[-1]} slices"
    return f"no fitting alternative found ({why}); run `multislice plan` for a wider search", None


def session_for(plan: Plan, pipeline_run_id: str, kube: Any = None, timings: Any = None):
    """Where the compiles run: a trainer-environment process (local), or Jobs of the trainer image (gke)."""
    if plan.spec.backend == "gke":
        from multislice.backends.gke.aot import JobAotSession

        api = gke_api(plan, "preflight", None, kube, timings)
        return JobAotSession(api, plan, default_cache_dir(plan), pipeline_run_id, lambda m: say("preflight", m))
    return AotSession(default_cache_dir(plan), work_dir_for(plan))


def run(
    plan: Plan,
    stages: list[StagePlan] | None = None,
    pipeline_run_id: str = "manual",
    *,
    kube: Any = None,
    timings: Any = None,
) -> dict[str, Any]:
    """Check every stage of the plan (or ``stages``); returns ``{stage name: report}``.

    ``pipeline_run_id`` labels the GKE Jobs (cleanup deletes them with the run's
    other objects); ``kube`` and ``timings`` are for tests of the GKE path.

    Raises:
        multislice.preflight.PreflightFailed: a stage does not fit, or MaxText rejected its config.
        multislice.preflight.PreflightError: the compile could not run.
        multislice.backends.local.TrainerEnvMissing: no trainer environment.
    """
    stages = stages if stages is not None else plan.stages
    if plan.spec.preflight.skip:
        say("preflight", "skipped (skip_preflight=true): no AOT check of HBM use before provision")
        return {s.name: write_report(plan, "preflight", {"stage": s.name, "verdict": "skipped"}, s) for s in stages}
    cache = default_cache_dir(plan)
    say(
        "preflight",
        f"AOT-compiling {len(stages)} stage(s) for {plan.spec.num_slices} x {plan.spec.tpu_type} "
        f"({plan.spec.slice_type.maxtext_topology} x {plan.spec.num_slices}); verdict cache {cache}",
    )
    with session_for(plan, pipeline_run_id, kube, timings) as session:
        reports = check_stages(plan, stages, session, on_report=lambda r: say("preflight", summary_line(r), r["stage"]))
        failed = [r for r in reports if r["verdict"] != "fits"]
        problems = []
        for report in failed:
            line = f"stage {report['stage']}: {summary_line(report)}"
            if report["verdict"] == "does_not_fit" and plan.spec.preflight.suggest_alternative:
                message, alternative = alternative_message(plan, report, session)
                report["alternative"] = alternative
                line += f"\n    {message}"
            problems.append(line)
    by_name = {s.name: s for s in stages}
    for report in reports:
        write_report(plan, "preflight", report, by_name[report["stage"]])
    if problems:
        raise PreflightFailed(
            "preflight: not every stage fits in HBM, so nothing was provisioned:\n  "
            + "\n  ".join(problems)
            + "\nChange the stage (per_device_batch_size, remat_policy, ici/dcn, maxtext_overrides) and rerun, "
            "or set skip_preflight=true to provision anyway.",
            reports,
        )
    return {r["stage"]: r for r in reports}


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
    "chip_hours": "chip-hours (est.)",
    "cost": "cost (est.)",
}


def result_page(plan: Plan, reports: list[dict[str, Any]]) -> str:
    """An HTML page with a table of HBM use per stage (GiB per chip) for the pipelines UI.

    Also written to ``<run_dir>/reports/<stage>/preflight.html`` for a local run directory.
    """
    from multislice.delivery import artifacts

    def gib(value: float | None) -> float | None:
        return None if value is None else round(value / 2**30, 2)

    rows = []
    for r in reports:
        used = r.get("bytes_per_chip", {})
        cost = r.get("cost") or {}
        target = r.get("target", {})
        rows.append(
            {
                "stage": r["stage"],
                "verdict": r["verdict"],
                "target": f"{target.get('num_slices')} x {target.get('tpu_type')}" if target else "",
                "hbm_gib": gib(used.get("total") or r.get("required_bytes_per_chip")),
                "usable_gib": gib(r.get("hbm_bytes_per_chip")),
                "headroom_gib": gib(r.get("headroom_bytes_per_chip")),
                "argument_gib": gib(used.get("argument")),
                "temp_gib": gib(used.get("temp")),
                "host_gib": gib((used.get("host_argument", 0) + used.get("host_temp", 0)) if used else None),
                "compile_seconds": r.get("compile_seconds"),
                "cached": r.get("cached"),
                "chip_hours": cost.get("chip_hours"),
                "cost": f"{cost['estimated_cost']:,.2f} {cost['currency']}" if cost.get("price_per_chip_hour") else "",
            }
        )
    note = (
        "<p>AOT compile of each stage's train step for its TPU topology (MaxText train_compile, libtpu); "
        "GiB = 2<sup>30</sup> bytes. Cost: model FLOPs / (peak bf16 FLOP/s x assumed MFU) x steps x chips x "
        "price per chip-hour from the profile.</p>"
    )
    page = artifacts.html_page("preflight: HBM per chip", note + artifacts.html_table(rows, PAGE_COLUMNS))
    if is_local_path(plan.run_dir):
        for r in reports:
            artifacts.write_text(report_path(plan, "preflight", plan.stage(r["stage"])).with_suffix(".html"), page)
    return page
