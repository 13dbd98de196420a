"""The planner: find stage configs that fit in HBM, verified by AOT compile, ranked by estimated speed.

Given a stage (its model, sequence length and, optionally, a target global
batch) and a slice shape, the planner enumerates the knobs that decide HBM
use: per-device batch, remat policy, the ICI split of FSDP and tensor
parallelism, the DCN split of FSDP and data parallelism, AdamW and parameter
host offload (parameter offload with ``param_scan_axis=0``, which MaxText
requires for it) and the weight dtype. The analytic model
(:mod:`multislice.memory`) prunes every candidate whose *lower bound* exceeds
the HBM XLA allows per chip, and orders the rest, likeliest fits first (its
estimate widened by its error on recorded compiles, :func:`fit_class`); they
are AOT-compiled (:mod:`multislice.preflight`) in that order until enough are
verified or the time budget is spent. Fitting configs are ranked by the MFU of
their step-time estimate (:mod:`multislice.preflight.step_time`: a roofline of the
compiled program's FLOPs, HBM bytes and ICI/DCN collectives, calibrated on
MaxText's published recipe runs), then tokens per step per chip.

If nothing fits on the requested slice count, the planner tries more slices,
up to ``max_slices``, and reports the fewest that fit. Every verdict goes
through the preflight cache, so a second search is fast.

Before a candidate is compiled there is no program to estimate from: the
compile order uses a heuristic MFU (:func:`estimated_mfu`), not a
measurement: a base MFU times a factor per knob that costs compute or
communication (recomputation under remat, tensor-parallel collectives, FSDP
all-gathers over DCN, host-offload transfers, small per-chip batches).
"""

from __future__ import annotations

import itertools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from multislice import memory
from multislice.config import RunSpec, Stage
from multislice.heartbeat import heartbeat
from multislice.plan import make_plan, resolve_degrees
from multislice.preflight import CompileSession, CompileTimeout, request_for, stage_report
from multislice.reports import PreflightReport

#: Remat policies the planner tries, from least memory (most recompute) to most.
REMAT_CHOICES = ("full", "save_qkv_proj", "save_dot_except_mlp", "minimal")
#: Fraction of the forward pass recomputed in the backward pass under each policy, for the MFU heuristic.
RECOMPUTE = {"full": 1.0, "save_qkv_proj": 0.8, "save_dot_except_mlp": 0.6, "minimal": 0.25}
PER_DEVICE_BATCH_CHOICES = (1, 2, 4, 8)
TENSOR_CHOICES = (1, 2, 4, 8)
BASE_MFU = 0.55


@dataclass
class Candidate:
    """One config the planner considers.

    Attributes:
        stage: The stage with this candidate's knobs (a valid :class:`Stage`).
        num_slices: Slices it runs on.
        knobs: The knobs, as the memory model reads them.
        estimate: HBM per chip from the memory model.
        estimated_mfu: The heuristic MFU (0-1).
        tokens_per_step_per_chip: ``per_device_batch_size x max_target_length``.
        changes: How it differs from the stage it was derived from, e.g. ``per_device_batch_size 2 -> 1``.
        distance: Sum of :data:`CHANGE_WEIGHTS` over the changed knobs.
        report: The preflight report once AOT-compiled, else None.
    """

    stage: Stage
    num_slices: int
    knobs: memory.Knobs
    estimate: memory.MemoryEstimate
    estimated_mfu: float
    tokens_per_step_per_chip: float
    changes: list[str] = field(default_factory=list)
    distance: int = 0
    report: PreflightReport | None = None

    @property
    def ranked_mfu(self) -> float:
        """The MFU it is ranked by: the calibrated step-time estimate's once compiled, else :func:`estimated_mfu`."""
        found = self.report.step_time if self.report else None
        return found.mfu if found is not None and found.mfu is not None else self.estimated_mfu

    @property
    def verdict(self) -> str | None:
        """``fits``, ``does_not_fit``, ``error``, or None when not compiled."""
        return self.report.verdict if self.report else None

    def describe(self) -> str:
        """The knobs in one line."""
        k = self.knobs
        ici = " x ".join(f"{a} {d}" for a, d in k.ici.items() if d > 1) or "1"
        dcn = " x ".join(f"{a} {d}" for a, d in k.dcn.items() if d > 1) or "1"
        offload = [n for n, on in (("optimizer", k.optimizer_offload), ("parameters", k.parameter_offload)) if on]
        return (
            f"{self.num_slices} slices, per_device_batch_size {k.per_device_batch_size:g}, remat {k.remat_policy}, "
            f"ICI {ici}, DCN {dcn}, weights {k.weight_dtype}"
            + (f", host offload of {' and '.join(offload)}" if offload else "")
        )

    def as_dict(self) -> dict[str, Any]:
        """Plain data for reports."""
        return {
            "description": self.describe(),
            "num_slices": self.num_slices,
            "changes": self.changes,
            "estimated_mfu": round(self.estimated_mfu, 3),
            "ranked_mfu": round(self.ranked_mfu, 4),
            "tokens_per_step_per_chip": self.tokens_per_step_per_chip,
            "estimate": self.estimate.as_dict(),
            "verdict": self.verdict,
            "report": self.report.to_dict() if self.report else None,
            "stage": self.stage.model_dump(mode="json", exclude_none=True),
        }


def estimated_mfu(knobs: memory.Knobs, max_target_length: int) -> float:
    """The heuristic MFU of a candidate (see the module docstring); 0-1."""
    mfu = BASE_MFU * 3 / (3 + RECOMPUTE.get(knobs.remat_policy, 1.0))  # forward 1 + backward 2, plus recompute
    mfu *= 1 - 0.05 * math.log2(max(knobs.ici.get("tensor", 1), 1))
    if knobs.dcn.get("fsdp", 1) > 1:
        mfu *= 0.92
    if knobs.optimizer_offload:
        mfu *= 0.92
    if knobs.parameter_offload:
        mfu *= 0.85
    if knobs.weight_dtype != "float32":
        mfu *= 0.90  # not slower, but bf16 master weights change training numerics: rank below float32
    tokens = knobs.per_device_batch_size * max_target_length
    return mfu * min(1.0, (tokens / 8192) ** 0.15)


#: The ``maxtext_overrides`` keys the planner sets itself.
PLANNER_OVERRIDES = (
    "optimizer_memory_host_offload",
    "parameter_memory_host_offload",
    "param_scan_axis",
    "weight_dtype",
)


def _variant(stage: Stage, pdb: float, remat: str, ici: dict, dcn: dict, opt: bool, par: bool, dtype: str) -> Stage:
    overrides = {k: v for k, v in stage.maxtext_overrides.items() if k not in PLANNER_OVERRIDES}
    if opt:
        overrides["optimizer_memory_host_offload"] = True
    if par:
        overrides["parameter_memory_host_offload"] = True
        overrides["param_scan_axis"] = 0
    if dtype != "float32":
        overrides["weight_dtype"] = dtype
    return stage.model_copy(
        update={
            "per_device_batch_size": pdb,
            "remat_policy": remat,
            "ici": ici,
            "dcn": dcn,
            "maxtext_overrides": overrides,
        }
    )


#: How far a change takes a config from the user's, for preflight's "nearest alternative": a new
#: parallelism layout or bf16 master weights (other numerics) count double, more slices (more chips) triple.
CHANGE_WEIGHTS = {
    "num_slices": 3, "per_device_batch_size": 1, "remat_policy": 1, "optimizer_offload": 1,
    "parameter_offload": 1, "weight_dtype": 2, "ici": 2, "dcn": 2,
}  # fmt: skip


def _changes(base: memory.Knobs, knobs: memory.Knobs, base_slices: int, slices: int) -> list[tuple[str, str]]:
    """``(knob, "knob before -> after")`` for each knob that differs."""
    out = []
    if slices != base_slices:
        out.append(("num_slices", f"num_slices {base_slices} -> {slices}"))
    for name in ("per_device_batch_size", "remat_policy", "optimizer_offload", "parameter_offload", "weight_dtype"):
        before, after = getattr(base, name), getattr(knobs, name)
        if before != after:
            number = isinstance(after, (int, float)) and not isinstance(after, bool)
            text = f"{name} {before:g} -> {after:g}" if number else f"{name} {before} -> {after}"
            out.append((name, text))
    for net in ("ici", "dcn"):
        before = {a: d for a, d in getattr(base, net).items() if d > 1}
        after = {a: d for a, d in getattr(knobs, net).items() if d > 1}
        if before != after:
            out.append((net, f"{net} {before} -> {after}"))
    return out


def ici_degrees(topology: str) -> set[int]:
    """Degrees an ICI axis can take on a slice: products of subsets of its physical axis sizes.

    MaxText maps each logical mesh axis onto whole physical axes unless
    ``allow_split_physical_axes`` is set (``maxtext/utils/maxtext_utils.py``,
    ``create_device_mesh``; measured here: tensor 2 on a 4x4 v6e-16 fails with
    "Failed to find assignment for logical_axis_index ... of size 2").
    """
    sizes = [int(d) for d in topology.split("x")]
    return {math.prod(c) for n in range(len(sizes) + 1) for c in itertools.combinations(sizes, n)}


def candidates(
    spec: RunSpec,
    stage: Stage,
    num_slices: int,
    *,
    global_batch: int | None = None,
    fixed: dict[str, Any] | None = None,
) -> list[Candidate]:
    """Every candidate for ``stage`` on ``num_slices`` slices of ``spec.tpu_type``, with estimates.

    Args:
        spec: The run spec (slice shape; the stage need not be one of its stages).
        stage: The stage to vary (model and sequence length stay).
        num_slices: Slices to plan for.
        global_batch: If given, sequences per step across all chips; the
            per-device batch is fixed to it (it must divide evenly).
        fixed: Knobs not to vary, by :class:`memory.Knobs` field name
            (e.g. ``{"weight_dtype": "float32"}``).

    Returns:
        Candidates (unpruned, unordered). Empty when the model's dims are unknown.

    Raises:
        ValueError: ``global_batch`` does not divide over the chips.
    """
    dims = memory.model_dims(stage)
    if dims is None:
        return []
    shape = spec.slice_type
    chips = shape.chips * num_slices
    fixed = fixed or {}
    if global_batch is not None:
        if global_batch % chips:
            raise ValueError(
                f"global batch {global_batch} does not divide over {chips} chips ({num_slices} x {shape.name}); "
                f"use a multiple of {chips}"
            )
        batches: tuple[float, ...] = (global_batch / chips,)
    elif "per_device_batch_size" in fixed:
        batches = (fixed["per_device_batch_size"],)  # the one the user fixed, whether or not a usual choice
    else:
        batches = tuple(sorted({*PER_DEVICE_BATCH_CHOICES, stage.per_device_batch_size}))
    base_ici = resolve_degrees(stage.full_ici(), shape.chips)
    base_dcn = resolve_degrees(stage.full_dcn(), spec.num_slices)
    base = memory.Knobs.from_stage(stage, base_ici, base_dcn)
    out = []
    grid = itertools.product(
        batches,
        REMAT_CHOICES,
        [t for t in TENSOR_CHOICES if t in ici_degrees(shape.topology)],
        ("fsdp", "data") if num_slices > 1 else ("data",),
        (False, True),
        (False, True),
        ("float32", "bfloat16"),
    )
    for pdb, remat, tensor, dcn_axis, opt, par, dtype in grid:
        ici = {"fsdp": shape.chips // tensor, "tensor": tensor}
        dcn = {"data": 1, "fsdp": 1, dcn_axis: num_slices}
        variant = _variant(stage, pdb, remat, ici, dcn, opt, par, dtype)
        knobs = memory.Knobs.from_stage(variant, resolve_degrees(ici, shape.chips), resolve_degrees(dcn, num_slices))
        if any(getattr(knobs, k) != v for k, v in fixed.items()):
            continue
        changed = _changes(base, knobs, spec.num_slices, num_slices)
        out.append(
            Candidate(
                stage=variant,
                num_slices=num_slices,
                knobs=knobs,
                estimate=memory.estimate(dims, knobs, stage.max_target_length),
                estimated_mfu=estimated_mfu(knobs, stage.max_target_length),
                tokens_per_step_per_chip=pdb * stage.max_target_length,
                changes=[text for _, text in changed],
                distance=sum(CHANGE_WEIGHTS[name] for name, _ in changed),
            )
        )
    return out


def prune(found: list[Candidate], usable_bytes: int) -> tuple[list[Candidate], int]:
    """Drop candidates whose lower bound exceeds ``usable_bytes`` per chip; returns (kept, pruned count)."""
    kept = [c for c in found if c.estimate.lower_bound_bytes <= usable_bytes]
    return kept, len(found) - len(kept)


def fit_class(c: Candidate, usable_bytes: int) -> int:
    """How likely the memory model says a candidate fits, 0-3 (:class:`multislice.memory.MemoryEstimate`).

    0 likely (even its ``high_bytes`` fit in ``usable_bytes`` per chip), 1 possible (its estimate fits),
    2 unlikely (only its ``low_bytes`` fit), 3 not expected (none does: fits only if XLA beats every recorded
    compile). Not a verdict: only AOT compile is (:func:`search`).
    """
    e = c.estimate
    if e.high_bytes <= usable_bytes:
        return 0
    if e.estimate_bytes <= usable_bytes:
        return 1
    return 2 if e.low_bytes <= usable_bytes else 3


def order(kept: list[Candidate], usable_bytes: int, *, nearest: bool = False) -> list[Candidate]:
    """Compile order: by :func:`fit_class` (likely fits first), then by fewest changes (``nearest``) or by
    estimated speed."""

    def key(c: Candidate) -> tuple:
        likely = fit_class(c, usable_bytes)
        speed = (-c.estimated_mfu, -c.tokens_per_step_per_chip)
        return (likely, c.distance, *speed) if nearest else (likely, *speed, c.distance)

    return sorted(kept, key=key)


def rank(fitting: list[Candidate]) -> list[Candidate]:
    """Verified fits, fastest first: by :attr:`Candidate.ranked_mfu` (the compiled program's calibrated step-time
    estimate, :mod:`multislice.preflight.step_time`), then tokens per step per chip."""
    return sorted(fitting, key=lambda c: (-c.ranked_mfu, -c.tokens_per_step_per_chip))


@dataclass
class SearchResult:
    """What a search found.

    Attributes:
        fitting: AOT-verified fitting candidates, best first.
        tried: Every compiled candidate, in compile order.
        pruned: Candidates dropped by the lower bound, per slice count.
        slices_tried: Slice counts searched, in order.
        fewest_slices: The smallest slice count with a verified fit, or None.
        exhausted: True when every unpruned candidate was compiled (so "nothing fits" is proven).
        seconds: Wall time, seconds.
    """

    fitting: list[Candidate]
    tried: list[Candidate]
    pruned: dict[int, int]
    slices_tried: list[int]
    fewest_slices: int | None
    exhausted: bool
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {
            "fitting": [c.as_dict() for c in self.fitting],
            "tried": [{"description": c.describe(), "verdict": c.verdict} for c in self.tried],
            "pruned": self.pruned,
            "slices_tried": self.slices_tried,
            "fewest_slices": self.fewest_slices,
            "exhausted": self.exhausted,
            "seconds": round(self.seconds, 1),
        }


def search(
    spec: RunSpec,
    stage: Stage,
    session: CompileSession,
    *,
    num_slices: int | None = None,
    max_slices: int = 8,
    global_batch: int | None = None,
    fixed: dict[str, Any] | None = None,
    want: int = 3,
    budget_seconds: float = 540.0,
    nearest: bool = False,
    compile_timeout: float = float("inf"),
    on_progress: Callable[[str], None] = print,
) -> SearchResult:
    """Find up to ``want`` AOT-verified fitting configs for ``stage``.

    Slice counts from ``num_slices`` (default ``spec.num_slices``) up to
    ``max_slices`` are tried in turn; the search stops at the first slice
    count with a verified fit. Within one slice count, candidates are compiled
    until ``want`` fit, the candidates run out, or ``budget_seconds`` have
    passed (a compile still running then is stopped): first the candidate
    nearest the stage (fewest changes), for an early verified fit, then in
    order of estimated speed (:func:`order`).

    Args:
        spec, stage: What to plan (the stage's model and sequence length stay).
        session: The AOT session that compiles.
        num_slices, max_slices: Slice counts to search.
        global_batch: Fix the global batch (sequences per step), if given.
        fixed: Knobs not to vary (see :func:`candidates`).
        want: Fitting configs to verify before stopping.
        budget_seconds: Wall-clock budget for compiling, seconds.
        nearest: Order by fewest changes from ``stage`` first (preflight's alternative).
        compile_timeout: The most one compile may take, seconds (within the budget).
        on_progress: Called with one line per compile.

    Returns:
        The :class:`SearchResult`.
    """
    started = time.monotonic()
    usable = spec.slice_type.usable_hbm_bytes_per_chip
    first = num_slices or spec.num_slices
    result = SearchResult([], [], {}, [], None, True, 0.0)
    for slices in range(first, max(first, max_slices) + 1):
        if time.monotonic() - started > budget_seconds:  # many slice counts with nothing to compile
            result.exhausted = False
            on_progress(f"time budget of {budget_seconds:.0f} s spent; stopping")
            break
        if global_batch is not None and global_batch % (spec.slice_type.chips * slices):
            continue
        kept, pruned = prune(candidates(spec, stage, slices, global_batch=global_batch, fixed=fixed), usable)
        result.slices_tried.append(slices)
        result.pruned[slices] = pruned
        on_progress(
            f"{slices} x {spec.tpu_type}: {len(kept) + pruned} candidates, {pruned} pruned by the memory "
            f"model's lower bound, {len(kept)} to check"
        )
        fits_here = []
        ordered = order(kept, usable, nearest=nearest)
        if ordered and not nearest:
            # The config nearest the stage first: a verified fit early, whatever the faster
            # candidates' compiles cost (they can take many minutes); then by estimated speed.
            first = order(kept, usable, nearest=True)[0]
            ordered = [first, *(c for c in ordered if c is not first)]
        for candidate in ordered:
            if len(fits_here) >= want:
                break
            remaining = budget_seconds - (time.monotonic() - started)
            if remaining <= 0:
                result.exhausted = False
                on_progress(f"time budget of {budget_seconds:.0f} s spent; stopping")
                break
            plan = make_plan(spec.with_stages(candidate.stage).model_copy(update={"num_slices": slices}))
            try:
                what = f"  AOT-compiling {candidate.describe()} on {slices} x {spec.tpu_type}"
                with heartbeat(what, on_progress):
                    compiled = session.compile(
                        request_for(plan, plan.stages[0]), timeout=min(remaining, compile_timeout)
                    )
            except CompileTimeout:
                result.exhausted = False
                on_progress(f"  stopped: {candidate.describe()} (its compile outran the {budget_seconds:.0f} s budget)")
                break
            candidate.report = stage_report(plan, plan.stages[0], compiled)
            result.tried.append(candidate)
            hbm = candidate.report.used_bytes_per_chip
            on_progress(
                f"  {candidate.verdict}: {candidate.describe()} "
                f"({memory_gib(hbm)} per chip, estimated {memory_gib(candidate.estimate.estimate_bytes)}; "
                f"{candidate.report.compile_seconds} s{' cached' if candidate.report.cached else ''})"
            )
            if candidate.verdict == "fits":
                fits_here.append(candidate)
        if fits_here:
            result.fitting = rank(fits_here)
            result.fewest_slices = slices
            break
        if not result.exhausted:
            break
    result.seconds = time.monotonic() - started
    return result


def memory_gib(value: float | None) -> str:
    """Bytes as GiB text."""
    return "?" if value is None else f"{value / 2**30:.1f} GiB"
