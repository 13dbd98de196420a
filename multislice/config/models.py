"""The run spec's models: what a user writes in ``configs/<profile>.yaml`` or changes per run.

Per-field checks live on the models (pydantic validators); checks across
fields are in :mod:`.checks`; loading, model presets and overrides in
:mod:`.profiles` and :mod:`.overrides`.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from multislice import libtpu_flags, maxtext, names, tpu
from multislice.config import values
from multislice.config.data import HF_PREFIX as HF_GLOB_PREFIX
from multislice.config.data import DataSpec, SyntheticData, TokenizerSpec, tokenizer_vocab_issue
from multislice.config.values import INT32_MAX, INT32_MIN, MAX_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS

#: A Compute Engine zone (``us-east5-b``); a region has no final letter (``us-east5``).
ZONE = re.compile(r"^[a-z]+-[a-z]+[0-9]+-[a-z]$")
#: OAuth scopes (https://developers.google.com/identity/protocols/oauth2/scopes).
GOOGLE_SCOPE_PREFIX = "https://www.googleapis.com/auth/"
CLOUD_PLATFORM_SCOPE = GOOGLE_SCOPE_PREFIX + "cloud-platform"
#: Scopes under which a node's service account may write Cloud Storage (gs:// checkpoints).
STORAGE_WRITE_SCOPES = frozenset(
    {
        CLOUD_PLATFORM_SCOPE,
        GOOGLE_SCOPE_PREFIX + "devstorage.read_write",
        GOOGLE_SCOPE_PREFIX + "devstorage.full_control",
    }
)

#: A Hugging Face Hub repository id, ``OWNER/NAME`` (huggingface_hub ``validate_repo_id``: letters, digits,
#: ``-``, ``_``, ``.``; at most 96 characters; no leading or trailing ``-`` or ``.``; no ``--`` or ``..``).
HUB_REPO = re.compile(
    r"(?!.*(--|\.\.))[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?/[A-Za-z0-9_](?:[A-Za-z0-9_.-]{0,94}[A-Za-z0-9_])?"
)
#: The Kubernetes Secret (key ``token``) the export Job reads ``HF_TOKEN`` from on GKE, when named.
HUB_TOKEN_KEY = "token"

#: Most steps a stage may train: MaxText counts steps in an int32 (JAX's default integer).
MAX_STEPS = INT32_MAX
#: Longest sequence a stage may train, tokens (2^20): far beyond any MaxText model's context, and a
#: bound that keeps ``per_device_batch_size * max_target_length`` representable.
MAX_TARGET_LENGTH = 2**20
#: Largest per-device batch, sequences per chip per step (2^16): no accelerator holds more.
MAX_PER_DEVICE_BATCH = 2**16
#: Largest model dimension (embedding, heads, layers, MLP, vocabulary): int32.
MAX_DIM = INT32_MAX


def _value_check(problem: str | None, value: Any) -> Any:
    if problem:
        raise ValueError(problem)
    return value


def _wait_seconds(value: float | None) -> float | None:
    """``value`` (a timeout or wait, seconds) when unset or at least :data:`MIN_TIMEOUT_SECONDS`.

    Raises:
        ValueError: a shorter one (``1e-300``, 0, a negative): the waits become whole-second fields, where it
            would be no wait at all (:data:`multislice.config.values.MIN_TIMEOUT_SECONDS`).
    """
    if value is not None and not value >= MIN_TIMEOUT_SECONDS:
        raise ValueError(
            f"{value:g} s is under {MIN_TIMEOUT_SECONDS:g} s, the shortest wait a step can be given (waits become "
            "whole-second fields such as a pod's activeDeadlineSeconds, where less than a second is no wait at "
            f"all); give at least {MIN_TIMEOUT_SECONDS:g} s"
        )
    return value


def _selector_check(value: dict[str, str], field: str) -> dict[str, str]:
    """``value`` when it is a nodeSelector the API server accepts: every key a label key and every value a label
    value (:func:`.values.label_key_problem`, :func:`.values.label_value_problem`: Kubernetes' ``IsQualifiedName``
    and ``IsValidLabelValue``).

    Raises:
        ValueError: naming ``field``, the key and the fix.
    """
    fix = f"e.g. {field}: {{cloud.google.com/gke-nodepool: cpu-pool}}"
    for key, label in value.items():
        problem = values.label_key_problem(key) or values.label_value_problem(label)
        if problem:
            raise ValueError(f"{field}[{key[:80]!r}]: {problem}; {fix}")
    return value


class _Strict(BaseModel):
    # allow_inf_nan=False: every float field is finite (.inf and .nan are refused).
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class ModelSpec(_Strict):
    """The model a stage trains: a MaxText ``model_name`` or explicit dims.

    With ``name``, MaxText loads ``maxtext/configs/models/<name>.yml``. With
    dims, the stage describes its own architecture in MaxText's terms
    (``decoder_block``, ``base_emb_dim``, ...), e.g. Llama 3's architecture
    (decoder block ``llama2``, SwiGLU ``[silu, linear]``, GQA, RoPE 500000)
    at a size a CPU can train.
    """

    name: str | None = Field(default=None, description="MaxText model_name, e.g. llama3-8b.")
    description: str = ""
    decoder_block: str | None = None
    emb_dim: int | None = Field(default=None, gt=0, le=MAX_DIM)
    num_query_heads: int | None = Field(default=None, gt=0, le=MAX_DIM)
    num_kv_heads: int | None = Field(default=None, gt=0, le=MAX_DIM)
    num_decoder_layers: int | None = Field(default=None, gt=0, le=MAX_DIM)
    mlp_dim: int | None = Field(default=None, gt=0, le=MAX_DIM)
    head_dim: int | None = Field(default=None, gt=0, le=MAX_DIM)
    vocab_size: int | None = Field(default=None, gt=0, le=MAX_DIM)
    mlp_activations: tuple[str, ...] | None = None
    rope_max_timescale: int | None = Field(default=None, gt=0, le=MAX_DIM)
    normalization_layer_epsilon: float | None = Field(default=None, gt=0)
    logits_via_embedding: bool | None = None
    enable_dropout: bool | None = None

    @field_validator("decoder_block")
    @classmethod
    def _decoder_block(cls, value: str | None) -> str | None:
        if value is not None and value not in maxtext.decoder_blocks():
            raise ValueError(
                f"unknown decoder_block {value!r}; MaxText {maxtext.MAXTEXT_VERSION}'s are "
                f"{', '.join(maxtext.decoder_blocks())} (DecoderBlockType)"
            )
        return value

    @field_validator("mlp_activations")
    @classmethod
    def _activations(cls, value: tuple[str, ...] | None) -> tuple[str, ...] | None:
        unknown = [a for a in value or () if a not in maxtext.activations()]
        if unknown:
            raise ValueError(
                f"unknown activation {unknown[0]!r}; MaxText accepts linear, sqrtsoftplus or a jax.nn "
                f"function: {', '.join(maxtext.activations())}"
            )
        return value

    @model_validator(mode="after")
    def _name_or_dims(self) -> ModelSpec:
        dims = {k: v for k, v in self.dim_fields().items() if v is not None}
        if self.name is not None:
            if self.name not in maxtext.MODEL_NAMES or self.name == "default":
                close = [n for n in maxtext.MODEL_NAMES if n.split("-")[0] == self.name.split("-")[0]]
                hint = f" (did you mean one of {', '.join(close)}?)" if close else ""
                raise ValueError(
                    f"unknown MaxText model_name {self.name!r}{hint}; use a name from MaxText "
                    f"{maxtext.MAXTEXT_VERSION}'s configs/models, or give explicit dims instead of a name"
                )
            if dims:
                raise ValueError(
                    f"give either a MaxText model name or explicit dims, not both (name={self.name!r} "
                    f"with {', '.join(sorted(dims))}); remove one"
                )
            return self
        required = ("decoder_block", *maxtext.MODEL_DIM_KEYS)
        missing = [k for k in required if getattr(self, k) is None]
        if missing:
            raise ValueError(f"a model without a MaxText name needs explicit dims; missing {', '.join(missing)}")
        heads, kv_heads = self.num_query_heads, self.num_kv_heads
        if heads is not None and kv_heads is not None and heads % kv_heads:
            raise ValueError(
                f"num_query_heads ({self.num_query_heads}) must be a multiple of num_kv_heads "
                f"({self.num_kv_heads}) for grouped-query attention"
            )
        return self

    def dim_fields(self) -> dict[str, Any]:
        """The architecture fields (everything but name and description)."""
        return {k: getattr(self, k) for k in type(self).model_fields if k not in ("name", "description")}

    @property
    def label(self) -> str:
        """A short human name: the MaxText name, or a description of the dims."""
        if self.name:
            return self.name
        return self.description or (
            f"{self.decoder_block} {self.num_decoder_layers}L emb{self.emb_dim} vocab{self.vocab_size}"
        )

    def maxtext_args(self) -> dict[str, Any]:
        """MaxText keys for this model: ``model_name`` or ``base_emb_dim`` etc."""
        if self.name:
            return {"model_name": self.name}
        args: dict[str, Any] = {}
        for key, value in self.dim_fields().items():
            if value is not None:
                args[maxtext.MODEL_DIM_KEYS.get(key, key)] = value
        return args


def _check_parallelism(value: dict[str, int], net: str) -> dict[str, int]:
    for axis, degree in value.items():
        if axis not in maxtext.PARALLELISM_AXES:
            raise ValueError(
                f"unknown {net.upper()} axis {axis!r}; MaxText's axes are {', '.join(maxtext.PARALLELISM_AXES)}"
            )
        if degree != -1 and degree < 1:
            raise ValueError(f"{net}.{axis} is {degree}; use a positive degree, or -1 to fill")
    if sum(1 for d in value.values() if d == -1) > 1:
        raise ValueError(f"at most one {net.upper()} axis may be -1 (MaxText fills one axis)")
    return value


class ElasticSpec(_Strict):
    """Elastic training of a stage on Spot or flex-start capacity: lose a slice, keep training on fewer.

    The stage runs on any slice count ``k`` in ``[min_slices, max_slices]``; ``max_slices`` is the
    profile's ``num_slices`` (``N``). On ``k < N`` slices the lost data parallelism becomes gradient
    accumulation: MaxText's ``gradient_accumulation_steps`` (``maxtext/configs/types.py``, a
    ``PositiveInt``; ``global_batch_size_to_train_on = per_device_batch_size x devices x
    gradient_accumulation_steps``) is multiplied by ``N / k``, so the global batch, the step sequence and
    the learning-rate schedule do not change. When ``N / k`` is not a whole number, ``on_indivisible``
    says what to do: ``wait`` (the stage does not run on ``k`` slices; it waits for capacity, or shrinks
    further to a count that keeps the batch) or ``shrink_batch`` (``floor(N / k)`` micro-batches: a
    smaller global batch, stated in the plan and the train report).

    Attributes:
        min_slices: Fewest slices the stage trains on (>= 1).
        max_slices: Most slices; must equal ``num_slices`` (default: it).
        wait_for_lost_slice_seconds: How long a lost slice's capacity may take to return before the
            stage is relaunched on the slices that remain, seconds.
        on_indivisible: ``wait`` or ``shrink_batch`` (see above).
    """

    min_slices: int = Field(ge=1, le=INT32_MAX, description="Fewest slices the stage trains on.")
    max_slices: int | None = Field(
        default=None, ge=1, le=INT32_MAX, description="Most slices: the profile's num_slices."
    )
    wait_for_lost_slice_seconds: float = Field(
        default=300,
        ge=0,
        le=MAX_TIMEOUT_SECONDS,
        description="Seconds to wait for a lost slice's capacity before shrinking.",
    )
    on_indivisible: Literal["wait", "shrink_batch"] = Field(
        default="wait",
        description="When num_slices / k is not whole: wait for capacity, or train a smaller global batch.",
    )

    @model_validator(mode="after")
    def _order(self) -> ElasticSpec:
        if self.max_slices is not None and self.min_slices > self.max_slices:
            raise ValueError(
                f"min_slices ({self.min_slices}) exceeds max_slices ({self.max_slices}); make min_slices at most "
                "max_slices"
            )
        return self


class LibtpuFlagsSpec(_Strict):
    """Changes to the libtpu / XLA:TPU flags of the table (:mod:`multislice.libtpu_flags`).

    The table gives each stage MaxText's recipe flags for its TPU generation and model; ``remove`` drops
    some by name, then ``add`` sets flags (a new one, or a table flag with another value). On a profile
    the changes apply to every stage; a stage's own apply after the profile's. Names are libtpu's,
    without the leading ``--`` (``xla_tpu_scoped_vmem_limit_kib``).
    """

    add: dict[str, str | int | float | bool] = Field(
        default_factory=dict, description="Flags to set, name -> value (true/false, a number or a word)."
    )
    remove: tuple[str, ...] = Field(default=(), description="Table flags to leave out, by name.")
    recipe: str | None = Field(
        default=None,
        description="Pin this MaxText recipe's flags (its MaxTextModel name in multislice.libtpu_flags.NAMED, e.g. "
        "llama3_8b_8192) instead of the generation's default row for the model; a stage's pin wins over the "
        "profile's. None: the default row.",
    )

    @field_validator("recipe")
    @classmethod
    def _recipe(cls, value: str | None) -> str | None:
        if value is not None and value not in libtpu_flags.NAMED:
            raise ValueError(
                f"recipe: {value!r} is not a recipe of the table; use one of {', '.join(libtpu_flags.NAMED)}"
            )
        return value

    @field_validator("add")
    @classmethod
    def _add(cls, value: dict[str, Any]) -> dict[str, Any]:
        # A whole float is a YAML integer that came through a KFP pipeline (its dict parameters are protobuf Structs,
        # every number a double): an integer flag refuses "81920.0", a float flag reads "1" as 1.0.
        value = {
            name: int(item) if isinstance(item, float) and item.is_integer() else item for name, item in value.items()
        }
        for name, item in value.items():
            problem = libtpu_flags.name_problem(name)
            if problem:
                raise ValueError(f"add: {problem}")
            problem = libtpu_flags.value_problem(item)
            if problem:
                raise ValueError(f"add.{name}: {problem}")
        return value

    @field_validator("remove")
    @classmethod
    def _remove(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        for name in value:
            problem = libtpu_flags.name_problem(name)
            if problem:
                raise ValueError(f"remove: {problem}")
        return value

    @model_validator(mode="after")
    def _both(self) -> LibtpuFlagsSpec:
        both = sorted(set(self.add) & set(self.remove))
        if both:
            raise ValueError(
                f"{', '.join(both)} is both in add and in remove; keep it in add to change its value, "
                "or in remove to leave it out"
            )
        return self


#: The shape of a Hugging Face user access token (``hf_`` and 30 or more letters and digits).
_HF_TOKEN = re.compile(r"hf_[A-Za-z0-9]{30,}")


def _looks_like_token(value: Any) -> bool:
    """Whether a ``maxtext_overrides`` value holds a Hugging Face access token."""
    items = value if isinstance(value, list) else [value]
    return any(isinstance(item, str) and _HF_TOKEN.search(item) for item in items)


def data_lasts_issue(stage: Any, sequences: int, global_batch: float) -> str | None:
    """Why ``steps`` x ``global_batch`` (sequences per step across every slice) runs past the ``sequences`` the data
    holds (times MaxText's ``num_epoch``), or None.

    MaxText 0.2.5's grain pipeline repeats the data ``num_epoch`` times (``dataset.repeat(num_epoch)``, default 1
    in ``configs/base.yml``) and stops a run whose iterator is exhausted ("You may have run out of training data").
    An elastic stage keeps its global batch on fewer slices (gradient accumulation), so it reads the same count.
    """
    epochs = int(stage.maxtext_overrides.get("num_epoch", 1) or 1)
    need = int(stage.steps * round(global_batch))
    have = sequences * epochs
    if need <= have:
        return None
    most = have // max(round(global_batch), 1)
    return (
        f"steps: {stage.steps} steps x {round(global_batch)} sequences per step = {need:,} sequences, but the data "
        f"holds {sequences:,} training sequences"
        + (f" x num_epoch {epochs}" if epochs > 1 else "")
        + f"; MaxText would stop when they run out. Lower steps to at most {most}, add data, or set "
        f"maxtext_overrides.num_epoch: {-(-need // sequences)}"
    )


#: The mount path of the local (emergency) checkpoint tier in a training pod, by default: xpk's and MaxText's
#: examples mount GKE's checkpointing ramdisk at ``/local`` (MaxText ``configs/base.yml``, multi-tier example).
DEFAULT_LOCAL_CHECKPOINT_DIRECTORY = "/local"
_ABSOLUTE_PATH = re.compile(r"^(/[A-Za-z0-9._-]+)+$")
#: Pod paths the local tier may not be mounted over: the container's own system directories and /dev/shm.
_RESERVED_MOUNTS = ("/", "/dev", "/proc", "/sys", "/etc", "/usr", "/bin", "/lib", "/tmp", "/var", "/app")


class EmergencyCheckpointSpec(_Strict):
    """Emergency (two-tier) checkpoints of a stage on GKE: a local checkpoint every ``local_period`` steps in each
    node's checkpoint ramdisk (GKE's multi-tier checkpointing CSI driver, ``multitier-checkpoint.csi.storage.gke.io``,
    which keeps it across pod restarts; docs/gke-setup.md) beside the persistent ones, which go on every
    ``checkpoint_period`` steps to the stage's checkpoint directory, where verify and export read them.

    The plan picks MaxText's manager by the stage's shape (:func:`multislice.plan.emergency_checkpoint_args`): a
    fixed-size stage with 2 or more data-parallel replicas uses ``enable_emergency_checkpoint``, Orbax's emergency
    ``CheckpointManager`` (``orbax/checkpoint/experimental/emergency/checkpoint_manager.py``: the first replica
    writes the persistent tier, the others the local one; a restart takes the newest step of either tier, from a
    slice that holds it locally, broadcast to the others); an elastic stage, or one with one data-parallel replica
    (FSDP over DCN), uses ``enable_multi_tier_checkpointing`` with the persistent tier added by the worker
    (:mod:`multislice.trainer.tiered_checkpoint`: every host keeps its own shards; a restart on the same mesh whose
    hosts kept them restores from the ramdisk, anything else from the persistent tier). Where the rest of the spec
    rules the local tier out (the local backend, the Ray launcher, grain data, a ``local_period`` not under
    ``checkpoint_period``: :func:`multislice.config.checks.emergency_checkpoint_blockers`) the plan leaves it out
    and says why.

    Attributes:
        enabled: Whether the stage uses the two tiers (false keeps the settings but checkpoints as usual).
        local_period: Steps between local checkpoints (MaxText ``local_checkpoint_period``); fewer than the
            stage's ``checkpoint_period``.
        local_directory: Where the local tier is mounted in each training pod (MaxText
            ``local_checkpoint_directory``), an absolute path.
    """

    enabled: bool = Field(default=True, description="Use the local tier (false: persistent checkpoints only).")
    local_period: int = Field(
        gt=0, le=MAX_STEPS, description="Steps between local checkpoints (MaxText local_checkpoint_period)."
    )
    local_directory: str = Field(
        default=DEFAULT_LOCAL_CHECKPOINT_DIRECTORY,
        description="Mount path of the node's checkpoint ramdisk in each training pod (local_checkpoint_directory).",
    )

    @field_validator("local_directory")
    @classmethod
    def _local_directory(cls, value: str) -> str:
        if not _ABSOLUTE_PATH.fullmatch(value) or ".." in value.split("/"):
            raise ValueError(
                f"{value[:80]!r} is not an absolute path in the pod; give one like "
                f"{DEFAULT_LOCAL_CHECKPOINT_DIRECTORY} (letters, digits, '.', '_', '-' between slashes)"
            )
        if value in _RESERVED_MOUNTS or value.startswith("/dev/"):
            raise ValueError(
                f"{value} would hide the container's own {value} directory; mount the local tier elsewhere, e.g. "
                f"{DEFAULT_LOCAL_CHECKPOINT_DIRECTORY}"
            )
        return value


class Stage(_Strict):
    """One training stage: a model, a batch and a parallelism plan.

    ``ici`` and ``dcn`` map MaxText axis names (``fsdp``, ``tensor``, ``data``,
    ...) to degrees; -1 lets MaxText fill that axis. Axes not given take
    MaxText's defaults (ICI: fsdp -1, others 1; DCN: data -1, others 1).
    The ICI product must equal the chips of one slice and the DCN product the
    number of slices.
    """

    name: str = Field(description="DNS-1035 label; part of the JobSet name.")
    description: str = ""
    model: ModelSpec
    steps: int = Field(gt=0, le=MAX_STEPS, description="Training steps (MaxText steps), at most 2^31-1.")
    per_device_batch_size: float = Field(
        gt=0,
        le=MAX_PER_DEVICE_BATCH,
        description="Sequences per chip per step: finite, > 0, at most 2^16, and such that the global batch "
        "(times chips times slices) is a whole number.",
    )
    max_target_length: int = Field(gt=0, le=MAX_TARGET_LENGTH, description="Sequence length, tokens, at most 2^20.")
    ici: dict[str, int] = Field(default_factory=dict)
    dcn: dict[str, int] = Field(default_factory=dict)
    remat_policy: str = "full"
    checkpoint_period: int = Field(gt=0, le=MAX_STEPS, description="Steps between checkpoints.")
    data: DataSpec = Field(
        default_factory=SyntheticData, description="What the stage trains on (multislice.config.data); kind picks."
    )
    tokenizer: TokenizerSpec = Field(default_factory=TokenizerSpec, description="Ignored by synthetic data.")
    eval_interval: int = Field(
        default=-1, ge=-1, le=MAX_STEPS, description="Train steps between evals (MaxText eval_interval); -1: no eval."
    )
    eval_steps: int = Field(default=-1, ge=-1, le=MAX_STEPS, description="Batches per eval; -1: the whole eval split.")
    export: Literal["huggingface"] | None = Field(
        default=None,
        description="Export the final checkpoint after verification: huggingface (safetensors, config.json and "
        "the Llama 3 tokenizer, checked by its logits against MaxText's); null for none.",
    )
    export_dtype: Literal["bfloat16", "float32"] | None = Field(
        default=None,
        description="dtype of the exported weights; default bfloat16 for a model of 10^9 parameters or more, "
        "else float32.",
    )
    export_hub_repo: str | None = Field(
        default=None,
        description="Also publish the export to this Hugging Face Hub model repository (OWNER/NAME); the token comes "
        "from exporter.hub_token_secret (Secret Manager) or exporter.hub_token_kubernetes_secret (GKE), locally "
        "from $HF_TOKEN. Null: write to the run directory only.",
    )
    launcher: Literal["jobset", "ray"] | None = Field(
        default=None, description="How this stage is launched (jobset or ray); default: the run's launcher."
    )
    maxtext_overrides: dict[str, str | int | float | bool | list[str | int | float]] = Field(default_factory=dict)
    elastic: ElasticSpec | None = Field(
        default=None,
        description="Train on fewer slices when some are lost (Spot), same global batch; None: fixed size.",
    )
    libtpu_flags: LibtpuFlagsSpec = Field(
        default_factory=LibtpuFlagsSpec,
        description="Changes to this stage's libtpu/XLA flags (LIBTPU_INIT_ARGS), after the profile's.",
    )
    emergency_checkpoint: EmergencyCheckpointSpec | None = Field(
        default=None,
        description="GKE: frequent local checkpoints on each node's checkpoint ramdisk beside the persistent ones "
        "(MaxText's emergency or multi-tier checkpointing, by the stage's shape); None: persistent checkpoints only.",
    )
    goodput_recording: bool = Field(
        default=False,
        description="GKE: MaxText's enable_goodput_recording (Google's ml-goodput-measurement): the leader writes "
        "its goodput events to Cloud Logging as job <run_name>-<stage>; the trainer's Google service account needs "
        "roles/logging.logWriter (docs/gke-setup.md). The train report measures goodput either way.",
    )

    @field_validator("name")
    @classmethod
    def _dns(cls, value: str) -> str:
        if not names.DNS1035_LABEL.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a DNS-1035 label: use lower-case letters, digits and '-', starting with a letter"
            )
        return value

    @field_validator("export_hub_repo")
    @classmethod
    def _hub_repo(cls, value: str | None) -> str | None:
        if value is not None and not HUB_REPO.fullmatch(value):
            raise ValueError(
                f"{value[:100]!r} is not a Hugging Face Hub repository id; give OWNER/NAME (letters, digits, '-', "
                "'_', '.'; at most 96 characters per part, not starting or ending with '-' or '.')"
            )
        return value

    @field_validator("ici")
    @classmethod
    def _ici(cls, value: dict[str, int]) -> dict[str, int]:
        return _check_parallelism(value, "ici")

    @field_validator("dcn")
    @classmethod
    def _dcn(cls, value: dict[str, int]) -> dict[str, int]:
        return _check_parallelism(value, "dcn")

    @field_validator("remat_policy")
    @classmethod
    def _remat(cls, value: str) -> str:
        if value not in maxtext.REMAT_POLICIES:
            raise ValueError(f"unknown remat_policy {value!r}; MaxText's are {', '.join(maxtext.REMAT_POLICIES)}")
        return value

    @field_validator("maxtext_overrides")
    @classmethod
    def _overrides(cls, value: dict[str, Any]) -> dict[str, Any]:
        managed = sorted(set(value) & maxtext.MANAGED_KEYS)
        if managed:
            raise ValueError(
                f"{', '.join(managed)} are set from the stage's own fields; set them there, not in maxtext_overrides"
            )
        secret = next(
            (key for key, item in value.items() if key in maxtext.SECRET_KEYS or _looks_like_token(item)), None
        )
        if secret is not None:
            raise ValueError(
                f"maxtext_overrides.{secret}: a credential in maxtext_overrides would be written into the JobSet's "
                "arguments and the compiled pipeline in plain text; remove it and name a Kubernetes Secret "
                "(data.hf_token_kubernetes_secret, key 'token') or a Secret Manager secret version "
                "(data.hf_token_secret): the trainer pods get it as $HF_TOKEN"
            )
        # A profile that came through a KFP pipeline has every number a float: MaxText's integer keys get ints back.
        value = {key: maxtext.restore_integers(key, item) for key, item in value.items()}
        for key, item in value.items():
            texts = [v for v in (item if isinstance(item, list) else [item]) if isinstance(v, str)]
            problem = maxtext.override_problem(key, item) or next(
                filter(None, map(values.control_problem, texts)), None
            )
            if problem:
                raise ValueError(f"maxtext_overrides.{key}: {problem}")
        return value

    @model_validator(mode="after")
    def _data(self) -> Stage:
        if self.data.kind == "hf" and self.tokenizer.for_hf_pipeline().type != "huggingface":
            raise ValueError(
                f"tokenizer: MaxText's hf pipeline loads its tokenizer with transformers.AutoTokenizer only "
                f"(maxtext/input_pipeline/hf_data_processing.py), which cannot read the {self.tokenizer.type} file "
                f"{self.tokenizer.path}; give tokenizer.type: huggingface with a directory holding tokenizer.json, "
                "or the default tokenizer (its Hugging Face form is in the package), or use data kind grain"
            )
        grain_hub = [
            name for name in ("train_files", "eval_files") if HF_GLOB_PREFIX in (getattr(self.data, name, "") or "")
        ]
        if grain_hub and getattr(self.data, "file_type", None) != "parquet":
            raise ValueError(
                f"data.{grain_hub[0]}: MaxText reads hf:// files as Parquet only (input_pipeline_utils.py "
                f"make_parquet_iter_dataset; ArrayRecord and TFRecord readers open local or gs:// paths); set "
                "data.file_type: parquet, or copy the files to gs://"
            )
        if self.data.kind != "synthetic":
            vocab = self.model.vocab_size or maxtext.MODEL_DIMS.get(self.model.name or "", {}).get("vocab_size")
            problem = tokenizer_vocab_issue(vocab, self.tokenizer)
            if problem:
                raise ValueError(f"model.vocab_size: {problem}")
        if self.eval_interval > 0 and (self.data.kind == "synthetic" or not self.has_eval_split()):
            raise ValueError(
                f"eval_interval is {self.eval_interval} but the stage's data has no eval split; give one "
                "(data.eval_files, data.eval_split, or data kind text, which holds one out) or set eval_interval: -1"
            )
        return self

    @property
    def uses_emergency_checkpoint(self) -> bool:
        """Whether the stage checkpoints in two tiers (``emergency_checkpoint`` given and enabled)."""
        return self.emergency_checkpoint is not None and self.emergency_checkpoint.enabled

    def has_eval_split(self) -> bool:
        """Whether the stage's data names (or, for ``text``, holds out) an eval split."""
        return self.data.kind == "text" or bool(
            getattr(self.data, "eval_files", None) or getattr(self.data, "eval_split", None)
        )

    def full_ici(self) -> dict[str, int]:
        """ICI degrees with MaxText's defaults filled in for axes not given."""
        return {**maxtext.ICI_DEFAULTS, **self.ici}

    def full_dcn(self) -> dict[str, int]:
        """DCN degrees with MaxText's defaults filled in for axes not given."""
        return {**maxtext.DCN_DEFAULTS, **self.dcn}


#: The in-place restart agent's image when the profile names none: a placeholder like the trainer's. JobSet v0.12.0
#: publishes no agent image (kubernetes-sigs/jobset ``Makefile``: ``IN_PLACE_RESTART_AGENT_IMAGE_REGISTRY`` is empty
#: until in-place restart's beta); it is built from that tag's ``cmd/in-place-restart-agent/Dockerfile``.
IN_PLACE_RESTART_AGENT_IMAGE = "jobset-in-place-restart-agent:v0.12.0"


class Images(_Strict):
    """Container images: the trainer (MaxText), the pipeline components, and JobSet's in-place restart agent (the
    sidecar of a TPU JobSet with ``restartStrategy: InPlaceRestart``, :mod:`multislice.render.in_place`)."""

    trainer: str = Field(min_length=1)
    pipeline: str = Field(min_length=1)
    in_place_restart_agent: str = Field(
        default=IN_PLACE_RESTART_AGENT_IMAGE,
        min_length=1,
        description="JobSet v0.12.0's in-place restart agent (built from kubernetes-sigs/jobset at tag v0.12.0, "
        "cmd/in-place-restart-agent/Dockerfile: upstream publishes none); used with restart_strategy auto or "
        "in_place on GKE.",
    )

    @field_validator("trainer", "pipeline", "in_place_restart_agent")
    @classmethod
    def _reference(cls, value: str) -> str:
        return _value_check(values.image_problem(value), value)


class ClusterSpec(_Strict):
    """The GKE cluster the ``gke`` backend acts on, and how the steps reach its Kubernetes API.

    ``project``, ``location`` and ``name`` identify the cluster for the GKE API
    (google-cloud-container: node pools, endpoint and CA). ``access`` says how
    the pipeline's components reach the Kubernetes API:

    - ``in-cluster``: the pod's ServiceAccount (KFP installed on the same GKE cluster);
    - ``kubeconfig``: a kubeconfig file's context (``kubeconfig_context``, default the current one);
    - ``gke``: the control-plane endpoint from the GKE API plus a google-auth token (Vertex AI
      Pipelines, whose components run outside the cluster): the DNS-based endpoint when it allows
      external traffic, else the public IP endpoint with the cluster's CA; a cluster with only a
      private IP endpoint is refused with the fix (:func:`multislice.backends.gke.access.control_plane`).
    """

    project: str | None = Field(default=None, description="Google Cloud project of the GKE cluster.")
    location: str | None = Field(default=None, description="Region or zone of the GKE cluster, e.g. us-east5.")
    name: str | None = Field(default=None, description="GKE cluster name.")
    access: Literal["in-cluster", "kubeconfig", "gke"] = "gke"
    kubeconfig_context: str | None = Field(default=None, description="kubeconfig context (access: kubeconfig).")

    @field_validator("project")
    @classmethod
    def _project(cls, value: str | None) -> str | None:
        return value if value is None else _value_check(values.gcp_project_problem(value), value)

    @field_validator("location")
    @classmethod
    def _location(cls, value: str | None) -> str | None:
        return value if value is None else _value_check(values.gcp_location_problem(value), value)

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        return value if value is None else _value_check(values.gke_cluster_problem(value), value)

    @field_validator("kubeconfig_context")
    @classmethod
    def _context(cls, value: str | None) -> str | None:
        # A context name is a kubeconfig key (client-go clientcmd: any string), but one starting with '-' reads as
        # an option wherever it is passed on (``kubectl --context``, ``kubectl config use-context --help``).
        if value is None:
            return value
        if not value.strip():
            raise ValueError(f"{value!r} is empty; give a kubeconfig context, or leave it unset for the current one")
        return _value_check(values.control_problem(value) or values.option_like_problem(value), value)


#: GKE limits node pool names to 40 characters: lower-case letters, digits and '-', starting with a letter
#: (https://cloud.google.com/kubernetes-engine/docs/reference/rest/v1/projects.locations.clusters.nodePools).
NODE_POOL_NAME_MAX_LENGTH = 40
_NODE_POOL_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: A Compute Engine reservation: ``NAME``, or a shared one, ``projects/PROJECT/reservations/NAME``,
#: optionally narrowed to ``/reservationBlocks/BLOCK`` (xpk ``core/capacity.py`` ``parse_reservation``).
_RESERVATION = re.compile(
    r"^(projects/[a-z][-a-z0-9]{4,28}[a-z0-9]/reservations/)?[a-z]([-a-z0-9]*[a-z0-9])?"
    r"(/reservationBlocks/[a-z0-9]([-a-z0-9]*[a-z0-9])?)?$"
)
_RESOURCE_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


class AdditionalNodeNetwork(_Strict):
    """One extra VPC network attached to every node of the TPU node pools (GKE multi-network).

    For DCN traffic between slices on its own NIC, as in the Ray multislice
    guide and https://cloud.google.com/kubernetes-engine/docs/how-to/setup-multinetwork-support-for-pods
    (``gcloud container node-pools create --additional-node-network network=NET,subnetwork=SUBNET``).
    The cluster needs multi-networking (and GKE Dataplane V2) enabled.
    """

    network: str = Field(min_length=1, description="VPC network name.")
    subnetwork: str = Field(min_length=1, description="Subnetwork name in the node pools' region.")

    @field_validator("network", "subnetwork")
    @classmethod
    def _name(cls, value: str) -> str:
        if not _RESOURCE_NAME.fullmatch(value.rsplit("/", 1)[-1]):
            raise ValueError(f"{value!r} is not a Compute Engine resource name (lower-case letters, digits, '-')")
        return value


#: How long flex-start capacity may take, seconds: GKE's flex-start page gives seven days as the bound of
#: flex-start (https://cloud.google.com/kubernetes-engine/docs/concepts/dws: "dynamically provision GPUs and TPUs
#: as needed, for up to seven days"; ``maxRunDurationSeconds`` "default is seven days"). The queued-provisioning
#: page (https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest) names no shorter queue bound.
FLEX_START_MAX_WAIT_SECONDS = 7 * 24 * 3600


class NodePoolSpec(_Strict):
    """How provision gets the run's TPU node pools (one per slice) on GKE.

    One node pool per slice, named ``<name_prefix>-<slice index>``, each with
    ``hosts`` nodes of the slice's machine type and a COMPACT placement policy
    with the slice's TPU topology (see :mod:`multislice.backends.gke.nodepool`).

    ``manage: false`` leaves node pools to the platform team: provision then
    only checks that matching pools exist. ``provisioning`` picks the capacity:
    ``standard`` (on-demand), ``spot`` (Spot VMs), ``flex-start`` (Dynamic
    Workload Scheduler: the pools scale from 0 nodes when a slice is needed;
    add ``queued_provisioning: true`` to obtain nodes only through Kueue
    ProvisioningRequests) or ``reservation`` (a specific Compute Engine
    reservation named by ``reservation``). Sources: xpk
    ``src/xpk/core/capacity.py`` (``get_capacity_arguments_from_capacity_type``)
    and https://cloud.google.com/kubernetes-engine/docs/how-to/tpus.
    """

    manage: bool = Field(default=True, description="Create missing TPU node pools (true) or only check them (false).")
    provisioning: Literal["standard", "spot", "flex-start", "reservation"] = "standard"
    reservation: str | None = Field(default=None, description="Reservation name (provisioning: reservation).")
    name_prefix: str | None = Field(
        default=None, description="Node pools are named <name_prefix>-<slice>; default tpu-<generation>-<topology>."
    )
    zone: str | None = Field(
        default=None,
        description="Zone of the TPU node pools (node locations); needed when cluster.location is a region.",
    )
    queued_provisioning: bool = Field(
        default=False, description="flex-start only: nodes come only through Kueue ProvisioningRequests."
    )
    max_wait_for_capacity_seconds: Annotated[float | None, AfterValidator(_wait_seconds)] = Field(
        default=None,
        le=MAX_TIMEOUT_SECONDS,
        description="flex-start only: how long admit and launch wait for Dynamic Workload Scheduler to find the "
        "capacity (pods Unschedulable, a ProvisioningRequest pending), seconds; default 7 days "
        f"({FLEX_START_MAX_WAIT_SECONDS} s), flex-start's bound in GKE's docs.",
    )
    additional_node_networks: tuple[AdditionalNodeNetwork, ...] = Field(
        default=(), description="Extra VPC networks on every TPU node, e.g. for DCN traffic."
    )
    operation_timeout_seconds: Annotated[float, AfterValidator(_wait_seconds)] = Field(
        default=3600,
        le=MAX_TIMEOUT_SECONDS,
        description="How long provision waits for one node pool operation, seconds.",
    )
    oauth_scopes: tuple[str, ...] = Field(
        default=(CLOUD_PLATFORM_SCOPE,),
        description="OAuth scopes of the TPU nodes. hostNetwork TPU pods reach Google APIs (gs:// checkpoints, "
        "the JAX cache) as the node's service account with these scopes; without them GKE gives only "
        "logging and monitoring (xpk passes storage-full, gke-default and cloud-platform).",
    )
    service_account: str | None = Field(
        default=None,
        description="Google service account of the TPU nodes (email); default the project's Compute Engine "
        "default service account. TPU pods write gs:// as it (`multislice render` prints its IAM bindings).",
    )

    @field_validator("name_prefix")
    @classmethod
    def _prefix(cls, value: str | None) -> str | None:
        # Room for "-<slice index>" with up to 3 digits.
        if value is not None and (not _NODE_POOL_NAME.fullmatch(value) or len(value) > NODE_POOL_NAME_MAX_LENGTH - 4):
            raise ValueError(
                f"{value!r} cannot prefix a GKE node pool name: use lower-case letters, digits and '-', "
                f"starting with a letter, at most {NODE_POOL_NAME_MAX_LENGTH - 4} characters"
            )
        return value

    @field_validator("oauth_scopes")
    @classmethod
    def _scopes(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        bad = [scope for scope in value if not scope.startswith(GOOGLE_SCOPE_PREFIX)]
        if bad:
            raise ValueError(f"{bad[0]!r} is not an OAuth scope; use URLs like {CLOUD_PLATFORM_SCOPE}")
        if not set(value) & STORAGE_WRITE_SCOPES:
            raise ValueError(
                f"the scopes {list(value)} do not let the TPU nodes write Cloud Storage, where hostNetwork TPU pods "
                f"write checkpoints as the node's service account: include {CLOUD_PLATFORM_SCOPE}"
            )
        return value

    @field_validator("service_account")
    @classmethod
    def _node_account(cls, value: str | None) -> str | None:
        if value is not None and not _GCP_SERVICE_ACCOUNT.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Google service account email; use NAME@PROJECT.iam.gserviceaccount.com"
            )
        return value

    @field_validator("zone")
    @classmethod
    def _zone(cls, value: str | None) -> str | None:
        if value is not None and not ZONE.fullmatch(value):
            raise ValueError(f"{value!r} is not a Compute Engine zone; use one like us-east5-b")
        return value

    @model_validator(mode="after")
    def _capacity(self) -> NodePoolSpec:
        if self.provisioning == "reservation" and not self.reservation:
            raise ValueError(
                "provisioning: reservation needs reservation: set node_pools.reservation to the reservation's "
                "name (or projects/PROJECT/reservations/NAME for a shared one)"
            )
        if self.reservation and self.provisioning != "reservation":
            raise ValueError(
                f"reservation {self.reservation!r} is set but provisioning is {self.provisioning!r}; set "
                "node_pools.provisioning: reservation, or remove node_pools.reservation"
            )
        if self.reservation and not _RESERVATION.fullmatch(self.reservation):
            raise ValueError(
                f"reservation {self.reservation!r} is not a reservation name; use NAME, "
                "projects/PROJECT/reservations/NAME or .../reservationBlocks/BLOCK"
            )
        if self.queued_provisioning and self.provisioning != "flex-start":
            raise ValueError(
                f"queued_provisioning needs provisioning: flex-start (it is {self.provisioning!r}); "
                "set node_pools.provisioning: flex-start, or remove queued_provisioning"
            )
        if self.max_wait_for_capacity_seconds is not None and self.provisioning != "flex-start":
            raise ValueError(
                f"max_wait_for_capacity_seconds applies to provisioning: flex-start (it is {self.provisioning!r}); "
                "set node_pools.provisioning: flex-start, or remove max_wait_for_capacity_seconds"
            )
        return self

    @property
    def capacity_wait_seconds(self) -> float | None:
        """How long admit and launch wait for flex-start capacity, seconds; None when not flex-start.

        ``max_wait_for_capacity_seconds``, default :data:`FLEX_START_MAX_WAIT_SECONDS`.
        """
        if self.provisioning != "flex-start":
            return None
        return self.max_wait_for_capacity_seconds or FLEX_START_MAX_WAIT_SECONDS

    def issues(self, cluster: ClusterSpec) -> list[tuple[str, str]]:
        """Checks against the cluster reference (backend gke); ``(field, message)`` pairs, empty when fine."""
        issues = [
            (f"cluster.{key}", f"the gke backend needs the GKE cluster's {what}; set cluster.{key}")
            for key, what in (("project", "project ID"), ("location", "region or zone"), ("name", "name"))
            if not getattr(cluster, key)
        ]
        if cluster.location and not self.zone and not ZONE.fullmatch(cluster.location):
            issues.append(
                (
                    "node_pools.zone",
                    f"cluster.location {cluster.location!r} is a region, but a TPU slice lives in one zone; "
                    f"set node_pools.zone to a zone of {cluster.location} that offers the TPU type, "
                    f"e.g. {cluster.location}-b",
                )
            )
        region = cluster.location.rsplit("-", 1)[0] if cluster.location and ZONE.fullmatch(cluster.location) else None
        region = region or cluster.location
        if region and self.zone and not self.zone.startswith(region + "-"):
            issues.append(
                (
                    "node_pools.zone",
                    f"zone {self.zone!r} is not in the cluster's region {region!r}; use a zone of {region}",
                )
            )
        return issues


#: A Google service account's email (``NAME@PROJECT.iam.gserviceaccount.com``, or Compute Engine's default
#: ``NUMBER-compute@developer.gserviceaccount.com``).
_GCP_SERVICE_ACCOUNT = re.compile(r"^[a-z0-9][-a-z0-9]{4,61}@[a-z0-9][-a-z0-9.]*\.gserviceaccount\.com$")


class ServiceAccountsSpec(_Strict):
    """Who the pipeline's pods run as on the cluster (see :mod:`multislice.render.rbac`).

    ``pipeline`` is the Kubernetes ServiceAccount of the pipeline components
    (KFP pods), bound by a namespaced Role to what the steps do in
    ``namespace`` (JobSets, Jobs, pods, logs, events, Kueue Workloads) and by a
    ClusterRole to reading CRDs and nodes. ``trainer`` is the ServiceAccount of
    the training and verifier pods: no Kubernetes API rights at all, and with
    ``trainer_gcp_service_account`` set, the Workload Identity annotation
    ``iam.gke.io/gcp-service-account`` that lets them write checkpoints to
    Cloud Storage as that Google service account
    (https://cloud.google.com/kubernetes-engine/docs/how-to/workload-identity).
    On KFP the run's whole Argo Workflow runs as ``pipeline`` in
    ``pipeline_namespace``, so a second Role there grants what KFP's driver and
    launcher and Argo's executor ask of the API (the ``kfp-launcher``
    ConfigMap, ``kfp_artifact_secrets``, ``workflowtaskresults``): see
    :func:`multislice.render.rbac.kfp_runner_rules`.
    """

    pipeline: str = Field(
        default="multislice-pipeline", description="Kubernetes ServiceAccount of the pipeline components."
    )
    pipeline_namespace: str | None = Field(
        default=None, description="Namespace the component pods run in (KFP: e.g. kubeflow); default: namespace."
    )
    pipeline_gcp_service_account: str | None = Field(
        default=None,
        description="Google service account the components call the GKE API as: Workload Identity of the "
        "pipeline ServiceAccount, and on Vertex AI Pipelines bound to the same Role as a User.",
    )
    trainer: str = Field(default="multislice-trainer", description="Kubernetes ServiceAccount of the training pods.")
    trainer_gcp_service_account: str | None = Field(
        default=None,
        description="Google service account of the training pods (Workload Identity), e.g. for gs:// output.",
    )
    kfp_artifact_secrets: list[str] = Field(
        default_factory=lambda: ["mlpipeline-minio-artifact"],
        description="Secrets in pipeline_namespace the KFP launcher reads the pipeline root's credentials from "
        "(KFP's default store: mlpipeline-minio-artifact); [] for a gs:// root read with the pod's identity.",
    )
    kueue_cluster_objects: bool = Field(
        default=False,
        description="Also let the pipeline server-side apply the run's cluster-scoped Kueue objects "
        "(by name); otherwise an admin applies them once.",
    )
    tpu_host_network: bool = Field(
        default=True,
        description="TPU pods use hostNetwork (GKE's and xpk's multislice setup: DCN traffic between slices "
        "on the node's network). hostNetwork pods get no Workload Identity: they write gs:// as the node's "
        "service account (node_pools.service_account, oauth_scopes).",
    )
    tpu_workload_identity: bool = Field(
        default=False,
        description="TPU pods write gs:// as trainer_gcp_service_account through Workload Identity; needs "
        "tpu_host_network: false (DCN traffic then goes through the pod network).",
    )

    @field_validator("pipeline", "trainer")
    @classmethod
    def _account(cls, value: str) -> str:
        if not names.DNS1123_SUBDOMAIN.fullmatch(value) or len(value) > 253:
            raise ValueError(f"{value!r} is not a ServiceAccount name (lower-case DNS-1123 subdomain)")
        return value

    @field_validator("kfp_artifact_secrets")
    @classmethod
    def _secrets(cls, value: list[str]) -> list[str]:
        for name in value:
            if not names.DNS1123_SUBDOMAIN.fullmatch(name) or len(name) > 253:
                raise ValueError(f"{name!r} is not a Secret name (lower-case DNS-1123 subdomain)")
        return value

    @field_validator("pipeline_namespace")
    @classmethod
    def _namespace(cls, value: str | None) -> str | None:
        if value is not None and (not names.DNS1123_LABEL.fullmatch(value) or len(value) > names.MAX_LABEL_LENGTH):
            raise ValueError(f"{value!r} is not a valid namespace name (DNS-1123 label, at most 63 characters)")
        return value

    @model_validator(mode="after")
    def _distinct(self) -> ServiceAccountsSpec:
        if self.pipeline == self.trainer:
            raise ValueError(
                f"pipeline and trainer are both {self.pipeline!r}; the trainer's pods must not hold the pipeline's "
                "API rights: give service_accounts.trainer another name"
            )
        if self.tpu_workload_identity and self.tpu_host_network:
            raise ValueError(
                "tpu_workload_identity with tpu_host_network: GKE gives hostNetwork pods no Workload Identity, so "
                "the TPU pods would write gs:// as the node's service account anyway; set tpu_host_network: false "
                "(DCN traffic between slices then goes through the pod network instead of the node's, slower "
                "collectives over DCN), or drop tpu_workload_identity and grant node_pools.service_account the "
                "bucket (see `multislice render`'s iam-bindings.txt)"
            )
        if self.tpu_workload_identity and not self.trainer_gcp_service_account:
            raise ValueError(
                "tpu_workload_identity needs trainer_gcp_service_account: set the Google service account the TPU "
                "pods act as"
            )
        return self

    @field_validator("pipeline_gcp_service_account", "trainer_gcp_service_account")
    @classmethod
    def _gcp_account(cls, value: str | None) -> str | None:
        if value is not None and not _GCP_SERVICE_ACCOUNT.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a Google service account email; use NAME@PROJECT.iam.gserviceaccount.com"
            )
        return value


class PreflightSpec(_Strict):
    """The preflight step: AOT-compile each stage for the target TPU topology before provision.

    Source of the method: MaxText's ``train_compile`` (``maxtext/trainers/pre_train/train_compile.py``).
    """

    skip: bool = Field(default=False, description="Skip preflight (pipeline parameter skip_preflight).")
    cache_dir: str | None = Field(
        default=None, description="Verdict cache (path or gs://); default <output_dir>/preflight-cache, shared by runs."
    )
    suggest_alternative: bool = Field(
        default=True, description="When a stage does not fit, AOT-verify the planner's nearest fitting alternative."
    )
    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="GKE: the nodeSelector of the AOT compile Jobs' pods (each asks 2 CPU, 8 GiB), e.g. "
        "{'cloud.google.com/gke-nodepool': 'cpu-pool'}; empty: any node that fits.",
    )

    @field_validator("cache_dir")
    @classmethod
    def _cache_dir(cls, value: str | None) -> str | None:
        return value if value is None else _value_check(values.output_dir_problem(value), value)

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        return _selector_check(value, "node_selector")


class CostSpec(_Strict):
    """Inputs of the cost estimate in the preflight report; no price is looked up on the network.

    Step time is estimated as model FLOPs per step per chip (MaxText's accounting)
    / (peak bf16 FLOP/s per chip x ``assumed_mfu``).
    """

    price_per_chip_hour: float = Field(default=0.0, ge=0, description="Price of one chip for one hour.")
    currency: str = "USD"
    price_source: str = Field(default="", description="Where the price comes from (for the report).")
    assumed_mfu: float = Field(default=0.4, gt=0, le=1, description="Model FLOPs utilisation assumed for step time.")


#: A step's wait in seconds, unset (the backend's default) or in [:data:`MIN_TIMEOUT_SECONDS`,
#: :data:`MAX_TIMEOUT_SECONDS`].
Timeout = Annotated[float | None, Field(le=MAX_TIMEOUT_SECONDS), AfterValidator(_wait_seconds)]


class TimeoutsSpec(_Strict):
    """How long the steps wait, seconds; unset fields keep the backend's defaults (:mod:`multislice.timings`).

    Each is at least :data:`MIN_TIMEOUT_SECONDS` (1 s) and at most :data:`MAX_TIMEOUT_SECONDS` (365 days): the
    values become pod deadlines (``activeDeadlineSeconds``) and the CPU pods' ``jax.distributed`` timeouts, which
    take whole seconds as an int32, where less than a second is no wait at all, and a larger value is a typo, not
    a wait.

    The compiled pipeline's pod deadlines are derived from the same values, so
    raising one here raises the step's deadline with it.
    """

    provision: Timeout = Field(default=None, description="All of provision's waits (node pool operations).")
    admit: Timeout = Field(default=None, description="Waiting for Kueue to admit a stage's Workload.")
    launch: Timeout = Field(default=None, description="Waiting for every pod of a stage to run.")
    unschedulable_grace: Timeout = Field(default=None, description="A pod Unschedulable this long fails launch.")
    scale_up_grace: Timeout = Field(
        default=None,
        description="How long a CPU Job's pod (a compile, the shard workers, the export) may wait Unschedulable "
        "while the cluster autoscaler adds a node for it (TriggeredScaleUp); default 900.",
    )
    train: Timeout = Field(default=None, description="Following a stage's training to its end.")
    readmit: Timeout = Field(default=None, description="Waiting for an evicted Workload to be admitted again.")
    verify: Timeout = Field(default=None, description="The checkpoint verifier.")
    compile: Timeout = Field(default=None, description="One AOT compile in preflight.")
    prepare_data: Timeout = Field(default=None, description="Tokenizing a stage's text (prepare_data).")
    alternative_search: Timeout = Field(default=None, description="Preflight's search for a fitting alternative.")
    collectives: Timeout = Field(
        default=None, description="CPU pods' jax.distributed timeouts: all processes joining, missed heartbeats."
    )

    @model_validator(mode="after")
    def _within(self) -> TimeoutsSpec:
        for inner, outer in (("unschedulable_grace", "launch"), ("readmit", "train")):
            small, big = getattr(self, inner), getattr(self, outer)
            if small is not None and big is not None and small > big:
                raise ValueError(
                    f"{inner} ({small:g} s) is waited for within {outer} ({big:g} s), so it can never be reached; "
                    f"make {inner} at most {outer}"
                )
        return self


#: How a stage's training is launched: a multislice JobSet (one pod per host), or Ray Train's ``JaxTrainer``
#: on a Ray cluster (KubeRay on GKE, a local Ray instance on the local backend). See docs/architecture.md.
Launcher = Literal["jobset", "ray"]


class RaySpec(_Strict):
    """Options of the Ray launcher (``launcher: ray``).

    ``min_slices`` makes the ``JaxTrainer`` elastic: Ray Train starts with as many
    whole slices as are available, at least ``min_slices`` and at most ``num_slices``
    (``ScalingConfig(num_workers=(min, max))``, one Ray worker per host). Unset: a fixed
    worker count (every slice).
    """

    min_slices: int | None = Field(
        default=None, gt=0, le=INT32_MAX, description="Elastic: fewest slices the JaxTrainer may run on (unset: fixed)."
    )
    head_node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="GKE: the nodeSelector of the RayJob's head pod (4 CPU, 16 GiB; the driver runs there), a CPU "
        "node pool, e.g. {'cloud.google.com/gke-nodepool': 'cpu-pool'}; required on GKE for a stage with "
        "launcher ray.",
    )

    @field_validator("head_node_selector")
    @classmethod
    def _head_node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        return _selector_check(value, "head_node_selector")


def _secret_version(value: str, looks_secret: bool, kind: str, empty_means: str) -> str:
    """``value`` when it is '' or a Secret Manager secret version (:func:`.values.secret_version_problem`).

    Raises:
        ValueError: anything else; when ``looks_secret`` (the value looks like the secret itself, ``kind``), the
            value is not echoed.
    """
    problem = values.secret_version_problem(value, looks_secret, kind, empty_means)
    if problem:
        raise ValueError(problem)
    return value


class ExporterSpec(_Strict):
    """Where the Hugging Face export of a stage (``stages[].export``) runs on GKE, and its Hub credential.

    The export is a one-pod Job of the trainer image on a CPU node pool (``node_selector``), not on the stage's TPU
    slice: see docs/delivery.md, "The export on GKE". The Hub token (``stages[].export_hub_repo``) comes from a
    Secret Manager secret version (``hub_token_secret``, read by the exporter's pod with the trainer's Google
    service account: Vertex AI, or any GKE cluster) or from a Kubernetes Secret in the run's namespace
    (``hub_token_kubernetes_secret``, key ``token``: KFP), never from a pipeline parameter or the compiled YAML.
    """

    node_selector: dict[str, str] = Field(
        default_factory=dict,
        description="GKE: the nodeSelector of the export Job's pod, e.g. {'cloud.google.com/gke-nodepool': "
        "'export-highmem'}: a CPU node pool with the memory and disk the rendered Job asks for; empty: any node.",
    )
    cpu: int = Field(default=8, gt=0, le=1024, description="GKE: CPUs the export Job's pod asks for.")
    hub_token_secret: str = Field(
        default="",
        description="Secret Manager secret version with the Hugging Face token (projects/<p>/secrets/<s>/versions/"
        "<v>), read at run time by the exporter's pod (the trainer's Google service account needs "
        "roles/secretmanager.secretAccessor on it); '' for none. Never the token itself.",
    )
    hub_token_kubernetes_secret: str = Field(
        default="",
        description="GKE (KFP): a Kubernetes Secret in the run's namespace whose key 'token' holds the Hugging Face "
        "token; the export Job's pod gets it as $HF_TOKEN by reference. '' for none.",
    )

    @field_validator("hub_token_secret")
    @classmethod
    def _hub_token_secret(cls, value: str) -> str:
        return _secret_version(value, value.startswith("hf_"), "a token", "none")

    @field_validator("hub_token_kubernetes_secret")
    @classmethod
    def _hub_token_kubernetes_secret(cls, value: str) -> str:
        problem = values.kubernetes_secret_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        return _selector_check(value, "node_selector")


#: A Secret Manager secret version name.


class RunSpec(_Strict):
    """A whole run: where it runs, on which slices, and its ordered stages.

    ``tpu_type`` names one slice (``v6e-16``, see :mod:`multislice.tpu`);
    ``num_slices`` of them are joined over DCN. On the ``local`` backend the
    same slices are emulated by processes on this machine, one per host.
    """

    run_name: str = Field(description="DNS-1035 label; prefix of every JobSet name.")
    backend: Literal["local", "gke"]
    namespace: str = "default"
    queue: str = Field(default="multislice-queue", description="Kueue LocalQueue the JobSets are submitted to.")
    cluster_queue: str = Field(
        default="multislice-cluster-queue", description="Kueue ClusterQueue behind the LocalQueue."
    )
    priority: str = Field(default="default-priority", description="Kueue WorkloadPriorityClass name.")
    priority_value: int = Field(
        default=100, ge=INT32_MIN, le=INT32_MAX, description="Value of that WorkloadPriorityClass (an int32)."
    )
    tpu_type: str
    machine_type: str | None = Field(
        default=None,
        description="GKE machine type of each host when the topology is offered on more than one: v6e-8 (2x4) on "
        "one ct6e-standard-8t VM (8 chips, 1 host) instead of two ct6e-standard-4t (the default); null: the "
        "default (multislice.tpu, from https://cloud.google.com/tpu/docs/v6e).",
    )
    num_slices: int = Field(gt=0, le=INT32_MAX, description="Slices joined over DCN (JobSet replicas, an int32).")
    max_restarts: int = Field(default=2, ge=0, le=INT32_MAX, description="JobSet failurePolicy.maxRestarts (an int32).")
    jobset_ttl_seconds: int | None = Field(
        default=43200,
        ge=0,
        le=INT32_MAX,
        description="GKE: the TPU JobSet's spec.ttlSecondsAfterFinished (JobSet v0.12): a finished JobSet and its "
        "pods are deleted this long after it finishes (xpk: 43,200 s); null keeps them until cleanup.",
    )
    max_restarts: int = Field(
        default=2,
        ge=0,
        le=INT32_MAX,
        description="JobSet failurePolicy.maxRestarts (an int32); with launcher ray, FailureConfig.max_failures.",
    )
    restart_strategy: Literal["auto", "in_place", "recreate"] = Field(
        default="auto",
        description="How a TPU JobSet restarts after a host failure (failurePolicy.restartStrategy): in_place "
        "(InPlaceRestart: pods stay on their nodes, containers restart; JobSet v0.12.0 with its InPlaceRestart "
        "feature gate and Kubernetes 1.35's ContainerRestartRules and RestartAllContainersOnContainerExits gates), "
        "recreate (Recreate: every pod recreated), or auto: in place where provision finds the cluster accepts it, "
        "else Recreate, saying why (docs/gke-setup.md).",
    )
    launcher: Launcher = Field(
        default="jobset", description="How stages are launched: jobset or ray (per stage: launcher)."
    )
    ray: RaySpec = Field(default_factory=RaySpec)
    output_dir: str = Field(min_length=1, description="Base directory (local path or gs://) for all run outputs.")
    images: Images
    cluster: ClusterSpec = Field(default_factory=ClusterSpec)
    node_pools: NodePoolSpec = Field(default_factory=NodePoolSpec)
    service_accounts: ServiceAccountsSpec = Field(default_factory=ServiceAccountsSpec)
    preflight: PreflightSpec = Field(default_factory=PreflightSpec)
    cost: CostSpec = Field(default_factory=CostSpec)
    timeouts: TimeoutsSpec = Field(default_factory=TimeoutsSpec)
    libtpu_flags: LibtpuFlagsSpec = Field(
        default_factory=LibtpuFlagsSpec,
        description="Changes to every stage's libtpu/XLA flags (LIBTPU_INIT_ARGS; multislice.libtpu_flags).",
    )
    stages: tuple[Stage, ...] = Field(min_length=1)
    example_stages: tuple[Stage, ...] = Field(
        default=(),
        description="Stages not trained by the pipeline, kept to check by name (multislice preflight --stage).",
    )
    unique_run_name: bool = Field(
        default=False,
        description="Append the pipeline run's id to run_name (as scheduled runs do), so runs never share a directory.",
    )
    exporter: ExporterSpec = Field(
        default_factory=ExporterSpec,
        description="Where a stage's Hugging Face export runs on GKE (a CPU node pool) and its Hub credential.",
    )
    notify_webhook_secret: str = Field(
        default="",
        description="Secret Manager secret version holding the webhook URL the exit handler posts the final status "
        "to on Vertex AI (projects/<p>/secrets/<s>/versions/<v>); '' for none. Never the URL itself: on KFP the "
        "URL comes from the Kubernetes Secret multislice-notify-webhook (key url), locally from "
        "$MULTISLICE_NOTIFY_WEBHOOK_URL.",
    )

    @field_validator("notify_webhook_secret")
    @classmethod
    def _webhook_secret(cls, value: str) -> str:
        return _secret_version(value, "://" in value, "a URL", "no notification")

    @field_validator("output_dir")
    @classmethod
    def _output_dir(cls, value: str) -> str:
        return _value_check(values.output_dir_problem(value), value)

    @field_validator("run_name")
    @classmethod
    def _run_name(cls, value: str) -> str:
        if not names.DNS1035_LABEL.fullmatch(value):
            raise ValueError(
                f"{value!r} is not a DNS-1035 label: use lower-case letters, digits and '-', "
                "starting with a letter and ending with a letter or digit"
            )
        return value

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, value: str) -> str:
        if not names.DNS1123_LABEL.fullmatch(value) or len(value) > names.MAX_LABEL_LENGTH:
            raise ValueError(f"{value!r} is not a valid namespace name (DNS-1123 label, at most 63 characters)")
        return value

    @field_validator("queue", "cluster_queue", "priority")
    @classmethod
    def _object_name(cls, value: str) -> str:
        if not names.DNS1123_SUBDOMAIN.fullmatch(value) or len(value) > names.MAX_LABEL_LENGTH:
            raise ValueError(
                f"{value!r} is not a valid Kueue object name (lower-case DNS-1123, at most 63 "
                "characters, since it is also a label value)"
            )
        return value

    @field_validator("tpu_type")
    @classmethod
    def _tpu_type(cls, value: str) -> str:
        return tpu.parse_tpu_type(value).name

    @field_validator("machine_type")
    @classmethod
    def _machine_type(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and "tpu_type" in info.data:  # a bad tpu_type is reported by its own check
            tpu.parse_tpu_type(info.data["tpu_type"], value)  # UnknownTpuType (a ValueError): the reason and choices
        return value

    @property
    def slice_type(self) -> tpu.SliceType:
        """The parsed slice shape of ``tpu_type`` on ``machine_type`` (hosts and chips per host follow it)."""
        return tpu.parse_tpu_type(self.tpu_type, self.machine_type)

    def stage(self, name: str) -> Stage:
        """The stage (or example stage) called ``name``; KeyError naming the known stages otherwise."""
        for stage in (*self.stages, *self.example_stages):
            if stage.name == name:
                return stage
        known = ", ".join(s.name for s in (*self.stages, *self.example_stages))
        raise KeyError(f"no stage {name!r}; stages are {known}")

    def libtpu_flags_for(self, stage: Stage) -> dict[str, str]:
        """The libtpu/XLA flags of ``stage`` on this run's TPU generation, name -> value, in order.

        :func:`multislice.libtpu_flags.resolve`: MaxText's recipe row for (generation, ``model.name``), or the
        row the stage (else the profile) pins by ``libtpu_flags.recipe``, with ``HOST_OFFLOAD_FLAGS`` when the
        stage offloads to host and the row lacks them; then the profile's ``libtpu_flags`` changes, then the stage's.
        """
        return libtpu_flags.resolve(
            self.slice_type.generation.name,
            stage.model.name,
            [
                (self.libtpu_flags.add, self.libtpu_flags.remove),
                (stage.libtpu_flags.add, stage.libtpu_flags.remove),
            ],
            recipe=self.libtpu_recipe_for(stage),
            host_offload=libtpu_flags.offloads_to_host(stage.remat_policy, stage.maxtext_overrides),
        )

    def libtpu_recipe_for(self, stage: Stage) -> str | None:
        """The :data:`multislice.libtpu_flags.NAMED` row ``stage`` pins (its own, else the profile's), or None."""
        return stage.libtpu_flags.recipe or self.libtpu_flags.recipe

    def launcher_for(self, stage: Stage) -> str:
        """The launcher of ``stage``: its own ``launcher``, else the run's."""
        return stage.launcher or self.launcher

    def with_stages(self, *stages: Stage) -> RunSpec:
        """This spec training ``stages`` instead (e.g. an example stage, or a planner's candidate).

        Not re-validated: pass the result through ``load_spec(spec_to_data(...))`` when the
        stages come from a user rather than from a validated spec or the planner.
        """
        return self.model_copy(update={"stages": tuple(stages), "example_stages": ()})
