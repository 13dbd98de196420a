"""Facts about MaxText 0.2.5 that the pipeline environment needs without importing it.

The pipeline environment cannot install MaxText (its dependency pins clash
with kfp's), yet config validation must know MaxText's model names,
parallelism axes, remat policies and defaults. They are copied here from the
MaxText 0.2.5 sources named on each constant; ``tests/backends/local/test_trainer_env.py``
checks every one against the installed MaxText in the trainer environment.
"""

from __future__ import annotations

import difflib
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    import jsonschema

MAXTEXT_VERSION = "0.2.5"

#: Module whose ``main`` trains (``maxtext/trainers/pre_train/train.py``).
TRAIN_MODULE = "maxtext.trainers.pre_train.train"
#: Our module every training pod runs (``python -m``; :mod:`multislice.trainer.worker`, trainer image): named here for
#: the layers that start it without importing the trainer's code (render, the local backend).
WORKER_MODULE = "multislice.trainer.worker"

#: ``ModelName`` in ``maxtext/configs/types.py``: values of ``model_name``.
MODEL_NAMES: tuple[str, ...] = (
    "default", "llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3.1-8b-Instruct",
    "llama3-70b", "llama3.1-70b-Instruct", "llama3.1-8b", "llama3.1-70b", "llama3.1-405b",
    "llama3.3-70b", "mistral-7b", "mixtral-8x7b", "mixtral-8x22b", "deepseek2-16b",
    "deepseek2-236b", "deepseek3-671b", "deepseek3-671b-2dfsdp", "deepseek3-671b-batchsplit",
    "deepseek3-671b-lineage", "deepseek3-test", "deepseek3-tiny", "deepseek3.2-671b",
    "deepseek4-tiny", "deepseek4-284b", "deepseek-custom", "kimi-k2-1t", "gemma-7b", "gemma-2b",
    "gemma2-2b", "gemma2-9b", "gemma2-27b", "gemma3-4b", "gemma3-12b", "gemma3-27b", "gemma4-26b",
    "gemma4-31b", "gemma4-e2b", "gemma4-e4b", "maxtext-omni-gemma3-qwen3", "qwen2.5-1.5b",
    "qwen2.5-7b", "qwen2.5-14b", "qwen3-0.6b", "qwen3-1.7b", "qwen3-1.7b-base", "qwen3-4b",
    "qwen3-4b-base", "qwen3-4b-thinking-2507", "qwen3-8b", "qwen3-8b-base", "qwen3-14b",
    "qwen3-14b-base", "qwen3-32b", "qwen3-235b-a22b", "qwen3-30b-a3b", "qwen3-30b-a3b-base",
    "qwen3-480b-a35b", "qwen3-vl-2b", "qwen3-vl-4b", "qwen3-vl-30b-a3b", "weaver-mini",
    "weaver-max", "qwen3-next-80b-a3b", "qwen3-omni-30b-a3b", "qwen3-custom-30b-a3b",
    "qwen3.5-35b-a3b", "qwen3.5-35b-a3b-fp8", "qwen3.5-35b-fp8", "qwen3.5-397b-a17b",
    "qwen3.5-397b-a17b-fp8", "gpt3-175b", "gpt3-22b", "gpt3-6b", "gpt3-52k", "gpt-oss-20b",
    "gpt-oss-120b", "llama4-17b-16e", "llama4-17b-128e", "olmo3-7b", "olmo3-7b-pt", "olmo3-32b",
    "envy-test", "envy-switch-base", "envy-switch-large", "envy-switch-xxl",
)  # fmt: skip

#: Parallelism axes: MaxText reads ``ici_<axis>_parallelism`` and
#: ``dcn_<axis>_parallelism`` for each (``maxtext/configs/base.yml``).
PARALLELISM_AXES: tuple[str, ...] = (
    "diloco", "data", "fsdp", "fsdp_transpose", "sequence", "context", "context_usp_ulysses",
    "context_autoregressive", "tensor", "tensor_sequence", "autoregressive", "pipeline", "expert",
)  # fmt: skip

#: MaxText's defaults for the axes not set to 1 (``maxtext/configs/base.yml``):
#: FSDP fills the slice over ICI and data parallelism fills the slices over DCN.
ICI_DEFAULTS: dict[str, int] = {"fsdp": -1}
DCN_DEFAULTS: dict[str, int] = {"data": -1}

#: ``RematPolicy`` in ``maxtext/configs/types.py``.
REMAT_POLICIES: tuple[str, ...] = (
    "full", "minimal", "save_dot_with_context_except_mlp", "save_dot_except_mlpwi",
    "save_dot_except_mlp", "save_qkv_proj", "qkv_proj_offloaded", "custom", "minimal_offloaded",
    "save_out_proj",
)  # fmt: skip

#: Keys that map a model given by explicit dims (``maxtext/configs/models/llama3-8b.yml``).
MODEL_DIM_KEYS: dict[str, str] = {
    "emb_dim": "base_emb_dim",
    "num_query_heads": "base_num_query_heads",
    "num_kv_heads": "base_num_kv_heads",
    "num_decoder_layers": "base_num_decoder_layers",
    "mlp_dim": "base_mlp_dim",
    "head_dim": "head_dim",
    "vocab_size": "vocab_size",
}

#: ``mesh_axes`` of ``maxtext/configs/base.yml``: the device mesh's axes, in order. Its first axis is
#: ``diloco`` (size 1 unless DiLoCo is on).
MESH_AXES: tuple[str, ...] = (
    "diloco", "data", "stage", "fsdp", "fsdp_transpose", "context", "context_usp_ulysses",
    "context_autoregressive", "tensor", "tensor_sequence", "expert", "autoregressive",
)  # fmt: skip

#: Emergency (two-tier) checkpointing's keys (``maxtext/configs/base.yml``, ``EmergencyCheckpointing`` in
#: ``maxtext/configs/types.py``): set from a stage's ``emergency_checkpoint`` (:mod:`multislice.plan`).
EMERGENCY_CHECKPOINT_KEYS: tuple[str, ...] = (
    "enable_emergency_checkpoint", "local_checkpoint_directory", "local_checkpoint_period",
)  # fmt: skip
#: MaxText's multi-tier checkpointing keys (same sources): set by the plan for a one-replica stage's
#: ``emergency_checkpoint`` (:func:`multislice.plan.emergency_checkpoint_args`), whose manager the worker extends
#: with the stage's persistent checkpoints (:mod:`multislice.trainer.tiered_checkpoint`).
MULTI_TIER_CHECKPOINT_KEYS: tuple[str, ...] = (
    "enable_multi_tier_checkpointing", "multi_tier_checkpointing_backup_interval_minutes",
    "multi_tier_checkpointing_backup_interval_steps", "mtc_data_parallelism", "use_replicator_service",
    "replicator_backup_interval_minutes",
)  # fmt: skip
#: Every key of a local checkpoint tier the plan may set: a stage's CPU variant, which has no checkpoint ramdisk,
#: leaves them out (:func:`multislice.render.jobset.worker_command`).
LOCAL_TIER_KEYS: frozenset[str] = frozenset({*EMERGENCY_CHECKPOINT_KEYS, *MULTI_TIER_CHECKPOINT_KEYS, "mesh_axes"})

#: The MaxText keys the plan sets itself; stage ``maxtext_overrides`` may not.
MANAGED_KEYS: frozenset[str] = frozenset(
    {
        "run_name", "base_output_directory", "model_name", "steps", "per_device_batch_size",
        "max_target_length", "remat_policy", "enable_checkpointing", "checkpoint_period",
        "hardware", "num_slices", "metrics_file", "jax_cache_dir", "skip_jax_distributed_system",
        "compile_topology", "compile_topology_num_slices", *EMERGENCY_CHECKPOINT_KEYS,
        # set from the stage's data and tokenizer (multislice.config.data)
        "dataset_type", "grain_file_type", "grain_train_files", "grain_eval_files", "train_data_columns",
        "eval_data_columns", "tokenize_train_data", "tokenize_eval_data", "hf_path", "hf_data_dir",
        "hf_train_files", "hf_eval_split", "train_split", "eval_split", "dataset_path", "dataset_name",
        "eval_dataset_name", "tokenizer_type", "tokenizer_path", "add_bos", "add_eos", "eval_interval",
        "eval_steps",
    }
    | {f"{net}_{axis}_parallelism" for net in ("ici", "dcn") for axis in PARALLELISM_AXES}
    | set(MODEL_DIM_KEYS.values())
)  # fmt: skip


#: MaxText keys that hold credentials: refused in ``maxtext_overrides`` (they would be plain text in the JobSet's
#: args and the compiled pipeline); the token reaches the pods as ``$HF_TOKEN`` from a Secret instead.
SECRET_KEYS: frozenset[str] = frozenset({"hf_access_token"})


def format_value(value: object) -> str:
    """Format a Python value as MaxText's OmegaConf command line expects.

    ``True`` becomes ``true``, lists become ``[a,b]``; other values use ``str``.
    """
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(format_value(v) for v in value) + "]"
    return str(value)


#: Dense-model dims of the Llama 2 / Llama 3 family, for the memory model
#: (``maxtext/configs/models/<name>.yml``: ``base_emb_dim``, ``base_num_query_heads``,
#: ``base_num_kv_heads``, ``base_num_decoder_layers``, ``base_mlp_dim``, ``head_dim``,
#: ``vocab_size``; all use ``mlp_activations: [silu, linear]`` and no tied embedding).
#: ``tests/backends/local/test_trainer_env.py`` checks each against the installed MaxText.
MODEL_DIMS: dict[str, dict[str, int]] = {
    name: dict(zip(("emb_dim", "num_query_heads", "num_kv_heads", "num_decoder_layers", "mlp_dim", "head_dim",
                    "vocab_size"), dims, strict=True))
    for name, dims in {
        "llama2-7b": (4096, 32, 32, 32, 11008, 128, 32000),
        "llama2-13b": (5120, 40, 40, 40, 13824, 128, 32000),
        "llama2-70b": (8192, 64, 8, 80, 28672, 128, 32000),
        "llama3-8b": (4096, 32, 8, 32, 14336, 128, 128256),
        "llama3-70b": (8192, 64, 8, 80, 28672, 128, 128256),
        "llama3.1-8b": (4096, 32, 8, 32, 14336, 128, 128256),
        "llama3.1-70b": (8192, 64, 8, 80, 28672, 128, 128256),
        "llama3.1-405b": (16384, 128, 8, 126, 53248, 128, 128256),
        "llama3.3-70b": (8192, 64, 8, 80, 28672, 128, 128256),
    }.items()
}  # fmt: skip

#: Vocabulary sizes of tokenizers the maxtext package ships, by path inside it: Llama 3's tiktoken file holds
#: 128000 ranks, and ``TikTokenTokenizer`` (``maxtext/input_pipeline/tokenizer.py``) adds 256 special tokens.
#: ``tests/backends/local/test_trainer_env.py`` checks each against the installed MaxText.
TOKENIZER_VOCAB_SIZES: dict[str, int] = {"assets/tokenizers/tokenizer_llama3.tiktoken": 128256}
#: Special tokens ``TikTokenTokenizer`` adds after a tiktoken file's ranks (``num_reserved_special_tokens``).
TIKTOKEN_SPECIAL_TOKENS = 256

#: Bytes per element of MaxText's ``weight_dtype`` values (``maxtext/configs/base.yml``: default float32).
DTYPE_BYTES: dict[str, int] = {"float32": 4, "bfloat16": 2}

# MaxText's multi-process CPU path (``maxtext/utils/max_utils.py``, ``initialize_jax_for_cpu``): the
# coordinator is process 0 at a fixed port, and each process finds its place from these variables,
# which xpk sets for CPU workloads through the downward API (``src/xpk/core/docker_resources.py``).
# MaxText skips its own initialisation when ``jax.distributed`` is already initialised
# (``maybe_initialize_jax_distributed_system``), so our worker initialises it first, at the port
# ``JAX_COORDINATOR_PORT`` names: on a cluster every pod has its own network namespace and MaxText's
# port is kept; the local backend gives each JobSet attempt a free port of this machine instead.

#: MaxText's JAX coordinator port on CPU: ``coordinator_ip_address + ":1234"``.
CPU_COORDINATOR_PORT = 1234
#: The coordinator's port, read by our worker (not by MaxText); :data:`CPU_COORDINATOR_PORT` when unset.
ENV_COORDINATOR_PORT = "JAX_COORDINATOR_PORT"
#: The DNS name (or address) of process 0, the coordinator.
ENV_COORDINATOR_ADDRESS = "JAX_COORDINATOR_ADDRESS"
#: The child Job (slice) index of the process: ``process_index = JOB_INDEX * PROCESSES_IN_JOB + ...``
ENV_JOB_INDEX = "JOB_INDEX"
#: ... ``+ JOB_COMPLETION_INDEX`` (the host within the slice).
ENV_JOB_COMPLETION_INDEX = "JOB_COMPLETION_INDEX"
#: Processes (hosts) per child Job.
ENV_PROCESSES_IN_JOB = "PROCESSES_IN_JOB"
#: Processes in all.
ENV_PROCESS_COUNT = "JAX_PROCESS_COUNT"


#: MaxText's config schema, extracted from the installed MaxText by :mod:`multislice.trainer.maxtext_schema`
#: (every key of ``MaxTextConfig`` in ``maxtext/configs/types.py`` with its JSON Schema, and the activation
#: names of ``maxtext/layers/linears.py``); ``tests/backends/local/test_trainer_env.py`` checks it matches the
#: installed MaxText.
CONFIG_SCHEMA_FILE = Path(__file__).resolve().parent / "data" / "maxtext_config_schema.json"


@functools.cache
def config_schema() -> dict[str, Any]:
    """The committed MaxText config schema (:data:`CONFIG_SCHEMA_FILE`) as data."""
    return json.loads(CONFIG_SCHEMA_FILE.read_text(encoding="utf-8"))


def decoder_blocks() -> tuple[str, ...]:
    """``DecoderBlockType`` values (``maxtext/common/common_types.py``): what ``decoder_block`` accepts."""
    return tuple(config_schema()["fields"]["decoder_block"]["enum"])


def activations() -> tuple[str, ...]:
    """Names ``mlp_activations`` accepts: ``linear``, ``sqrtsoftplus`` or a ``jax.nn`` function."""
    return tuple(config_schema()["activations"])


@functools.cache
def _key_validator(key: str) -> jsonschema.Draft202012Validator:
    import jsonschema  # the pipeline environment's; the trainer environment never validates overrides

    return jsonschema.Draft202012Validator(config_schema()["fields"][key])


def override_problem(key: str, value: Any) -> str | None:
    """Why MaxText would refuse ``key=value`` on its command line, or None.

    The key must be a field of MaxText's ``MaxTextConfig`` (``extra="forbid"``) and the value valid
    for its type, enum and bounds. A string value is also tried as MaxText's command line would read it
    (a YAML scalar or list, as OmegaConf does), so ``"true"`` passes for a boolean key.
    """
    from jsonschema.exceptions import best_match  # the pipeline environment's, as in _key_validator

    fields = config_schema()["fields"]
    if key not in fields:
        close = difflib.get_close_matches(key, fields, n=3, cutoff=0.75)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        return (
            f"MaxText {MAXTEXT_VERSION} has no config key {key!r} (it would refuse it when the pod starts); "
            f"{hint}see maxtext/configs/base.yml for its keys"
        )
    validator = _key_validator(key)
    candidates = [value]
    if isinstance(value, str):
        try:
            candidates.append(yaml.safe_load(value))
        except yaml.YAMLError:
            pass
    if any(validator.is_valid(candidate) for candidate in candidates):
        return None
    error = best_match(validator.iter_errors(value))
    detail = error.message if error else "not valid for its type"
    return f"{key}={value!r} is not a value MaxText {MAXTEXT_VERSION} accepts: {detail}"


def _integer_schema(schema: dict[str, Any]) -> bool:
    """Whether a JSON Schema admits integers and no other number (``integer``, optionally or null)."""
    kinds = {schema.get("type")} | {s.get("type") for s in schema.get("anyOf", [])}
    return "integer" in kinds and "number" not in kinds


def restore_integers(key: str, value: Any) -> Any:
    """``value`` for MaxText's config key ``key`` with a whole float made an int where the key takes integers.

    A profile that went through a KFP pipeline reaches the plan task with every number a float: the compiler stores
    a ``dict`` parameter as a protobuf ``Struct`` (kfp ``compiler/pipeline_spec_builder.py``, ``to_protobuf_value``:
    ``number_value``, a double), which reads back as ``0.0`` for a YAML ``0``. MaxText's integer keys
    (``grain_worker_count``) would then get ``0.0`` on its command line. Read from MaxText's schema
    (:func:`config_schema`); a list of integers item by item; any other value, or an unknown key, is returned as is.
    """
    schema = config_schema()["fields"].get(key)
    if schema is None:
        return value
    if isinstance(value, list):
        items = [schema.get("items", {})] + [s.get("items", {}) for s in schema.get("anyOf", [])]
        if any(_integer_schema(item) for item in items if item):
            return [int(v) if isinstance(v, float) and v.is_integer() else v for v in value]
        return value
    if isinstance(value, float) and value.is_integer() and _integer_schema(schema):
        return int(value)
    return value
