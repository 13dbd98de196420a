"""Elastic training's arithmetic: which slice counts a stage can train on, and how it keeps its global batch on each.

A stage with ``elastic: {min_slices, max_slices, ...}`` (:class:`multislice.config.ElasticSpec`) trains on
``N = num_slices`` slices when it can and on any runnable ``k`` in ``[min_slices, N]`` when slices are lost
(Spot preemption, node-pool repair). On ``k`` slices:

- the DCN degrees are resolved for ``k`` slices (the ``-1`` axis, by default ``data``, takes ``k / fixed``);
  a stage whose DCN axes are all fixed runs on their product only;
- MaxText's ``gradient_accumulation_steps`` is multiplied by ``N / k``. MaxText's batch arithmetic
  (``maxtext/configs/types.py``, ``calculate_global_batch_sizes``) is ``global_batch_size_to_train_on =
  per_device_batch_size x devices x gradient_accumulation_steps``, so with ``k x chips`` devices and
  ``N / k`` micro-batches the global batch is unchanged, and so are the step sequence and the learning-rate
  schedule (both count optimizer steps). Under manual accumulation MaxText sums the micro-batches' token
  losses and divides by the whole batch's token count (``maxtext/utils/gradient_accumulation.py``), so the
  update equals the one ``N`` slices compute, up to floating-point summation order.

When ``N / k`` is not whole, ``on_indivisible`` decides: ``wait`` (``k`` is not runnable) or
``shrink_batch`` (``floor(N / k)`` micro-batches: a smaller global batch, said so).

Pure functions of the spec: no file, process or API is touched. The config checks (:func:`elastic_issues`) and the
plan (:func:`slice_counts`) use them; the resize policy that acts on them at run time is :mod:`multislice.elastic`.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, ConfigDict

from multislice import maxtext
from multislice.config.models import RunSpec, Stage

#: MaxText's key for micro-batches per step (``maxtext/configs/base.yml``: ``gradient_accumulation_steps: 1``).
GRADIENT_ACCUMULATION_KEY = "gradient_accumulation_steps"


class SliceCount(BaseModel):
    """How a stage trains on ``slices`` slices (one entry of :func:`slice_counts`).

    Attributes:
        slices: Slices (JobSet replicated-job replicas).
        runnable: Whether the stage may train on this many.
        reason: Why not (``runnable`` false), or what changes (a smaller global batch); '' otherwise.
        dcn: Every DCN axis degree for this count, -1 resolved (empty when not runnable).
        gradient_accumulation_steps: MaxText micro-batches per step on this count.
        global_batch_size: Sequences per optimizer step on this count.
        keeps_global_batch: The global batch equals the full-size one.
        maxtext_args: The stage's MaxText arguments on this count (set by :func:`multislice.plan.make_plan`).
    """

    model_config = ConfigDict(frozen=True)

    slices: int
    runnable: bool
    reason: str = ""
    dcn: dict[str, int] = {}
    gradient_accumulation_steps: int = 1
    global_batch_size: float = 0
    keeps_global_batch: bool = True
    maxtext_args: list[str] = []


def base_accumulation(stage: Stage) -> int:
    """The stage's own ``gradient_accumulation_steps`` (from ``maxtext_overrides``; MaxText's default 1)."""
    value = stage.maxtext_overrides.get(GRADIENT_ACCUMULATION_KEY, 1)
    try:  # validated against MaxText's schema (a positive integer, maybe written as "2" or 2.0)
        return max(1, int(float(str(value))))
    except ValueError:
        return 1


def _dcn_for(stage: Stage, slices: int) -> tuple[dict[str, int] | None, str]:
    degrees = stage.full_dcn()
    fixed = math.prod(d for d in degrees.values() if d != -1)
    described = " x ".join(f"{axis}={degree}" for axis, degree in degrees.items())
    if -1 in degrees.values():
        if slices % fixed:
            return None, f"DCN {described}: the other axes multiply to {fixed}, which does not divide {slices} slices"
    elif fixed != slices:
        return None, f"DCN {described} multiplies to {fixed}, not {slices} slices (no -1 axis to fill)"
    full = {axis: 1 for axis in maxtext.PARALLELISM_AXES}
    full.update(degrees)
    return {axis: (slices // fixed if degree == -1 else degree) for axis, degree in full.items()}, ""


def slice_count(spec: RunSpec, stage: Stage, slices: int) -> SliceCount:
    """How ``stage`` of ``spec`` trains on ``slices`` slices (``maxtext_args`` left empty)."""
    full = spec.num_slices
    elastic = stage.elastic
    chips = spec.slice_type.chips
    base = base_accumulation(stage)
    full_batch = stage.per_device_batch_size * chips * full * base
    dcn, problem = _dcn_for(stage, slices)
    if dcn is None:
        return SliceCount(slices=slices, runnable=False, reason=problem)
    micro = stage.per_device_batch_size * chips * slices
    if not math.isclose(micro, round(micro), rel_tol=1e-9) or round(micro) < 1:
        return SliceCount(
            slices=slices,
            runnable=False,
            reason=f"per_device_batch_size {stage.per_device_batch_size:g} x {chips * slices} chips is "
            f"{micro:g} sequences, not a whole micro-batch",
        )
    if full % slices == 0:
        steps = base * full // slices
        return SliceCount(
            slices=slices, runnable=True, dcn=dcn, gradient_accumulation_steps=steps, global_batch_size=full_batch
        )
    if elastic is None or elastic.on_indivisible == "wait":
        return SliceCount(
            slices=slices,
            runnable=False,
            reason=f"{full} slices / {slices} is not whole, so gradient accumulation cannot keep the global batch "
            f"of {full_batch:g} (on_indivisible: wait)",
        )
    steps = base * (full // slices)
    batch = micro * steps
    return SliceCount(
        slices=slices,
        runnable=True,
        reason=f"global batch {batch:g} instead of {full_batch:g} sequences (on_indivisible: shrink_batch)",
        dcn=dcn,
        gradient_accumulation_steps=steps,
        global_batch_size=batch,
        keeps_global_batch=False,
    )


def slice_counts(spec: RunSpec, stage: Stage) -> list[SliceCount]:
    """Every slice count of an elastic stage, ``max_slices`` first down to ``min_slices``; ``[]`` when not elastic."""
    if stage.elastic is None:
        return []
    low = min(stage.elastic.min_slices, spec.num_slices)
    return [slice_count(spec, stage, k) for k in range(spec.num_slices, low - 1, -1)]


def elastic_data_issue(stage: Stage) -> str | None:
    """Why an elastic stage's grain data could not restore its position after a resize, or None.

    An elastic stage on grain data reads through grain's ``ElasticIterator`` (:func:`multislice.plan.
    elastic_iterator_args`), which MaxText 0.2.5 allows on ArrayRecord files only (Parquet and TFRecord are read
    through ``InterleaveIterDataset``, which the iterator forbids) and without a mixture (``configs/types.py``,
    the ``grain_use_elastic_iterator`` checks). ``tfds`` data is read as grain over TFRecord here.
    """
    source = stage.data
    kind = getattr(source, "kind", None)
    if kind == "tfds" or (kind == "grain" and getattr(source, "file_type", "arrayrecord") != "arrayrecord"):
        shown = "tfds (grain over TFRecord)" if kind == "tfds" else f"grain {getattr(source, 'file_type', '')}"
        return (
            f"an elastic stage restores its data position after a resize with grain's ElasticIterator, which "
            f"MaxText 0.2.5 allows on ArrayRecord files only, not {shown}; convert the data to ArrayRecord "
            "(or give kind: text, which prepare_data writes as ArrayRecord), or drop elastic"
        )
    if kind == "grain" and ";" in getattr(source, "train_files", ""):
        return (
            "an elastic stage restores its data position after a resize with grain's ElasticIterator, which "
            "MaxText 0.2.5 does not allow on a mixture (';' in train_files); give one glob, or drop elastic"
        )
    return None


def elastic_issues(spec: RunSpec, stage: Stage, where: str) -> list[tuple[str, str]]:
    """Cross-field checks of a stage's ``elastic``: ``(field, message)`` pairs, empty when fine.

    ``max_slices`` must equal ``num_slices``; ``min_slices`` must be runnable (a floor the stage can train
    on). Counts in between that cannot run are not errors: :func:`slice_counts` says which and why, and the
    stage never relaunches on them.
    """
    elastic = stage.elastic
    if elastic is None:
        return []
    issues = []
    if problem := elastic_data_issue(stage):
        issues.append((f"{where}.data", problem))
    if elastic.max_slices is not None and elastic.max_slices != spec.num_slices:
        issues.append(
            (
                f"{where}.elastic.max_slices",
                f"max_slices {elastic.max_slices} is not num_slices ({spec.num_slices}): a stage grows back to the "
                f"profile's slices; set max_slices to {spec.num_slices} or leave it out",
            )
        )
    if elastic.min_slices > spec.num_slices:
        issues.append(
            (
                f"{where}.elastic.min_slices",
                f"min_slices {elastic.min_slices} exceeds num_slices ({spec.num_slices}); make it at most "
                f"{spec.num_slices}",
            )
        )
        return issues
    floor = slice_count(spec, stage, elastic.min_slices)
    if not floor.runnable and elastic.min_slices != spec.num_slices:
        runnable = [c.slices for c in slice_counts(spec, stage) if c.runnable and c.slices < spec.num_slices]
        hint = f"set min_slices to {min(runnable)}" if runnable else "set dcn so that a -1 axis (data) fills the slices"
        issues.append(
            (
                f"{where}.elastic.min_slices",
                f"the stage cannot train on min_slices={elastic.min_slices}: {floor.reason}; {hint}",
            )
        )
    return issues


def describe(counts: list[SliceCount]) -> str:
    """One line per count, e.g. ``1 slice: gradient_accumulation_steps 2, global batch 64``."""
    lines = []
    for count in counts:
        head = f"{count.slices} slice" + ("s" if count.slices != 1 else "")
        if not count.runnable:
            lines.append(f"{head}: cannot run ({count.reason})")
            continue
        line = f"{head}: gradient_accumulation_steps {count.gradient_accumulation_steps}, global batch "
        line += f"{count.global_batch_size:g}" + (f" ({count.reason})" if count.reason else " (unchanged)")
        lines.append(line)
    return "\n".join(lines)


def to_data(counts: list[SliceCount]) -> list[dict[str, Any]]:
    """Plain data for reports (without the argument lists)."""
    return [c.model_dump(exclude={"maxtext_args"}) for c in counts]
