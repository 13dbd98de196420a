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

The table (:data:`RECIPES`) is MaxText's, at commit
``e591f30cbbf217ed67ef71263ec0538239f9c3b8`` of github.com/AI-Hypercomputer/maxtext:
flag groups from ``benchmarks/xla_flags_library.py``, combined per model in
``benchmarks/maxtext_trillium_model_configs.py`` (v6e, "Trillium") and
``benchmarks/maxtext_v5p_model_configs.py`` (v5p). Each :class:`Recipe` names
the recipe (the ``MaxTextModel`` variable) and the groups it takes. A model
without its own recipe gets the generation's ``*`` entry: the groups every
dense-model recipe of that generation shares. Generations with no recipe here
(v5litepod, v4) get no flags. Recipe flags that the trainer image's libtpu
refuses on a generation (:data:`REFUSED`, measured by preflight) are left out.

A profile (``libtpu_flags``) or a stage (``libtpu_flags``) adds flags or removes
table flags by name (:func:`resolve`); the stage's changes apply after the profile's.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

#: The environment variable libtpu reads its flags from.
ENV = "LIBTPU_INIT_ARGS"

#: A libtpu flag name, without its ``--`` (absl flag names; libtpu's include ``2a886c8_chip_config_name``).
FLAG_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_]*$")

_MAXTEXT = "AI-Hypercomputer/maxtext@e591f30 benchmarks/"
LIBRARY = _MAXTEXT + "xla_flags_library.py"
TRILLIUM = _MAXTEXT + "maxtext_trillium_model_configs.py"
V5P = _MAXTEXT + "maxtext_v5p_model_configs.py"

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
        recipe: The ``MaxTextModel`` variable in it (``llama3_70b_8192``).
        groups: The :data:`GROUPS` it concatenates, in its order.
        extra: Flags it appends after the groups (a later value of a flag wins, as in absl).
        note: Why this recipe is the row (shown in docs and ``render``).
    """

    source: str
    recipe: str
    groups: tuple[str, ...]
    extra: tuple[tuple[str, str], ...] = ()
    note: str = ""

    def flags(self) -> dict[str, str]:
        """Flag name -> value, in the recipe's order (a repeated flag keeps its first place, last value)."""
        out: dict[str, str] = {}
        for group in self.groups:
            out.update(GROUPS[group])
        out.update(self.extra)
        return out


#: (TPU generation, MaxText model_name or ``*``) -> recipe. Generation names are :mod:`multislice.tpu`'s.
RECIPES: dict[tuple[str, str], Recipe] = {
    ("v6e", "llama3-8b"): Recipe(
        TRILLIUM,
        "llama3_8b_8192",
        ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER"),
        note="Llama 3 8B on v6e (model_type llama3-8b)",
    ),
    ("v6e", "llama3-70b"): Recipe(
        TRILLIUM,
        "llama3_70b_8192",
        ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER", "HOST_OFFLOAD_FLAGS"),
        extra=(("xla_tpu_scheduler_percent_shared_memory_limit", "90"),),
        note="Llama 3 70B on v6e (model_type llama3-70b, optimizer_memory_host_offload: true, as our 70B stage)",
    ),
    ("v6e", "llama3.1-70b"): Recipe(
        TRILLIUM,
        "llama3_1_70b_8192",
        (
            "DENSE_VMEM_LIMIT_FLAG",
            "LAYOUT_FOR_ALL_REDUCE_SCATTER",
            "DATA_PARALLEL_OVERLAP",
            "CF_FOR_ALL_GATHER",
            "HOST_OFFLOAD_FLAGS",
        ),
        note="Llama 3.1 70B on v6e (model_type llama3.1-70b): adds the reduce-scatter layout and DCN data-parallel "
        "all-reduce optimisation",
    ),  # fmt: skip
    ("v6e", "*"): Recipe(
        TRILLIUM,
        "llama3_8b_8192",
        ("DENSE_VMEM_LIMIT_FLAG", "CF_FOR_ALL_GATHER"),
        note="any other model on v6e: the groups every dense Llama recipe of the file sets",
    ),
    ("v5p", "*"): Recipe(
        V5P,
        "llama2_70b_v5p_128",
        ("DATA_PARALLEL_OVERLAP", "CF_FOR_ALL_GATHER"),
        note="any model on v5p: the dense Llama 2 7B / 70B and GPT-3 175B recipes of the file all set these",
    ),
}


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
REFUSED: dict[str, dict[str, str]] = {
    "v6e": {
        name: f"libtpu {LIBTPU_VERSION} refuses continuation fusion on v6e (FAILED_PRECONDITION: not "
        "supported/recommended on platforms other than TPU v5e)"
        for name in CONTINUATION_FUSION
    },
}


def recipe_for(generation: str, model_name: str | None) -> Recipe | None:
    """The table row for a generation (``v6e``) and MaxText ``model_name`` (None: a custom model), or None."""
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


def table_flags(generation: str, model_name: str | None) -> dict[str, str]:
    """The table's flags for a generation and model: the recipe's, less those :data:`REFUSED` there."""
    row = recipe_for(generation, model_name)
    refused = REFUSED.get(generation, {})
    return {k: v for k, v in (row.flags() if row else {}).items() if k not in refused}


def resolve(
    generation: str,
    model_name: str | None,
    changes: list[tuple[dict[str, str | int | float | bool], tuple[str, ...]]],
) -> dict[str, str]:
    """The flags of a stage: the table's (:func:`table_flags`), then each ``(add, remove)`` change in order.

    Args:
        generation: TPU generation name (:attr:`multislice.tpu.TpuGeneration.name`).
        model_name: The stage's MaxText ``model_name`` (None for a custom model).
        changes: ``(add, remove)`` pairs: ``remove`` drops flags by name, then ``add`` sets (or overrides) them.

    Returns:
        Flag name -> value (strings), in order; empty for a generation without a recipe.
    """
    flags = table_flags(generation, model_name)
    for add, remove in changes:
        for name in remove:
            flags.pop(name, None)
        flags.update({name: render_value(value) for name, value in add.items()})
    return flags


def init_args(flags: dict[str, str]) -> str:
    """``LIBTPU_INIT_ARGS``'s value: ``--name=value`` joined by single spaces (empty for no flags)."""
    return " ".join(f"--{name}={value}" for name, value in flags.items())


def table_markdown() -> str:
    """The table as Markdown rows (generation, model, recipe, source, flags), for docs/preflight.md."""
    rows = ["| generation | model | MaxText recipe (file) | flags |", "|---|---|---|---|"]
    for (generation, model), recipe in RECIPES.items():
        flags = "<br>".join(f"`--{k}={v}`" for k, v in recipe.flags().items())
        rows.append(f"| {generation} | {model} | `{recipe.recipe}` ({recipe.source.rsplit('/', 1)[-1]}) | {flags} |")
    return "\n".join(rows)
