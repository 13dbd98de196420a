"""The memory model against every published MaxText recipe that ran, and every recorded compile.

A published run fitted in its chips' HBM: the estimate (:func:`multislice.memory.estimate`) must say so, or
the planner would rank a known-good config last. A recorded compile (here, on this machine) is XLA's own figure:
the lower bound must never exceed it, or the planner would prune a config that fits.

Rows: MaxText's dense Llama-block decoders (what the model covers). Left out, with why: Gemma 3 (local/global
attention, its own block), GPT-3 175B (learned position embedding, non-gated GELU MLP, biases), Mixtral,
DeepSeek 3 and Llama 4 (mixture of experts): the model has no shape for them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from multislice import memory, tpu

DATA = Path(__file__).with_name("data")
ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30

#: tpu-recipes at c8cfe2f (github.com/AI-Hypercomputer/tpu-recipes), ``training/trillium/``; each README shows
#: the run's ``completed step`` log line and the ``tuning_params`` of its MaxText benchmark config.
TRILLIUM = "AI-Hypercomputer/tpu-recipes@c8cfe2f training/trillium/"
#: MaxText at e591f30 (github.com/AI-Hypercomputer/maxtext): v5p scripts with a README of published TFLOP/s/chip.
V5P = "AI-Hypercomputer/maxtext@e591f30 src/maxtext/configs/tpu/v5p/"

#: The Llama 3.1 recipes' custom remat: ``*_proj`` and the layer input offloaded to host memory.
LLAMA31_8B = ["remat_policy=custom", "decoder_layer_input=offload", "out_proj=offload", "query_proj=offload",
              "key_proj=offload", "value_proj=offload", "max_target_length=8192",
              "ici_fsdp_parallelism=-1"]  # fmt: skip
LLAMA31_70B = ["remat_policy=custom", "decoder_layer_input=offload", "query_proj=offload", "key_proj=offload",
               "value_proj=offload", "max_target_length=8192", "ici_fsdp_parallelism=-1"]  # fmt: skip


def scaled(scale: int) -> list[str]:
    """MaxText's default model at ``global_parameter_scale`` ``scale``, as explicit dims.

    ``get_individual_scales`` of ``maxtext/configs/types.py`` (MaxText 0.2.5) on ``base.yml``'s defaults
    (emb 2048, 16 query and 16 KV heads, MLP 7168, 16 layers, head 128, vocabulary 32000, SwiGLU).
    """
    base_scale, rem = divmod(scale.bit_length() - 1, 3)
    heads = base_scale + int(rem > 0)
    emb = base_scale + int(rem > 1)
    return [f"base_emb_dim={2048 << emb}", f"base_num_query_heads={16 << heads}", f"base_num_kv_heads={16 << heads}",
            f"base_mlp_dim={7168 << heads}", f"base_num_decoder_layers={16 << base_scale}", "head_dim=128",
            "vocab_size=32000"]  # fmt: skip


def v5p(scale: int, batch: int, remat: str, tensor: int) -> list[str]:
    """The arguments of MaxText's ``v5p/<scale>b.sh`` (lines 44-47 of each)."""
    return [*scaled(scale), f"per_device_batch_size={batch}", f"remat_policy={remat}", "ici_fsdp_parallelism=-1",
            f"ici_tensor_parallelism={tensor}", "max_target_length=2048"]  # fmt: skip


#: Published runs: (name, TPU type, slices, MaxText arguments that shape memory, source of the run and its config).
RECIPES: list[tuple[str, str, int, list[str], str]] = [
    ("Llama 3.1 8B v6e-8", "v6e-8", 1, ["model_name=llama3.1-8b", "per_device_batch_size=3", *LLAMA31_8B],
     TRILLIUM + "Llama3.1-8B-MaxText/v6e-8/README.md:55,67-75 (3.443 s/step)"),
    ("Llama 3.1 8B v6e-16", "v6e-16", 1, ["model_name=llama3.1-8b", "per_device_batch_size=3", *LLAMA31_8B],
     TRILLIUM + "Llama3.1-8B-MaxText/v6e-16/README.md:55,67-75 (3.393 s/step)"),
    ("Llama 3.1 8B v6e-32", "v6e-32", 1, ["model_name=llama3.1-8b", "per_device_batch_size=3", *LLAMA31_8B],
     TRILLIUM + "Llama3.1-8B-MaxText/v6e-32/README.md:55,67-75 (3.495 s/step)"),
    ("Llama 3.1 8B v6e-64", "v6e-64", 1, ["model_name=llama3.1-8b", "per_device_batch_size=5", *LLAMA31_8B],
     TRILLIUM + "Llama3.1-8B-MaxText/v6e-64/README.md:55,67-75 (5.652 s/step)"),
    ("Llama 3.1 8B v6e-128", "v6e-128", 1, ["model_name=llama3.1-8b", "per_device_batch_size=4", *LLAMA31_8B],
     TRILLIUM + "Llama3.1-8B-MaxText/v6e-128/README.md:55,67-75 (4.602 s/step)"),
    ("Llama 3.1 8B v6e-256", "v6e-256", 1, ["model_name=llama3.1-8b", "per_device_batch_size=4", *LLAMA31_8B],
     TRILLIUM + "Llama3.1-8B-MaxText/v6e-256/README.md:55,67-75 (4.546 s/step)"),
    ("Llama 3.1 70B v6e-32", "v6e-32", 1,
     ["model_name=llama3.1-70b", "per_device_batch_size=2", "weight_dtype=bfloat16", *LLAMA31_70B],
     TRILLIUM + "Llama3.1-70B-MaxText/v6e-32/README.md:41,53-60,78 (17.790 s/step)"),
    ("Llama 3.1 70B v6e-64", "v6e-64", 1, ["model_name=llama3.1-70b", "per_device_batch_size=2", *LLAMA31_70B],
     TRILLIUM + "Llama3.1-70B-MaxText/v6e-64/README.md:41,53-60 (18.688 s/step)"),
    ("Llama 3.1 70B v6e-128", "v6e-128", 1, ["model_name=llama3.1-70b", "per_device_batch_size=4", *LLAMA31_70B],
     TRILLIUM + "Llama3.1-70B-MaxText/v6e-128/README.md:41,53-60 (34.786 s/step)"),
    # The issue's row: 43.2 GiB per chip before (6 bytes per logit, loss phase and layer phase summed).
    ("Llama 3.1 70B v6e-256", "v6e-256", 1, ["model_name=llama3.1-70b", "per_device_batch_size=5", *LLAMA31_70B],
     TRILLIUM + "Llama3.1-70B-MaxText/v6e-256/README.md:41,53-60 (42.656 s/step)"),
    ("Llama 3.1 405B 2 x v6e-256 (FSDP over DCN)", "v6e-256", 2,
     ["model_name=llama3.1-405b", "per_device_batch_size=1", "ici_fsdp_parallelism=256", "dcn_fsdp_parallelism=2",
      "remat_policy=custom", "decoder_layer_input=offload", "max_target_length=8192"],
     TRILLIUM + "Llama3.1-405B-MaxText/README.md:41,53-58 (54.803 s/step)"),
    ("Llama 2 70B v6e-256", "v6e-256", 1,
     ["model_name=llama2-70b", "per_device_batch_size=3", "ici_fsdp_parallelism=1",
      "ici_fsdp_transpose_parallelism=-1", "ici_tensor_parallelism=1", "remat_policy=qkv_proj_offloaded",
      "max_target_length=4096"],
     TRILLIUM + "Llama2-70B-MaxText/README.md:41,53-58 (9.052 s/step)"),
    # mistral-7b: maxtext/configs/models/mistral-7b.yml (a Llama-shaped block; sliding window unset).
    ("Mistral 7B v6e-8", "v6e-8", 1,
     ["base_emb_dim=4096", "base_num_query_heads=32", "base_num_kv_heads=8", "base_mlp_dim=14336",
      "base_num_decoder_layers=32", "head_dim=128", "vocab_size=32000", "per_device_batch_size=6",
      "ici_fsdp_parallelism=-1", "remat_policy=custom", "decoder_layer_input=offload", "out_proj=offload",
      "query_proj=offload", "key_proj=offload", "value_proj=offload", "max_target_length=8192"],
     TRILLIUM + "Mistral-7B-MaxText/README.md:41,54-62 (6.320 s/step)"),
    ("Llama 3.1 405B v5p-1024", "v5p-1024", 1,
     ["model_name=llama3.1-405b", "per_device_batch_size=2", "ici_fsdp_parallelism=-1", "max_target_length=8192",
      "remat_policy=custom", "context=offload", "mlpwo=offload", "num_vocab_tiling=4"],
     "AI-Hypercomputer/tpu-recipes@c8cfe2f training/v5p/Llama3.1-405B-MaxText/README.md:48,56 (131.474 s/step); "
     "config AI-Hypercomputer/maxtext@e591f30 benchmarks/maxtext_v5p_model_configs.py:26-46"),
    ("32B 1 x v5p-128", "v5p-128", 1, v5p(32, 6, "minimal", 4), V5P + "README.md:23, 32b.sh:44-47"),
    ("32B 2 x v5p-128", "v5p-128", 2, v5p(32, 6, "minimal", 4), V5P + "README.md:24, 32b.sh:44-47"),
    ("64B 1 x v5p-128", "v5p-128", 1, v5p(64, 3, "minimal", 4), V5P + "README.md:29, 64b.sh:44-47"),
    ("64B 2 x v5p-128", "v5p-128", 2, v5p(64, 3, "minimal", 4), V5P + "README.md:30, 64b.sh:44-47"),
    ("128B 1 x v5p-256", "v5p-256", 1, v5p(128, 1, "minimal", 8), V5P + "README.md:35, 128b.sh:44-47"),
    ("128B 2 x v5p-512", "v5p-512", 2, v5p(128, 1, "minimal", 8), V5P + "README.md:38, 128b.sh:44-47"),
    ("256B 2 x v5p-1024", "v5p-1024", 2, v5p(256, 1, "minimal", 8), V5P + "README.md:44, 256b.sh:45-48"),
    ("512B 2 x v5p-1024", "v5p-1024", 2, v5p(512, 2, "full", 8), V5P + "README.md:50, 512b.sh:45-48"),
    ("1024B 2 x v5p-2048", "v5p-2048", 2, v5p(1024, 2, "full", 16), V5P + "README.md:56, 1024b.sh:44-47"),
]  # fmt: skip


def estimate_of(tpu_type: str, slices: int, args: list[str]) -> memory.MemoryEstimate:
    """The model's estimate of a run, from its MaxText arguments."""
    parsed = memory.from_maxtext_args(args, tpu.parse_tpu_type(tpu_type).chips, slices)
    assert parsed is not None, args
    return memory.estimate(*parsed)


@pytest.mark.parametrize("recipe", RECIPES, ids=[r[0] for r in RECIPES])
def test_every_published_run_is_estimated_to_fit(recipe):
    name, tpu_type, slices, args, source = recipe
    usable = tpu.parse_tpu_type(tpu_type).usable_hbm_bytes_per_chip
    found = estimate_of(tpu_type, slices, args)
    assert found.lower_bound_bytes <= usable, (name, source)  # the planner keeps it
    assert found.estimate_bytes <= usable, (name, source, round(found.estimate_bytes / GIB, 2))


def test_the_issues_row_was_the_logits():
    """Llama 3.1 70B on one v6e-256 (per-device batch 5 x 8192): 43.2 GiB per chip before, now under 31.24."""
    args = next(r[3] for r in RECIPES if r[0] == "Llama 3.1 70B v6e-256")
    found = estimate_of("v6e-256", 1, args)
    # 5.25e9 logits per chip: 19.6 GiB at 4 bytes (29.4 GiB at the old 6), the largest term by far
    assert round(found.parts["logits"] / GIB, 1) == 19.6
    assert found.estimate_bytes < found.lower_bound_bytes + found.parts["logits"] + found.parts["output_head"] + 1
    assert round(found.estimate_bytes / GIB, 1) == 29.5


def test_vocab_tiling_divides_the_logits():
    args = next(r[3] for r in RECIPES if r[0] == "Llama 3.1 405B v5p-1024")
    tiled = estimate_of("v5p-1024", 1, args)
    untiled = estimate_of("v5p-1024", 1, [a for a in args if not a.startswith("num_vocab_tiling")])
    assert untiled.parts["logits"] == pytest.approx(4 * tiled.parts["logits"], rel=1e-6)


#: Recorded compiles on this machine: ``tests/data/aot_recorded.json`` (preflight) and the step-time benchmark's
#: v5p rows (``benchmarks/results/step_time.json``: XLA's total per chip, ``hbm_gib_per_chip``).
STEP_TIME_COMPILES = [
    ("32B (global_parameter_scale 32) v5p-128", "v5p-128", 1, v5p(32, 6, "minimal", 4)),
    ("64B (global_parameter_scale 64) v5p-128", "v5p-128", 1, v5p(64, 3, "minimal", 4)),
    ("llama3.1-70b v6e-32", "v6e-32", 1,
     ["model_name=llama3.1-70b", "per_device_batch_size=2", "weight_dtype=bfloat16", *LLAMA31_70B]),
    ("llama3.1-405b 2 x v6e-256 (FSDP over DCN)", "v6e-256", 2,
     next(r[3] for r in RECIPES if r[0] == "Llama 3.1 405B 2 x v6e-256 (FSDP over DCN)")),
    ("32B (global_parameter_scale 32) 2 x v5p-128 (DCN data)", "v5p-128", 2, v5p(32, 6, "minimal", 4)),
    ("128B (global_parameter_scale 128) v5p-256", "v5p-256", 1, v5p(128, 1, "minimal", 8)),
    # 23.29 GiB for an estimate of 18.42: 26.4% above it, just outside the band fitted on the preflight's compiles
    # (25%), as the 8B rows there (1.5-2 bytes per logit more than counted); it fits all the same.
    ("llama3.1-8b v6e-32", "v6e-32", 1, next(r[3] for r in RECIPES if r[0] == "Llama 3.1 8B v6e-32")),
]  # fmt: skip


@pytest.mark.parametrize("compile_", STEP_TIME_COMPILES, ids=[c[0] for c in STEP_TIME_COMPILES])
def test_the_lower_bound_holds_on_the_step_time_benchmarks_compiles(compile_):
    name, tpu_type, slices, args = compile_
    rows = {r["name"]: r for r in json.loads((ROOT / "benchmarks/results/step_time.json").read_text())["rows"]}
    aot = rows[name]["hbm_gib_per_chip"] * GIB
    found = estimate_of(tpu_type, slices, args)
    assert found.lower_bound_bytes <= aot
    assert abs(found.estimate_bytes / aot - 1) < 0.25, round(found.estimate_bytes / GIB, 2)  # the estimate's error
    assert found.estimate_bytes <= tpu.parse_tpu_type(tpu_type).usable_hbm_bytes_per_chip  # they all fit


#: The step-time benchmark's compiles that did not fit here (XLA's required bytes in the row's ``error``): Llama 3.1
#: 8B and Mistral 7B on v6e-8 as their recipes configure them. Both ran as published (older MaxText, full flags);
#: with MaxText 0.2.5 and libtpu 0.0.52 they need 35.35 and 44.41 GB per chip. Lower bound only: the estimate
#: follows the published runs (Mistral 7B: 20.1 GiB; what MaxText 0.2.5's ``mistral`` block holds beyond that is
#: not known here).
NOT_FITTING_COMPILES = [
    ("llama3.1-8b v6e-8", "v6e-8", next(r[3] for r in RECIPES if r[0] == "Llama 3.1 8B v6e-8")),
    ("mistral-7b v6e-8", "v6e-8", next(r[3] for r in RECIPES if r[0] == "Mistral 7B v6e-8")),
]


@pytest.mark.parametrize("compile_", NOT_FITTING_COMPILES, ids=[c[0] for c in NOT_FITTING_COMPILES])
def test_the_lower_bound_holds_on_the_step_time_compiles_that_did_not_fit(compile_):
    name, tpu_type, args = compile_
    rows = {r["name"]: r for r in json.loads((ROOT / "benchmarks/results/step_time.json").read_text())["rows"]}
    required = rows[name]["error"]["required_bytes"]
    found = estimate_of(tpu_type, 1, args)
    assert found.lower_bound_bytes <= required
    assert required > tpu.parse_tpu_type(tpu_type).usable_hbm_bytes_per_chip


def test_the_lower_bound_holds_on_every_recorded_compile():
    recorded = json.loads((DATA / "aot_recorded.json").read_text())["results"]
    checked = 0
    for entry in recorded:
        aot = entry.get("total_bytes") or entry.get("required_bytes")
        parsed = memory.from_maxtext_args(
            entry["maxtext_args"], tpu.parse_tpu_type(entry["compile_topology"]).chips, entry["num_slices"]
        )
        assert parsed is not None and aot, entry["maxtext_args"]
        assert memory.estimate(*parsed).lower_bound_bytes <= aot, entry["maxtext_args"]
        checked += 1
    assert checked >= 13
