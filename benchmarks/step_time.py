"""Benchmark: the step-time estimate against MaxText's published step times of its own recipe configs.

Run from the project root in the pipeline environment (the trainer environment must exist), through
the machine's heavy-job slot (each compile is 1-3 minutes of CPU)::

    .venvs/pipeline/bin/python -m benchmarks.step_time [--cache-dir DIR] [--rows NAME ...]
    .venvs/pipeline/bin/python -m benchmarks.step_time --reread   # kept programs re-read, nothing compiled

Each row of :data:`ROWS` is a published run of a MaxText recipe: its config (MaxText arguments, the
libtpu flags this libtpu accepts of the recipe's) is AOT-compiled here for its topology by MaxText's own
``train_compile`` path (:mod:`multislice.trainer.aot`), and the roofline of the compiled program
(:func:`multislice.preflight.step_time.roofline`) is compared with the published step time. An efficiency
is fitted per generation, and one over all rows (:func:`multislice.preflight.step_time.fit`); each row's
leave-one-out error is the error of its estimate with its generation's efficiency fitted on the other rows.

Writes ``benchmarks/results/step_time.json`` (the machine, each row's terms and errors, the fit) and
prints a Markdown table for ``benchmarks/README.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
import time
from pathlib import Path

from multislice import tpu
from multislice.backends.local.aot import AotSession
from multislice.preflight import step_time
from multislice.trainer import aot, hlo_cost

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "step_time.json"
#: Where the compiled programs' HLO is kept (not committed: megabytes each), to re-read without compiling.
HLO_DIR = Path(os.environ.get("STEP_TIME_HLO_DIR", "/tmp/step-time-hlo"))
RECIPES = "AI-Hypercomputer/tpu-recipes@c8cfe2f training/trillium/"
V5P = "AI-Hypercomputer/maxtext@e591f30 src/maxtext/configs/tpu/v5p/"
V5P_README = V5P + "README.md and 32b.sh"


def v6e_recipe_flags() -> dict[str, str]:
    """The Llama 3.1 v6e recipes' libtpu flags that shape the compiled program's costs.

    From MaxText's ``benchmarks/xla_flags_library.py``: ``DENSE_VMEM_LIMIT_FLAG`` (scoped VMEM for each op)
    and ``DISABLE_COLLECTIVE_MATMUL`` (no windowed einsums: FSDP's all-gathers stay all-gathers). Left out:
    the layout, scheduler and host-offload groups (they move work in time, which the roofline's overlap
    assumption already takes as perfect), ``CF_FOR_ALL_GATHER`` (libtpu 0.0.52 refuses continuation fusion
    on v6e, :data:`multislice.libtpu_flags.REFUSED`) and SparseCore all-reduce offload.
    """
    return {"xla_tpu_scoped_vmem_limit_kib": "98304", "xla_jf_spmd_threshold_for_windowed_einsum_mib": "1000000"}


#: The splash-attention and offload settings the Llama 3.1 v6e recipes share (``tuning_params``).
LLAMA31_V6E = [
    "ici_fsdp_parallelism=-1", "remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload",
    "key_proj=offload", "value_proj=offload", "max_target_length=8192", "attention=flash", "use_iota_embed=true",
    "dataset_type=synthetic", "sa_block_q=2048", "sa_block_kv=2048", "sa_block_kv_compute=2048",
    "sa_block_q_dkv=2048", "sa_block_kv_dkv=2048", "sa_block_kv_dkv_compute=2048", "sa_block_q_dq=2048",
    "sa_block_kv_dq=2048", "sa_use_fused_bwd_kernel=true",
]  # fmt: skip

#: Published rows: name -> the run (topology, slices, MaxText arguments, libtpu flags, published figures, source).
ROWS: dict[str, dict] = {
    "llama3.1-8b v6e-16": {
        "tpu_type": "v6e-16", "num_slices": 1,
        "maxtext_args": ["model_name=llama3.1-8b", "per_device_batch_size=3", "out_proj=offload", *LLAMA31_V6E],
        "libtpu_flags": v6e_recipe_flags(),
        "published": {"step_seconds": 3.393, "tflops_per_device": 419.485, "tokens_per_second_per_device": 7243.378},
        "source": RECIPES + "Llama3.1-8B-MaxText/v6e-16/README.md (llama3_1_8b_8192_no_collective_matmul)",
    },
    "llama3.1-8b v6e-8": {
        "tpu_type": "v6e-8", "num_slices": 1,
        "maxtext_args": ["model_name=llama3.1-8b", "per_device_batch_size=3", "out_proj=offload", *LLAMA31_V6E],
        "libtpu_flags": v6e_recipe_flags(),
        "published": {"step_seconds": 3.443, "tflops_per_device": 413.433, "tokens_per_second_per_device": 7138.890},
        "source": RECIPES + "Llama3.1-8B-MaxText/v6e-8/README.md (llama3_1_8b_8192_no_collective_matmul)",
    },
    "llama3.1-8b v6e-32": {
        "tpu_type": "v6e-32", "num_slices": 1,
        "maxtext_args": ["model_name=llama3.1-8b", "per_device_batch_size=3", "out_proj=offload", *LLAMA31_V6E],
        "libtpu_flags": v6e_recipe_flags(),
        "published": {"step_seconds": 3.495, "tflops_per_device": 407.225, "tokens_per_second_per_device": 7031.689},
        "source": RECIPES + "Llama3.1-8B-MaxText/v6e-32/README.md:55 (llama3_1_8b_8192_no_collective_matmul)",
    },
    "mistral-7b v6e-8": {
        "tpu_type": "v6e-8", "num_slices": 1,
        # The 8B recipes' tuning (tpu-recipes-v0.1.2), per-device batch 6: mistral_7b of its README.
        "maxtext_args": ["model_name=mistral-7b", "per_device_batch_size=6", "out_proj=offload", *LLAMA31_V6E],
        "libtpu_flags": v6e_recipe_flags(),
        "published": {"step_seconds": 6.320, "tflops_per_device": 431.981, "tokens_per_second_per_device": 7776.813},
        "source": RECIPES + "Mistral-7B-MaxText/README.md:41,54-76 (mistral_7b)",
    },
    "llama3.1-70b v6e-32": {
        "tpu_type": "v6e-32", "num_slices": 1,
        "maxtext_args": ["model_name=llama3.1-70b", "per_device_batch_size=2", "weight_dtype=bfloat16", *LLAMA31_V6E],
        "libtpu_flags": v6e_recipe_flags(),
        "published": {"step_seconds": 17.790, "tflops_per_device": 443.385, "tokens_per_second_per_device": 920.965},
        "source": RECIPES
        + "Llama3.1-70B-MaxText/v6e-32/README.md (llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul)",
    },
    "llama3.1-405b 2 x v6e-256 (FSDP over DCN)": {
        "tpu_type": "v6e-256", "num_slices": 2,
        # The one published MaxText run found that shards weights over DCN (dcn_fsdp_parallelism 2).
        "maxtext_args": [
            "model_name=llama3.1-405b", "per_device_batch_size=1", "ici_fsdp_parallelism=256",
            "dcn_fsdp_parallelism=2", "dcn_data_parallelism=1", "remat_policy=custom", "decoder_layer_input=offload",
            "max_target_length=8192", "attention=flash", "use_iota_embed=true", "dataset_type=synthetic",
            "sa_block_q=1024", "sa_block_q_dkv=2048", "sa_block_q_dq=2048",
        ],
        # DENSE_VMEM_LIMIT_FLAG only: CF_FOR_ALL_GATHER is refused by libtpu 0.0.52 on v6e and
        # HOST_OFFLOAD_FLAGS schedule host transfers (moved in time; the roofline overlaps them anyway).
        "libtpu_flags": {"xla_tpu_scoped_vmem_limit_kib": "98304"},
        "published": {"step_seconds": 54.803, "tflops_per_device": 392.454, "tokens_per_second_per_device": 149.482},
        "check_only": True,  # checks the DCN term: v6e's efficiency is not fitted on it
        "source": RECIPES + "Llama3.1-405B-MaxText/README.md:41 (llama3_1_405b_8192_pure_fsdp_ici, 2 x v6e-256, "
        "MaxText tpu-recipes-v0.1.2)",
    },
    "32B (global_parameter_scale 32) v5p-128": {
        "tpu_type": "v5p-128", "num_slices": 1,
        "maxtext_args": [
            "per_device_batch_size=6", "remat_policy=minimal", "global_parameter_scale=32", "ici_fsdp_parallelism=-1",
            "ici_tensor_parallelism=4", "max_target_length=2048", "use_iota_embed=true", "dataset_type=synthetic",
            "attention=flash", "quantization=",
        ],
        # 32b.sh's LIBTPU_INIT_ARGS are async-collective and scheduling flags (continuation fusion among them,
        # which libtpu 0.0.52 refuses off v5e): they move collectives in time, which the roofline takes as
        # overlapped anyway, so the row compiles without them.
        "libtpu_flags": {},
        # The README gives TFLOP/s/chip (MFU 71.47%); the step time is MaxText's TFLOP per step per device over it.
        "published": {"tflops_per_device": 328.0},
        "source": V5P_README + " (32B model, 1x v5p-128: 328 TFLOP/s/chip)",
    },
    "64B (global_parameter_scale 64) v5p-128": {
        "tpu_type": "v5p-128", "num_slices": 1,
        # 64b.sh: 32b.sh's arguments with global_parameter_scale=64 and per_device_batch_size=3.
        "maxtext_args": [
            "per_device_batch_size=3", "remat_policy=minimal", "global_parameter_scale=64", "ici_fsdp_parallelism=-1",
            "ici_tensor_parallelism=4", "max_target_length=2048", "use_iota_embed=true", "dataset_type=synthetic",
            "attention=flash", "quantization=",
        ],
        "libtpu_flags": {},  # async-collective and scheduling flags only, as 32b.sh's (see that row)
        "published": {"tflops_per_device": 323.0},
        "source": V5P + "README.md and 64b.sh (64B model, 1x v5p-128: 323 TFLOP/s/chip, MFU 70.31%)",
    },
    "128B (global_parameter_scale 128) v5p-256": {
        "tpu_type": "v5p-256", "num_slices": 1,
        "maxtext_args": [
            "per_device_batch_size=1", "remat_policy=minimal", "global_parameter_scale=128", "ici_fsdp_parallelism=-1",
            "ici_tensor_parallelism=8", "max_target_length=2048", "use_iota_embed=true", "dataset_type=synthetic",
            "attention=flash", "quantization=",
        ],
        "libtpu_flags": {},  # async-collective and scheduling flags only, as 32b.sh's
        "published": {"tflops_per_device": 315.0},
        "source": V5P + "README.md:35 and 128b.sh:44-48 (128B model, 1x v5p-256: 315 TFLOP/s/chip, MFU 68.68%)",
    },
    "32B (global_parameter_scale 32) 2 x v5p-128 (DCN data)": {
        "tpu_type": "v5p-128", "num_slices": 2,
        # 32b.sh as the 1-slice row, on 2 slices: MaxText's default DCN split (dcn_data_parallelism -1), so the
        # gradients are all-reduced over DCN. A check row: its generation's efficiency is not fitted on it.
        "maxtext_args": [
            "per_device_batch_size=6", "remat_policy=minimal", "global_parameter_scale=32", "ici_fsdp_parallelism=-1",
            "ici_tensor_parallelism=4", "max_target_length=2048", "use_iota_embed=true", "dataset_type=synthetic",
            "attention=flash", "quantization=",
        ],
        "libtpu_flags": {},
        "published": {"tflops_per_device": 319.0},
        "check_only": True,
        "source": V5P + "README.md:24 and 32b.sh (32B model, 2x v5p-128: 319 TFLOP/s/chip, MFU 69.43%)",
    },
}  # fmt: skip


#: MaxText's v5p scripts on 1 and 2 slices (``README.md`` of ``V5P``, published TFLOP/s/chip; the 2-slice runs use
#: MaxText's default DCN data parallelism): (model, TPU type, global_parameter_scale, per-device batch, TFLOP/s/chip
#: on 1 slice, on 2 slices, README line of the 2-slice row). Same per-device batch, so the same per-chip program
#: plus one gradient all-reduce over DCN: the roofline estimates both the same unless DCN bounds the step.
V5P_SLICE_PAIRS = [
    ("32B", "v5p-128", 32, 6, 328, 319, 24), ("64B", "v5p-128", 64, 3, 323, 309, 30),
    ("128B", "v5p-256", 128, 1, 315, 305, 36), ("128B", "v5p-512", 128, 1, 316, 274, 38),
    ("256B", "v5p-1024", 256, 1, 308, 289, 44), ("512B", "v5p-1024", 512, 2, 294, 282, 50),
    ("1024B", "v5p-2048", 1024, 2, 254, 237, 56), ("1024B", "v5p-4096", 1024, 2, 297, 279, 58),
]  # fmt: skip


def slice_pairs_table() -> str:
    """The v5p 1- and 2-slice pairs: the published slowdown beside the DCN term of the gradient all-reduce.

    Not compiled: the DCN bytes are the float32 gradient shard each chip all-reduces across 2 slices (a ring
    over 2 moves the whole shard: 4 bytes x parameters / chips per slice), at v5p's 50 Gbps per chip
    (:data:`multislice.preflight.step_time.PEAKS`); the 1-slice step is model FLOPs (6 x parameters x tokens plus
    causal attention) over the published rate. The estimate's error on the 2-slice run, relative to its error on
    the 1-slice run, is ``rate_2 / rate_1 - 1``: the roofline hides a DCN term under compute.
    """
    from multislice import memory

    peaks = step_time.PEAKS["v5p"]
    lines = [
        "| model | 2 x | 1-slice TFLOP/s/chip | 2-slice | published slowdown | DCN GB/chip/step | DCN s (of the "
        "1-slice step) | estimate on 2 slices vs 1 | source |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for model, tpu_type, scale, batch, one, two, line_no in V5P_SLICE_PAIRS:
        base, rem = divmod(scale.bit_length() - 1, 3)
        heads, emb = base + int(rem > 0), base + int(rem > 1)
        dims = memory.ModelDims(2048 << emb, 16 << heads, 16 << heads, 16 << base, 7168 << heads, 128, 32000)
        chips = tpu.parse_tpu_type(tpu_type).chips
        tokens = batch * 2048
        flops = 6 * dims.parameters * tokens + 6 * dims.num_decoder_layers * dims.emb_dim * 2048 * tokens
        step = flops / (one * 1e12)
        dcn = 4 * dims.parameters / chips
        seconds = dcn / peaks.dcn_bytes_per_second
        lines.append(
            f"| {model} | {tpu_type} | {one} | {two} | {one / two - 1:+.1%} | {dcn / 1e9:.2f} | "
            f"{seconds:.2f} ({seconds / step:.1%}) | {two / one - 1:+.1%} | {V5P}README.md:{line_no} |"
        )
    return "\n".join(lines)


def machine() -> dict:
    """Cores and load of this machine."""
    return {"cpu_cores": os.cpu_count(), "load_average": [round(x, 2) for x in os.getloadavg()]}


def run_row(name: str, row: dict, session: AotSession) -> dict:
    """Compile one row and compare its roofline with the published step time."""
    shape = tpu.parse_tpu_type(row["tpu_type"])
    request = {
        "name": name, "compile_topology": shape.maxtext_topology, "num_slices": row["num_slices"],
        "maxtext_args": row["maxtext_args"], "libtpu_flags": row["libtpu_flags"],
    }  # fmt: skip
    started = time.monotonic()
    result = session.compile(request, timeout=2700)
    out = {"name": name, "source": row["source"], "published": row["published"], "verdict": result.get("verdict"),
           "compile_seconds": result.get("compile_seconds"), "cached": result.get("cached"),
           "wall_seconds": round(time.monotonic() - started, 1)}  # fmt: skip
    if result.get("verdict") == "fits":
        result["step_cost"] = kept_step_cost(name) or result.get("step_cost")
    return compare(row, result, out)


def kept_step_cost(name: str) -> dict | None:
    """The step cost of a row's kept program (``HLO_DIR``) read with this ``hlo_cost``, or None when not kept."""
    kept = Path(str(HLO_DIR / re.sub(r"[^A-Za-z0-9_.-]+", "_", name)) + ".hlo")
    if not kept.exists():
        return None
    saved = json.loads(kept.with_name(kept.name[: -len(".hlo")] + ".json").read_text())
    return hlo_cost.summarize(kept.read_text(), saved["cost"], saved["slice_of"], len(set(saved["slice_of"])))


def reread(row: dict) -> dict:
    """A results-file row with its terms recomputed from its kept program (no compile); as is when not kept."""
    cost = kept_step_cost(row["name"]) if "ratio" in row else None
    if cost is None:
        return row
    result = {"verdict": "fits", "step_cost": cost}
    for key in (
        "model_tflops_per_step_per_device",
        "tokens_per_step_per_device",
        "attention_tflops_per_step_per_device",
    ):
        result[key] = row.get(key)
    kept = {k: row.get(k) for k in ("name", "source", "published", "verdict", "compile_seconds", "cached",
                                    "wall_seconds", "hbm_gib_per_chip")}  # fmt: skip
    return compare(ROWS[row["name"]], result, kept)


def compare(row: dict, result: dict, out: dict) -> dict:
    """Add the roofline of a compiled row's ``result`` (its ``step_cost``) and its ratio to the published step."""
    shape = tpu.parse_tpu_type(row["tpu_type"])
    if result.get("verdict") != "fits" or "flops" not in (result.get("step_cost") or {}):
        out["error"] = result.get("error") or (result.get("step_cost") or {}).get("error") or result.get("oom")
        return out
    cost = result["step_cost"]
    peaks = step_time.PEAKS[shape.generation.name]
    terms = step_time.roofline(result, peaks)
    model_tflops = result["model_tflops_per_step_per_device"]
    published = row["published"].get("step_seconds") or model_tflops / row["published"]["tflops_per_device"]
    bound = max(terms, key=lambda k: terms[k])
    out.update(
        model_tflops_per_step_per_device=model_tflops,
        tokens_per_step_per_device=result["tokens_per_step_per_device"],
        hbm_gib_per_chip=round(result["memory"]["total"] / 2**30, 2)
        if result.get("memory")
        else out.get("hbm_gib_per_chip"),
        attention_tflops_per_step_per_device=result.get("attention_tflops_per_step_per_device"),
        step_cost={
            k: cost.get(k) for k in ("flops", "bytes_accessed", "kernel_calls", "cost_analysis", "hlo", "collectives")
        },  # fmt: skip
        terms_seconds={k: round(v, 4) for k, v in terms.items()},
        bound=bound,
        roofline_seconds=round(terms[bound], 4),
        no_overlap_seconds=round(sum(terms.values()), 4),
        published_step_seconds=round(published, 4),
        ratio=terms[bound] / published,
        compute_flops=step_time.compute_flops(result),
        compiled_to_model_flops=step_time.compute_flops(result) / (model_tflops * 1e12),
        roofline_mfu=model_tflops * 1e12 / (terms[bound] * peaks.bf16_flops_per_second),
        published_mfu=model_tflops * 1e12 / (published * peaks.bf16_flops_per_second),
    )
    return out


def generation(name: str) -> str:
    """The TPU generation of a row (``v6e``)."""
    return tpu.parse_tpu_type(ROWS[name]["tpu_type"]).generation.name


def check_only(name: str) -> bool:
    """Whether a row only checks the fit (a multislice row: the DCN term) and is never fitted on."""
    return bool(ROWS[name].get("check_only"))


def finish(rows: list[dict], before: dict) -> dict:
    """Fit the efficiency per generation (and over all rows), add each row's errors, write the results file.

    A row's estimate uses its generation's efficiency; its leave-one-out error refits that efficiency
    without the row (none for a generation of one row). Check rows (:func:`check_only`) are fitted on
    nowhere: their estimate and leave-one-out error both use the efficiency of the fitted rows; so are rows
    whose roofline is above their published step (its terms over-count that program).
    """
    # A roofline above the published step (ratio > 1) is not a fact to fit on: the roofline is a lower bound
    # of the step, so its terms over-count that program. Such a row is estimated like a check row.
    good = [r for r in rows if "ratio" in r and not check_only(r["name"]) and r["ratio"] <= 1]
    checks = [r for r in rows if "ratio" in r and (check_only(r["name"]) or r["ratio"] > 1)]
    by_generation: dict[str, list[dict]] = {}
    for row in good:
        by_generation.setdefault(generation(row["name"]), []).append(row)
    fits = {}
    for name, members in by_generation.items():
        ratios = [r["ratio"] for r in members]
        efficiency = step_time.fit(ratios)
        errors = step_time.leave_one_out(ratios) if len(ratios) > 1 else [None] * len(ratios)
        for row, loo in zip(members, errors, strict=True):
            row["generation"] = name
            row["efficiency"] = round(efficiency, 4)
            row["estimate_seconds"] = round(row["roofline_seconds"] / efficiency, 4)
            row["error"] = round(row["estimate_seconds"] / row["published_step_seconds"] - 1, 4)
            row["leave_one_out_error"] = None if loo is None else round(loo, 4)
        for row in members:
            row["role"] = "fitted"
        known = [abs(e) for e in errors if e is not None]
        fits[name] = {"efficiency": round(efficiency, 4), "rows": len(members),
                      "max_abs_leave_one_out_error": round(max(known), 4) if known else None}  # fmt: skip
    for row in checks:
        name = generation(row["name"])
        row["generation"] = name
        row["role"] = "check" if check_only(row["name"]) else "excluded: roofline above the published step"
        if name not in fits:
            continue
        efficiency = fits[name]["efficiency"]
        row["efficiency"] = efficiency
        row["estimate_seconds"] = round(row["roofline_seconds"] / efficiency, 4)
        error = round(row["estimate_seconds"] / row["published_step_seconds"] - 1, 4)
        row["error"] = row["leave_one_out_error"] = error
        known_checks = [
            abs(r["error"]) for r in checks if r.get("generation") == name and r["role"] == "check" and "error" in r
        ]
        fits[name]["check_rows"] = len(known_checks)
        fits[name]["max_abs_check_error"] = round(max(known_checks), 4) if known_checks else None
    ratios = [r["ratio"] for r in good]
    overall = step_time.fit(ratios) if ratios else None
    everywhere = step_time.leave_one_out(ratios) if len(ratios) > 1 else []
    data = {
        "machine": {"before": before, "after": machine()},
        "versions": "MaxText 0.2.5, libtpu 0.0.52, JAX 0.12 (trainer environment)",
        "fit": {"efficiency": None if overall is None else round(overall, 4), "rows": len(good),
                "max_abs_leave_one_out_error": round(max(map(abs, everywhere)), 4) if everywhere else None},
        "fit_by_generation": fits,
        "rows": rows,
    }  # fmt: skip
    RESULTS.write_text(json.dumps(data, indent=1) + "\n")
    return data


def table(data: dict) -> str:
    """The README's Markdown table of a results file."""
    lines = [
        "| published run | role | published s/step | roofline s (bound) | DCN s | no-overlap s | "
        "estimate s (efficiency) | error | leave-one-out error | compile s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in data["rows"]:
        if "ratio" not in r:
            lines.append(f"| {r['name']} | | | no estimate: {str(r.get('error'))[:120]} | | | | | | |")
            continue
        if "estimate_seconds" not in r:  # a check row of a generation with no fitted row
            lines.append(f"| {r['name']} | {r.get('role')} | {r['published_step_seconds']:.3f} | no fit for "
                         f"{r.get('generation')} | | | | | | |")  # fmt: skip
            continue
        lines.append(
            f"| {r['name']} | {r.get('role', 'fitted')} | {r['published_step_seconds']:.3f} | "
            f"{r['roofline_seconds']:.3f} ({r['bound']}) | {r['terms_seconds']['dcn']:.3f} | "
            f"{r['no_overlap_seconds']:.3f} | {r['estimate_seconds']:.3f} ({r['efficiency']:.3f}) | "
            f"{r['error']:+.1%} | "
            + ("n/a" if r["leave_one_out_error"] is None else f"{r['leave_one_out_error']:+.1%}")
            + f" | {r['compile_seconds']} |"
        )
    fit = data["fit"]
    load = data["machine"]
    lines.append(
        f"\nefficiency {fit['efficiency']:.3f} on {fit['rows']} rows; load average "
        f"{load['before']['load_average']} -> {load['after']['load_average']}"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Compile the rows (one at a time, the results file rewritten after each), fit, print the table."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--cache-dir", default=None, help="verdict cache (default: a new temporary one)")
    parser.add_argument("--rows", nargs="*", default=list(ROWS), help="rows to run (default all)")
    parser.add_argument("--table", action="store_true", help="print the table of the results file; compile nothing")
    parser.add_argument("--refit", action="store_true", help="refit the results file's rows; compile nothing")
    parser.add_argument(
        "--reread", action="store_true",
        help="recompute the rows from their kept programs (STEP_TIME_HLO_DIR) and refit; compile nothing",
    )  # fmt: skip
    options = parser.parse_args(argv)
    if options.reread:
        kept = json.loads(RESULTS.read_text())
        print(table(finish([reread(r) for r in kept["rows"]], machine())))
        return 0
    if options.refit:
        kept = json.loads(RESULTS.read_text())
        print(table(finish(kept["rows"], kept["machine"]["before"])))
        print("\n" + slice_pairs_table())
        return 0
    if options.table:
        print(table(json.loads(RESULTS.read_text())))
        print("\n" + slice_pairs_table())
        return 0
    cache = options.cache_dir or tempfile.mkdtemp(prefix="step-time-cache-")
    HLO_DIR.mkdir(parents=True, exist_ok=True)
    os.environ[aot.HLO_DIR_ENV] = str(HLO_DIR)  # the compile process keeps each program's HLO there
    before = machine()
    # Rows of an earlier run that this one does not recompile stay in the results (and in the fit).
    kept = json.loads(RESULTS.read_text())["rows"] if RESULTS.exists() else []
    rows: list[dict] = [r for r in kept if r["name"] not in options.rows and r["name"] in ROWS]
    with tempfile.TemporaryDirectory(prefix="step-time-") as work, AotSession(cache, Path(work)) as session:
        for name in options.rows:
            rows.append(run_row(name, ROWS[name], session))
            data = finish(rows, before)
            keys = ("name", "verdict", "bound", "terms_seconds", "published_step_seconds", "error")
            print(json.dumps({k: rows[-1].get(k) for k in keys}), flush=True)
    print(table(data))
    print("\n" + slice_pairs_table())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
