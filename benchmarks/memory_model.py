"""Benchmark: the memory model's error against the HBM figures of recorded AOT compiles.

Run from the project root in the pipeline environment (no compile, a second)::

    .venvs/pipeline/bin/python -m benchmarks.memory_model

For every recorded AOT compile (``tests/data/aot_recorded.json``: compiles on this machine, added with
``python -m benchmarks.preflight --record``), XLA's HBM figure per chip (the fitting program's total, or for a
config that does not fit the compiler's "required" figure) beside :func:`multislice.memory.estimate`'s
estimate and lower bound, and the error ``(estimate - AOT) / AOT``. Writes
``benchmarks/results/memory_model.json`` and prints a Markdown table for ``benchmarks/README.md``.

Compiles of tiny models (under 1 GiB per chip) are listed but left out of the error band: XLA's code and runtime
buffers dominate them, which the model does not count.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from multislice import memory, tpu

ROOT = Path(__file__).resolve().parents[1]
RECORDED = ROOT / "tests" / "data" / "aot_recorded.json"
RESULTS = ROOT / "benchmarks" / "results" / "memory_model.json"
GIB = 2**30
#: Compiles under this many bytes per chip are not in the error band (see the module docstring).
SMALL_BYTES = GIB


def describe(entry: dict[str, Any], dims: memory.ModelDims, knobs: memory.Knobs, seq: int) -> str:
    """One line: model, target, batch x sequence, remat, parallelism, offload, weight dtype, libtpu flags."""
    args = dict(a.split("=", 1) for a in entry["maxtext_args"] if "=" in a)
    model = args.get("model_name") or f"{dims.num_decoder_layers}-layer E={dims.emb_dim}"
    remat = knobs.remat_policy
    if remat == "custom":
        where = {**memory.CUSTOM_REMAT_DEFAULTS, **knobs.custom_remat}
        off = [n for n, place in where.items() if place == "offload"]
        remat += f" (offload {'/'.join(off)})" if off else ""
    ici = " x ".join(f"{a} {d}" for a, d in knobs.ici.items() if d > 1) or "1"
    dcn = " x ".join(f"{a} {d}" for a, d in knobs.dcn.items() if d > 1) or "1"
    offload = [n for n, on in (("optimizer", knobs.optimizer_offload), ("params", knobs.parameter_offload)) if on]
    flags = "recipe flags" if entry.get("libtpu_init_args") else "no flags"
    return (
        f"{model}, {entry['num_slices']} x {entry['compile_topology']}, {knobs.per_device_batch_size:g} x {seq}, "
        f"{remat}, ICI {ici}, DCN {dcn}, {knobs.weight_dtype}"
        + (f", {'+'.join(offload)} offload" if offload else "")
        + f", {flags}"
    )


def rows(recorded: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per distinct recorded compile: the AOT figure, the model's, the error."""
    out: list[dict[str, Any]] = []
    seen: set[Any] = set()
    for entry in recorded:
        key = json.dumps(
            [
                entry["compile_topology"],
                entry["num_slices"],
                sorted(a for a in entry["maxtext_args"] if not a.startswith(("base_output_directory=", "run_name="))),
                entry.get("libtpu_init_args", ""),
            ]
        )
        if key in seen:
            continue
        seen.add(key)
        aot = entry.get("total_bytes") or entry.get("required_bytes")
        parsed = memory.from_maxtext_args(
            entry["maxtext_args"], tpu.parse_tpu_type(entry["compile_topology"]).chips, entry["num_slices"]
        )
        if parsed is None or not aot:
            continue
        dims, knobs, seq = parsed
        found = memory.estimate(dims, knobs, seq)
        config = describe(entry, dims, knobs, seq)
        if (config, aot) in seen:  # the same compile recorded twice (arguments written 1 and 1.0)
            continue
        seen.add((config, aot))
        out.append(
            {
                "config": config,
                "verdict": entry["verdict"],
                "aot_bytes": aot,
                "estimate_bytes": found.estimate_bytes,
                "lower_bound_bytes": found.lower_bound_bytes,
                "high_bytes": found.high_bytes,
                "low_bytes": found.low_bytes,
                "error": round((found.estimate_bytes - aot) / aot, 4),
                "in_band": aot >= SMALL_BYTES,
                "parts": found.parts,
            }
        )
    return out


def summary(found: list[dict[str, Any]]) -> dict[str, Any]:
    """The error band over the rows in it, and whether the lower bound held on every row."""
    band = [r for r in found if r["in_band"]]
    return {
        "rows": len(found),
        "rows_in_band": len(band),
        "most_under": min(r["error"] for r in band),
        "most_over": max(r["error"] for r in band),
        "mean_abs_error": round(sum(abs(r["error"]) for r in band) / len(band), 4),
        "lower_bound_held": all(r["lower_bound_bytes"] <= r["aot_bytes"] for r in found),
        "estimate_low_by": memory.ESTIMATE_LOW_BY,
        "estimate_high_by": memory.ESTIMATE_HIGH_BY,
    }


def table(found: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table."""
    lines = [
        "| config | verdict | AOT GiB | model GiB | error | lower bound GiB |",
        "|---|---|---|---|---|---|",
    ]
    for r in found:
        error = f"{r['error']:+.1%}" if r["in_band"] else f"({r['error']:+.0%}, tiny)"
        lines.append(
            f"| {r['config']} | {r['verdict'].replace('_', ' ')} | {r['aot_bytes'] / GIB:.2f} | "
            f"{r['estimate_bytes'] / GIB:.2f} | {error} | {r['lower_bound_bytes'] / GIB:.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    """Compute the rows, write the results file, print the table and the band."""
    found = rows(json.loads(RECORDED.read_text())["results"])
    result = {"source": str(RECORDED.relative_to(ROOT)), "summary": summary(found), "rows": found}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(table(found))
    s = result["summary"]
    print(
        f"\n{s['rows_in_band']} compiles over 1 GiB per chip: the estimate's error is {s['most_under']:+.1%} to "
        f"{s['most_over']:+.1%} of XLA's figure (mean |error| {s['mean_abs_error']:.1%}); lower bound held on "
        f"every compile: {s['lower_bound_held']}"
    )


if __name__ == "__main__":
    main()
