"""The pipeline's steps, one module each, named as in the pipeline graph.

plan -> provision -> for each stage: admit -> launch -> train -> verify_checkpoint;
cleanup runs last whatever happened (exit handler).

Each step is a plain function over JSON-able values, called by a thin KFP
component in ``components/`` (and directly by tests). A step prints progress
lines as ``[<step> <stage>] message`` and writes its report as JSON under the
run directory, ``<run_dir>/reports/<stage>/<step>.json``, which is what the
CLI's summary reads.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from multislice.plan import Plan, StagePlan


def say(step: str, message: str, stage: str | None = None) -> None:
    """Print one progress line for the step, flushed at once."""
    where = f"{step} {stage}" if stage else step
    print(f"[{where}] {message}", flush=True)
    sys.stdout.flush()


def is_local_path(path: str) -> bool:
    """True unless the path is a URL such as ``gs://``."""
    return "://" not in path


def report_path(plan: Plan, step: str, stage: StagePlan | None = None) -> Path:
    """Where a step's report goes: ``<run_dir>/reports/[<stage>/]<step>.json``."""
    base = Path(plan.run_dir) / "reports"
    return (base / stage.name if stage else base) / f"{step}.json"


def write_report(plan: Plan, step: str, report: dict[str, Any], stage: StagePlan | None = None) -> dict[str, Any]:
    """Write a step's report under the run directory (local runs) and return it."""
    if is_local_path(plan.run_dir):
        path = report_path(plan, step, stage)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")
    return report


def latest_committed_step(checkpoint_dir: str) -> int | None:
    """Newest checkpoint step that Orbax committed, for a local directory; None if none.

    A committed step is a directory named by the step number holding
    ``commit_success.txt`` (Orbax renames its temporary directory into place
    and writes the marker on commit).
    """
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return None
    steps = [int(p.name) for p in root.iterdir() if p.name.isdigit() and (p / "commit_success.txt").is_file()]
    return max(steps) if steps else None


def gke_api(plan: Plan, step: str, stage: StagePlan | None = None, kube: Any = None, timings: Any = None) -> Any:
    """The GKE backend's API client for a step: ``kube`` when given (tests), else one from ``plan.spec.cluster``.

    Raises:
        multislice.backends.gke.access.ClusterAccessError: the cluster cannot be reached as configured.
    """
    if kube is not None:
        return kube
    from multislice.backends import backend_for

    return backend_for(
        "gke", plan.run_dir, cluster=plan.spec.cluster, namespace=plan.spec.namespace, timings=timings,
        say=lambda message: say(step, message, stage.name if stage else None),
    )  # fmt: skip
