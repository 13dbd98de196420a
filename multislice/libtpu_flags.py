"""libtpu / XLA:TPU performance flags per TPU generation and model, from MaxText's benchmark recipes.

libtpu reads its flags from the environment variable ``LIBTPU_INIT_ARGS``
(``--name=value`` separated by spaces) when it initialises, on a TPU host and
in an AOT compile for a TPU topology on a CPU machine alike. The TPU JobSet's
trainer container gets them (:func:`multislice.render.jobset.render_jobset`),
and preflight compiles with the same ones (:func:`multislice.preflight.request_for`),
so a flag libtpu does not know fails preflight (libtpu exits with ``ERROR:
Unknown command line flag '<name>'``) and the HBM figure is the one the run
sees. The local backend trains on CPU, where libtpu is not used: no flag applies
there.

The table is MaxText's, at commit
``e591f30cbbf217ed67ef71263ec0538239f9c3b8`` of github.com/AI-Hypercomputer/maxtext:
flag groups from ``benchmarks/xla_flags_library.py``, combined per recipe in
``benchmarks/maxtext_trillium_model_configs.py`` (v6e, "Trillium"),
``benchmarks/maxtext_v5p_model_configs.py`` (v5p) and
``benchmarks/maxtext_v5e_model_configs.py`` (v5e). Each :class:`Recipe` of
:data:`NAMED` is one ``MaxTextModel`` variable and the groups it takes;
:data:`DEFAULTS` gives each (generation, model) its row: for v6e Llama 3 8B and
70B the recipes AI-Hypercomputer/tpu-recipes measured (``Recipe.measured``).
A model without its own row gets the generation's ``*`` row, if any. Generations
and models with no row (v5litepod custom models, v4) get no flags. A stage (or
profile) may pin any row by name (``libtpu_flags.recipe``), as the seed
profile ``gke-v6e-16x2-seed`` does to keep the flags it had. A stage that
offloads to host gets ``HOST_OFFLOAD_FLAGS`` where its row lacks them
(:func:`offloads_to_host`). Recipe flags that the trainer image's libtpu
refuses on a generation (:data:`REFUSED`, measured by preflight and by
``tests/test_libtpu_flags.py``'s compile of each generation's widest row) are
left out.

A profile (``libtpu_flags``) or a stage (``libtpu_flags``) adds flags or removes
table flags by name (:func:`resolve`); the stage's changes apply after the profile's.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

#: The environment variable libtpu reads its flags from.
ENV = "LIBTPU_INIT_ARGS"

#: A libtpu flag name, without its ``--`` (absl flag names; libtpu's include ``2a886c8_chip_config_name``).
FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")

_MAXTEXT = "AI-Hypercomputer/maxtext@e591f30 benchmarks/"
LIBRARY = _MAXTEXT + "xla_flags_library.py"
TRILLIUM = _MAXTEXT + "maxtext_trillium_model_configs.py"
V5P = _MAXTEXT + "maxtext_v5p_model_configs.py"
V5E = _MAXTEXT + "maxtext_v5e_model_configs.py"

#: Flag groups of ``benchmarks/xla_flags_library.py`` (the constant's name -> its flags, in its order).
GROUPS: dict[str, dict[str, str]] = {
    # "xla tpu scoped vmem defines the amount of vmem used for the current hlo op ... experimentally
    # recommended values for compute bound models" (_DENSE_VMEM_LIMIT = 98304).
    "DENSE_VMEM_LIMIT_FLAG": {"xla_tpu_scoped_vmem_limit_kib": "98304"},
    # Continuation fusion for all-gather: overlaps FSDP's all-gathers with compute.
    "CF_FOR_ALL_GATHER": {
        "xla_tpu_enable_async_collective_fusion": "true",
        "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
        "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
        "xla_tpu_overlap_compute_collective_tc": "true",
        "xla_enable_async_all_gather": "true",
    },
    # "Better memory layout for all-reduce (AR)."
    "LAYOUT_FOR_ALL_REDUCE_SCATTER": {
        "xla_tpu_use_minor_sharding_for_major_trivial_input": "true",
        "xla_tpu_relayout_group_size_threshold_for_reduce_scatter": "1",
        "xla_tpu_assign_all_reduce_scatter_layout": "true",
    },
    # "optimize DCN all-reduces used for data parallel sharding" and pipeline them across iterations.
    "DATA_PARALLEL_OVERLAP": {
        "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
        "xla_tpu_data_parallel_opt_different_sized_ops": "true",
    },
    # "Enable SparseCore All Reduce (SC AR) ... useful for reducing the gradient reduction all-reduce time with
    # overlapping with compute", followed by ENABLE_SPARSECORE_OFFLOADING_BASE_FLAGS (its last four).
    "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE": {
        "xla_tpu_enable_async_collective_fusion_fuse_all_reduce": "false",
        "xla_tpu_enable_sparse_core_collective_offload_all_reduce": "true",
        "xla_tpu_enable_all_reduce_offload_tracing": "true",
        "xla_tpu_use_tc_device_shape_on_sc": "true",
        "xla_sc_enable_instruction_fusion": "false",
        "xla_sc_disjoint_spmem": "false",
        "xla_sc_disable_megacore_partitioning": "true",
    },
    # DISABLE_COLLECTIVE_MATMUL: a windowed-einsum threshold no tensor reaches (10^6 MiB), so XLA does not
    # decompose an all-gather + matmul into a collective matmul.
    "DISABLE_COLLECTIVE_MATMUL": {"xla_jf_spmd_threshold_for_windowed_einsum_mib": "1000000"},
    # "optimizations recommended when using host offloading".
    "HOST_OFFLOAD_FLAGS": {
        "xla_tpu_enable_all_experimental_scheduler_features": "true",
        "xla_tpu_enable_scheduler_memory_pressure_tracking": "true",
        "xla_tpu_host_transfer_overlap_limit": "24",
        "xla_tpu_aggressive_opt_barrier_removal": "ENABLED",
        "xla_lhs_prioritize_async_depth_over_stall": "ENABLED",
        "xla_tpu_enable_ag_backward_pipelining": "true",
        "xla_should_allow_loop_variant_parameter_in_chain": "ENABLED",
        "xla_should_add_loop_invariant_op_in_chain": "ENABLED",
        "xla_max_concurrent_host_send_recv": "100",
        "xla_tpu_scheduler_percent_shared_memory_limit": "100",
        "xla_latency_hiding_scheduler_rerun": "2",
    },
}


@dataclass(frozen=True)
class Recipe:
    """One row of the table: the flags MaxText's recipe ``recipe`` of ``source`` sets.

    Attributes:
        source: The MaxText file (repository@commit path).
        recipe: The ``MaxTextModel`` variable in it (``llama3_70b_8192``); a stage pins a row by this name
            (``libtpu_flags.recipe``).
        groups: The :data:`GROUPS` it concatenates, in its order.
        extra: Flags it appends after the groups (a later value of a flag wins, as in absl).
        note: Why this recipe is the row (shown in docs and ``render``).
        generation: The TPU generation it was measured on (:mod:`multislice.tpu`'s name: v6e, v5p, v5litepod).
        measured: The published measurement of this recipe, if any (tpu-recipes README: step time, topology).
    """

    source: str
    recipe: str
    groups: tuple[str, ...]
    extra: tuple[tuple[str, str], ...] = ()
    note: str = ""
    generation: str = "v6e"
    measured: str = ""

    def flags(self) -> dict[str, str]:
        """Flag name -> value, in the recipe's order (a repeated flag keeps its first place, last value)."""
        out: dict[str, str] = {}
        for group in self.groups:
            out.update(GROUPS[group])
        out.update(self.extra)
        return out


_TPU_RECIPES = "AI-Hypercomputer/tpu-recipes@c8cfe2f training/trillium/"

#: Every recipe of the table by its MaxText name (``MaxTextModel`` variable); :data:`RECIPES` picks the default
#: row of each (generation, model) from these, and a stage may pin any of them (``libtpu_flags.recipe``).
NAMED: dict[str, Recipe] = {
    recipe.recipe: recipe
    for recipe in (
        Recipe(
            TRILLIUM,
            "llama3_8b_8192",
            ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER"),
            note="Llama 3 8B on v6e (model_type llama3-8b, full remat; no published step time); the seed "
            "reproduction's 8B stage pins it",
        ),
        Recipe(
            TRILLIUM,
            "llama3_70b_8192",
            ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "HOST_OFFLOAD_FLAGS"),
            extra=(("xla_tpu_scheduler_percent_shared_memory_limit", "90"),),
            note="Llama 3 70B on v6e (model_type llama3-70b, optimizer_memory_host_offload: true; no published step "
            "time); the seed reproduction's 70B stage pins it",
        ),
        Recipe(
            TRILLIUM,
            "llama3_1_70b_8192",
            (
                "DENSE_VMEM_LIMIT_FLAG",
                "LAYOUT_FOR_ALL_REDUCE_SCATTER",
                "DATA_PARALLEL_OVERLAP",
                "CF_FOR_ALL_GATHER",
                "HOST_OFFLOAD_FLAGS",
            ),
            note="Llama 3.1 70B on v6e-256 (per-device batch 5): adds the reduce-scatter layout and DCN "
            "data-parallel all-reduce optimisation",
        ),
        Recipe(
            TRILLIUM,
            "llama3_1_8b_8192_no_collective_matmul",
            (
                "DENSE_VMEM_LIMIT_FLAG",
                "LAYOUT_FOR_ALL_REDUCE_SCATTER",
                "DATA_PARALLEL_OVERLAP",
                "CF_FOR_ALL_GATHER",
                "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE",
                "HOST_OFFLOAD_FLAGS",
                "DISABLE_COLLECTIVE_MATMUL",
            ),
            note="Llama 3.1 8B on v6e-16, the measured run: FSDP over the slice, per-device batch 3 x 8192, "
            "decoder_layer_input and q/k/v/out projections offloaded to host",
            measured=_TPU_RECIPES + "Llama3.1-8B-MaxText/v6e-16/README.md: 3.393 s/step, 419.5 TFLOP/s/device, "
            "7,243 tokens/s/device",
        ),
        Recipe(
            TRILLIUM,
            "llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul",
            (
                "DENSE_VMEM_LIMIT_FLAG",
                "LAYOUT_FOR_ALL_REDUCE_SCATTER",
                "DATA_PARALLEL_OVERLAP",
                "CF_FOR_ALL_GATHER",
                "HOST_OFFLOAD_FLAGS",
                "DISABLE_COLLECTIVE_MATMUL",
            ),
            note="Llama 3.1 70B on v6e-32, the measured run: FSDP over the 32 chips, per-device batch 2 x 8192, "
            "bfloat16 weights, decoder_layer_input and q/k/v projections offloaded to host",
            measured=_TPU_RECIPES + "Llama3.1-70B-MaxText/v6e-32/README.md: 17.790 s/step, 443.4 TFLOP/s/device, "
            "921 tokens/s/device",
        ),
        Recipe(
            V5P,
            "llama2_70b_v5p_128",
            ("DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER"),
            note="any model on v5p: the dense Llama 2 7B / 70B and GPT-3 175B recipes of the file all set these",
            generation="v5p",
        ),
        Recipe(
            V5E,
            "llama3_1_8b_8192_v5e_256",
            (
                "DENSE_VMEM_LIMIT_FLAG",
                "LAYOUT_FOR_ALL_REDUCE_SCATTER",
                "DATA_PARALLEL_OVERLAP",
                "CF_FOR_ALL_GATHER",
                "ENABLE_SPARSECORE_OFFLOADING_FOR_ALL_REDUCE",
                "HOST_OFFLOAD_FLAGS",
            ),
            note="Llama 3.1 8B on v5e-256 (per-device batch 2 x 8192, the 8B v6e offload policy)",
            generation="v5litepod",
        ),
        Recipe(
            V5E,
            "llama2_70b_v5e_256",
            ("DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER"),
            note="Llama 2 70B on v5e-256 (qkv_proj_offloaded); the groups every dense v5e recipe of the file sets",
            generation="v5litepod",
        ),
    )
}

#: (TPU generation, MaxText model_name or ``*``) -> the default row's :data:`NAMED` name. Generation names are
#: :mod:`multislice.tpu`'s. The Llama 3 and 3.1 names share a row: same architecture (3.1 adds RoPE scaling).
DEFAULTS: dict[tuple[str, str], str] = {
    ("v6e", "llama3-8b"): "llama3_1_8b_8192_no_collective_matmul",
    ("v6e", "llama3.1-8b"): "llama3_1_8b_8192_no_collective_matmul",
    ("v6e", "llama3-70b"): "llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul",
    ("v6e", "llama3.1-70b"): "llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul",
    # Any other model on v6e: the groups every dense Llama recipe of the file sets (llama3_8b_8192's).
    ("v6e", "*"): "llama3_8b_8192",
    ("v5p", "*"): "llama2_70b_v5p_128",
    ("v5litepod", "llama3-8b"): "llama3_1_8b_8192_v5e_256",
    ("v5litepod", "llama3.1-8b"): "llama3_1_8b_8192_v5e_256",
    ("v5litepod", "llama2-70b"): "llama2_70b_v5e_256",
    ("v5litepod", "llama3-70b"): "llama2_70b_v5e_256",
    ("v5litepod", "llama3.1-70b"): "llama2_70b_v5e_256",
}

#: (TPU generation, MaxText model_name or ``*``) -> recipe: :data:`DEFAULTS` resolved.
RECIPES: dict[tuple[str, str], Recipe] = {key: NAMED[name] for key, name in DEFAULTS.items()}

#: MaxText keys whose value ``offload`` moves that activation to host memory (``remat_policy: custom``;
#: MaxText base.yml), and the remat policies that offload by themselves.
OFFLOAD_KEYS = ("decoder_layer_input", "context", "mlpwi", "mlpwi_0", "mlpwi_1", "mlpwo", "query_proj",
                "key_proj", "value_proj", "out_proj", "qkv_proj")  # fmt: skip
OFFLOAD_POLICIES = ("qkv_proj_offloaded", "minimal_offloaded")
#: ``maxtext_overrides`` keys that keep optimizer state or parameters in host memory (MaxText base.yml).
HOST_MEMORY_KEYS = ("optimizer_memory_host_offload", "parameter_memory_host_offload")


def offloads_to_host(remat_policy: str, overrides: Mapping[str, object]) -> bool:
    """Whether a stage moves anything to host memory: optimizer state, parameters or activations.

    ``remat_policy`` and ``overrides`` are the stage's (``Stage.remat_policy``, ``Stage.maxtext_overrides``).
    Such a stage gets MaxText's ``HOST_OFFLOAD_FLAGS`` ("optimizations recommended when using host offloading")
    where its recipe row lacks them (:func:`table_flags`).
    """
    if remat_policy in OFFLOAD_POLICIES or any(overrides.get(k) is True for k in HOST_MEMORY_KEYS):
        return True
    return remat_policy == "custom" and any(overrides.get(k) == "offload" for k in OFFLOAD_KEYS)


#: The libtpu version of the trainer image (``requirements``) these refusals were measured with.
LIBTPU_VERSION = "0.0.52"

#: Recipe flags that libtpu :data:`LIBTPU_VERSION` refuses on a generation: left out of the table's
#: flags there (a profile's ``libtpu_flags.add`` may still set them). Measured here by preflight: the
#: seed 70B stage on 2 x v6e-16 with MaxText's ``llama3_70b_8192`` flags ends in the compile error
#: "FAILED_PRECONDITION: Continuation fusion for AllGather is enabled on platform ghostlite (variant: ),
#: but it is not supported/recommended on platforms other than TPU v5e, and this might lead to many
#: errors including but not limited to: incorrect results, hang, SDC, etc. Please disable it with
#: xla_tpu_enable_async_collective_fusion=false" (ghostlite is libtpu's name for v6e).
CONTINUATION_FUSION = (
    "xla_tpu_enable_async_collective_fusion",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather",
    "xla_tpu_enable_async_collective_fusion_multiple_steps",
)
#: The same refusal on v5p ("platform viperfish", libtpu's name for v5p), measured by
#: ``tests/test_libtpu_flags.py``'s compile of the v5p row (``llama2_70b_v5p_128``) for v5p-8. v5e takes them.
REFUSED: dict[str, dict[str, str]] = {
    generation: {
        name: f"libtpu {LIBTPU_VERSION} refuses continuation fusion on {generation} (FAILED_PRECONDITION: "
        "not supported/recommended on platforms other than TPU v5e)"
        for name in CONTINUATION_FUSION
    }
    for generation in ("v6e", "v5p")
}


def recipe_for(generation: str, model_name: str | None, recipe: str | None = None) -> Recipe | None:
    """The table row for a generation (``v6e``) and MaxText ``model_name`` (None: a custom model), or None.

    ``recipe``, a :data:`NAMED` name, pins that row instead (``libtpu_flags.recipe`` of a stage or profile);
    KeyError if it is not one (the config refuses such a name first).
    """
    if recipe is not None:
        return NAMED[recipe]
    return RECIPES.get((generation, model_name or "")) or RECIPES.get((generation, "*"))


def render_value(value: str | int | float | bool) -> str:
    """A flag value as libtpu reads it: ``true``/``false`` for booleans, else ``str``."""
    return ("true" if value else "false") if isinstance(value, bool) else str(value)


def value_problem(value: str | int | float | bool) -> str | None:
    """Why ``value`` cannot be a flag value in ``LIBTPU_INIT_ARGS`` (split on whitespace), or None."""
    text = render_value(value)
    if not text or any(c.isspace() or not c.isprintable() for c in text):
        return f"{text!r} is not a flag value: use a non-empty value without spaces or control characters"
    return None


def name_problem(name: str) -> str | None:
    """Why ``name`` is not a libtpu flag name, or None (written without ``--``)."""
    if FLAG_NAME.fullmatch(name):
        return None
    if name.startswith("-") and FLAG_NAME.fullmatch(name.lstrip("-")):
        return f"{name!r}: write the flag name without the leading '--' ({name.lstrip('-')})"
    return f"{name!r} is not a libtpu flag name (letters, digits and '_', e.g. xla_tpu_scoped_vmem_limit_kib)"


def table_flags(
    generation: str, model_name: str | None, recipe: str | None = None, host_offload: bool = False
) -> dict[str, str]:
    """The table's flags for a generation and model: the recipe row's, less those :data:`REFUSED` there.

    Args:
        generation: TPU generation name (:attr:`multislice.tpu.TpuGeneration.name`).
        model_name: The stage's MaxText ``model_name`` (None for a custom model).
        recipe: A :data:`NAMED` row to use instead of the generation's default (None: the default).
        host_offload: The stage moves state or activations to host memory (:func:`offloads_to_host`): a row
            without ``HOST_OFFLOAD_FLAGS`` gets them after its own (e.g. v5p's, whose recipes offload nothing).
            A generation without a row gets none.
    """
    row = recipe_for(generation, model_name, recipe)
    flags = row.flags() if row else {}
    if row and host_offload and "HOST_OFFLOAD_FLAGS" not in row.groups:
        flags = {**GROUPS["HOST_OFFLOAD_FLAGS"], **flags}
    refused = REFUSED.get(generation, {})
    return {k: v for k, v in flags.items() if k not in refused}


def resolve(
    generation: str,
    model_name: str | None,
    changes: list[tuple[dict[str, str | int | float | bool], tuple[str, ...]]],
    recipe: str | None = None,
    host_offload: bool = False,
) -> dict[str, str]:
    """The flags of a stage: the table's (:func:`table_flags`), then each ``(add, remove)`` change in order.

    Args:
        generation: TPU generation name (:attr:`multislice.tpu.TpuGeneration.name`).
        model_name: The stage's MaxText ``model_name`` (None for a custom model).
        changes: ``(add, remove)`` pairs: ``remove`` drops flags by name, then ``add`` sets (or overrides) them.
        recipe: A pinned :data:`NAMED` row (None: the generation's default for the model).
        host_offload: Whether the stage offloads to host (:func:`table_flags`).

    Returns:
        Flag name -> value (strings), in order; empty for a generation without a recipe.
    """
    flags = table_flags(generation, model_name, recipe, host_offload)
    for add, remove in changes:
        for name in remove:
            flags.pop(name, None)
        flags.update({name: render_value(value) for name, value in add.items()})
    return flags


def init_args(flags: dict[str, str]) -> str:
    """``LIBTPU_INIT_ARGS``'s value: ``--name=value`` joined by single spaces (empty for no flags)."""
    return " ".join(f"--{name}={value}" for name, value in flags.items())


def table_markdown() -> str:
    """The table as Markdown rows (generation, models it is the default for, recipe, measurement, flags)."""
    rows = ["| generation | default for | MaxText recipe (file) | measured | flags |", "|---|---|---|---|---|"]
    for recipe in NAMED.values():
        models = ", ".join(m for (g, m), name in DEFAULTS.items() if name == recipe.recipe) or "(pinned only)"
        flags = "<br>".join(f"`--{k}={v}`" for k, v in recipe.flags().items())
        source = recipe.source.rsplit("/", 1)[-1]
        rows.append(
            f"| {recipe.generation} | {models} | `{recipe.recipe}` ({source}) | {recipe.measured or '-'} | {flags} |"
        )
    return "\n".join(rows)
