"""Step-time estimate of a stage from its AOT compile: a roofline over compute, HBM, ICI and DCN, calibrated.

Inputs, per device per step, from the compiled program itself
(:mod:`multislice.trainer.hlo_cost`, in the AOT result's ``step_cost``):

- ``flops``: XLA's cost analysis of the executable, with loop bodies counted
  as often as they run (remat recomputation included, as compiled), plus
  MaxText's attention FLOPs when the attention is a Pallas kernel XLA does not see;
- ``bytes_accessed``: the same for bytes read and written (HBM traffic);
- ``collectives``: bytes each chip sends per step, by network: ICI (a group
  within one slice) or DCN (a group over slices, or a MegaScale transfer).

and per-generation peak figures per chip (:data:`PEAKS`, each from the
generation's Cloud TPU page). Each term is a time::

    compute = flops / peak bf16 FLOP/s     hbm = bytes_accessed / HBM bandwidth
    ici     = ICI bytes / ICI bandwidth    dcn = DCN bytes / DCN bandwidth

**Overlap assumption**: XLA:TPU's latency-hiding scheduler runs collectives
and HBM transfers asynchronously beside the matrix units, so the roofline step
time is the largest term (``max``: perfect overlap; ``bound`` names it); the
sum of the terms (no overlap) is reported as an upper bound. What the roofline
leaves out (kernel efficiency of the MXUs, exposed collectives, host offload,
the step's fixed overheads) is one factor per generation, :data:`CALIBRATIONS`,
fitted on MaxText's published step times of its recipe configs compiled here
(``benchmarks/step_time.py``): estimated step seconds = roofline / efficiency.

MFU is MaxText's: model FLOPs per step per device (``calculate_tflops_training_per_device``,
no recomputation) / (step seconds x peak bf16 FLOP/s).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from multislice.reports import StepTimeEstimate
from multislice.tpu import SliceType

#: The roofline's terms, in the order of :func:`roofline`.
type Bound = Literal["compute", "hbm", "ici", "dcn"]
BOUNDS: tuple[Bound, ...] = ("compute", "hbm", "ici", "dcn")


@dataclass(frozen=True)
class Peaks:
    """Peak figures of one TPU generation, per chip.

    Attributes:
        bf16_flops_per_second: Peak dense bf16 FLOP/s (:mod:`multislice.tpu`'s figure).
        hbm_bytes_per_second: HBM bandwidth, bytes/s.
        ici_bytes_per_second: Inter-chip interconnect bandwidth, bytes/s (the page's Gbps / 8).
        dcn_bytes_per_second: Data-center network bandwidth, bytes/s (per chip: the pod's DCN bandwidth
            over its chips, or the page's per-chip figure).
        source: The Cloud TPU page the figures come from.
    """

    bf16_flops_per_second: float
    hbm_bytes_per_second: float
    ici_bytes_per_second: float
    dcn_bytes_per_second: float
    source: str


#: Peak figures per generation (:mod:`multislice.tpu` names). v4 has none here: no estimate.
PEAKS: dict[str, Peaks] = {
    # https://cloud.google.com/tpu/docs/v6e, "System architecture": 918 TFLOP/s bf16, HBM bandwidth
    # 1640 GBps, ICI bandwidth 3584 Gbps per chip, data center network bandwidth 25.6 Tbps per 256-chip
    # pod (4 x 200 Gbps NICs per 8-chip host) = 100 Gbps per chip.
    "v6e": Peaks(918e12, 1640e9, 3584e9 / 8, 25.6e12 / 8 / 256, "https://cloud.google.com/tpu/docs/v6e"),
    # https://cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, HBM bandwidth 819 GBps, ICI 1600 Gbps per
    # chip, 6.4 Tbps data center network per 256-chip pod (2 x 100 Gbps NICs per 8-chip host) = 25 Gbps per chip.
    "v5litepod": Peaks(197e12, 819e9, 1600e9 / 8, 6.4e12 / 8 / 256, "https://cloud.google.com/tpu/docs/v5e"),
    # https://cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, HBM2e 2765 GBps, ICI 4800 Gbps per chip
    # (1200 GBps bidirectional), data center network 50 Gbps per chip.
    "v5p": Peaks(459e12, 2765e9, 4800e9 / 8, 50e9 / 8, "https://cloud.google.com/tpu/docs/v5p"),
}


@dataclass(frozen=True)
class Calibration:
    """The fitted efficiency: estimated step seconds = roofline seconds / ``efficiency``.

    Attributes:
        efficiency: Published-run step time over the roofline, inverted (0-1): the geometric mean over the
            recipe rows of ``roofline / published``.
        rows: How many published rows it was fitted on.
        leave_one_out_error: The largest relative step-time error on a row when the factor is fitted on
            the other rows (``benchmarks/results/step_time.json``).
        source: Where the fit comes from.
    """

    efficiency: float
    rows: int
    leave_one_out_error: float
    source: str


#: Fitted by ``benchmarks/step_time.py`` on MaxText's published tpu-recipes rows (its results file holds
#: each row's terms, estimate and error); rerun it after a MaxText or libtpu upgrade and copy its fit here.
_FIT = "benchmarks/step_time.py (benchmarks/results/step_time.json)"

#: Per generation, fitted by ``benchmarks/step_time.py`` on MaxText's published runs compiled here (2026-11-27).
#: Every row is compute-bound; what differs is how close each generation's runs come to its peak FLOP/s.
CALIBRATIONS: dict[str, Calibration] = {
    # Llama 3.1 8B on v6e-16 (roofline / published 0.482) and v6e-32 (0.468), 70B on v6e-32 (0.544). Checked,
    # not fitted: Llama 3.1 405B on 2 x v6e-256 with FSDP over DCN (+2.1%, DCN 0.51 s of a 27.8 s compute term).
    "v6e": Calibration(0.497, 3, 0.1435, _FIT + ": Llama 3.1 8B v6e-16 and v6e-32, 70B v6e-32"),
    # MaxText's 32B and 64B v5p-128 configs (32b.sh, 64b.sh; 328 and 323 TFLOP/s/chip published): both
    # compute-bound, roofline / published 0.882 and 0.922 (HBM terms 2.33 s and 2.47 s once fusions count
    # what XLA's cost analysis counts of a stacked layer buffer, hlo_cost.fusion_bytes).
    # Checked, not fitted: the 32B on 2 x v5p-128 (DCN data, -22.4%); left out, its roofline above its published
    # step: the 128B on v5p-256 (+34.4%, benchmarks/README.md).
    "v5p": Calibration(0.9014, 2, 0.0455, _FIT + ": 32B and 64B v5p-128"),
}
#: For a generation without its own fit (v5e): the fit over every row (leave-one-out error 61%: use with care).
CALIBRATION = Calibration(0.6306, 5, 0.6068, _FIT + ": every row, across generations")


def calibration_for(generation: str) -> Calibration:
    """The generation's fitted :class:`Calibration`, else the fit over every row (:data:`CALIBRATION`)."""
    return CALIBRATIONS.get(generation, CALIBRATION)


def network_bytes(collectives: list[dict[str, Any]]) -> dict[str, float]:
    """Bytes each chip sends per step over ``ici`` and ``dcn`` (summed over the ``step_cost`` collectives)."""
    out = {"ici": 0.0, "dcn": 0.0}
    for c in collectives:
        out[c["network"]] = out.get(c["network"], 0.0) + float(c["moved_bytes"])
    return out


def compute_flops(result: dict[str, Any]) -> float:
    """FLOPs per device per step the chip computes: the compiled program's, plus its Pallas kernels'.

    XLA's cost analysis does not see inside a Pallas kernel (``step_cost["kernel_calls"]`` > 0: MaxText's
    splash attention); their FLOPs are MaxText's attention FLOPs (``attention_tflops_per_step_per_device``).
    """
    cost = result["step_cost"]
    kernels = float(result.get("attention_tflops_per_step_per_device") or 0.0) * 1e12 if cost.get("kernel_calls") else 0
    return float(cost["flops"]) + kernels


def roofline(result: dict[str, Any], peaks: Peaks) -> dict[str, float]:
    """The four terms of one step, seconds: ``compute``, ``hbm``, ``ici``, ``dcn``.

    Args:
        result: An AOT result with its ``step_cost`` (:func:`multislice.trainer.hlo_cost.summarize`).
        peaks: The generation's :class:`Peaks`.
    """
    step_cost = result["step_cost"]
    moved = network_bytes(step_cost.get("collectives", []))
    return {
        "compute": compute_flops(result) / peaks.bf16_flops_per_second,
        "hbm": float(step_cost["bytes_accessed"]) / peaks.hbm_bytes_per_second,
        "ici": moved["ici"] / peaks.ici_bytes_per_second,
        "dcn": moved["dcn"] / peaks.dcn_bytes_per_second,
    }


def estimate(
    result: dict[str, Any], shape: SliceType, calibration: Calibration | None = None
) -> StepTimeEstimate | None:
    """The step-time estimate of an AOT result (:mod:`multislice.trainer.aot`'s dict) on ``shape`` slices.

    Returns:
        The estimate, or None when there is nothing to estimate from: the stage does not fit, the
        result has no ``step_cost`` (an error reading it, or a result of an older version), or the
        generation has no :data:`PEAKS`.
    """
    cost = result.get("step_cost") or {}
    peaks = PEAKS.get(shape.generation.name)
    if result.get("verdict") != "fits" or "flops" not in cost or peaks is None:
        return None
    calibration = calibration or calibration_for(shape.generation.name)
    terms = roofline(result, peaks)
    bound: Bound = max(BOUNDS, key=lambda k: terms[k])
    top = terms[bound]
    seconds = top / calibration.efficiency
    tokens = result.get("tokens_per_step_per_device")
    model = result.get("model_tflops_per_step_per_device")
    moved = network_bytes(cost.get("collectives", []))
    return StepTimeEstimate(
        step_seconds=round(seconds, 4),
        roofline_seconds=round(top, 4),
        no_overlap_seconds=round(sum(terms.values()), 4),
        compute_seconds=round(terms["compute"], 4),
        hbm_seconds=round(terms["hbm"], 4),
        ici_seconds=round(terms["ici"], 4),
        dcn_seconds=round(terms["dcn"], 4),
        bound=bound,
        flops_per_device=compute_flops(result),
        bytes_accessed_per_device=float(cost["bytes_accessed"]),
        ici_bytes_per_device=moved["ici"],
        dcn_bytes_per_device=moved["dcn"],
        tokens_per_second_per_device=round(tokens / seconds, 1) if tokens and seconds > 0 else None,
        mfu=round(model * 1e12 / (seconds * peaks.bf16_flops_per_second), 4) if model and seconds > 0 else None,
        efficiency=calibration.efficiency,
        calibration=calibration.source,
        peaks_source=peaks.source,
    )


def fit(ratios: list[float]) -> float:
    """The efficiency that best fits ``roofline / published`` ratios: their geometric mean (errors are relative).

    Raises:
        ValueError: no ratios, or one that is not positive.
    """
    if not ratios or any(r <= 0 for r in ratios):
        raise ValueError(f"need positive roofline/published ratios to fit an efficiency, got {ratios}")
    return math.exp(sum(math.log(r) for r in ratios) / len(ratios))


def leave_one_out(ratios: list[float]) -> list[float]:
    """Each row's relative step-time error (estimate / published - 1) with the efficiency fitted on the others."""
    errors = []
    for index, ratio in enumerate(ratios):
        others = ratios[:index] + ratios[index + 1 :]
        efficiency = fit(others) if others else ratio
        errors.append(ratio / efficiency - 1)  # estimate/published = (roofline/eff)/published = ratio/eff
    return errors


def line(estimate_: StepTimeEstimate) -> str:
    """The estimate in one line: step seconds, tokens/s/device, MFU and the bounding term."""
    parts = [f"estimated step {estimate_.step_seconds:.3g} s"]
    if estimate_.tokens_per_second_per_device is not None:
        parts.append(f"{estimate_.tokens_per_second_per_device:,.0f} tokens/s/device")
    if estimate_.mfu is not None:
        parts.append(f"MFU {estimate_.mfu:.1%}")
    terms = (
        f"compute {estimate_.compute_seconds:.3g} s, HBM {estimate_.hbm_seconds:.3g} s, "
        f"ICI {estimate_.ici_seconds:.3g} s, DCN {estimate_.dcn_seconds:.3g} s"
    )
    return ", ".join(parts) + f" ({estimate_.bound}-bound roofline: {terms}; / efficiency {estimate_.efficiency:.2f})"
