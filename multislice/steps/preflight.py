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

from multislice import planner
from multislice.plan import Plan, StagePlan
from multislice.preflight import (
    AotSession,
    PreflightFailed,
    check_stages,
    default_cache_dir,
    summary_line,
    work_dir_for,
)
from multislice.steps import gke_api, say, write_report

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
