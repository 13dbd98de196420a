"""An analytic HBM model of a MaxText dense-decoder train step, per chip, for the planner.

AOT compile (:mod:`multislice.preflight`) is the judge of whether a config
fits; this model only decides which configs are worth compiling, and in what
order. It gives two numbers per chip:

- ``lower_bound_bytes``: what the train step must hold in HBM whatever XLA
  does: the parameters and the AdamW moments that are not offloaded to host
  memory (they are the compiled function's arguments, so they sit in HBM for
  the whole step) and one full set of gradients (MaxText clips gradients by
  their global norm, ``gradient_clipping_threshold: 1.0`` in ``base.yml``, so
  every gradient exists before any update). Each is divided by the number of
  chips that shard it: all chips except those of data parallelism (ICI and DCN
  ``data`` axes), over which MaxText replicates the train state. A config
  whose lower bound exceeds the usable HBM cannot fit, and the planner prunes
  it without compiling. ``tests/test_memory.py`` checks, on AOT results
  recorded on this machine, that no config that fits is ever pruned.
- ``estimate_bytes``: the lower bound plus the activations the remat policy
  saves for the backward pass (one layer input per decoder layer for
  ``full``, more for the policies that save matmul outputs), the logits
  (bf16, plus fp32 for the cross entropy), and one layer's working set
  (its weights gathered in bf16, its MLP intermediates). It ranks and orders
  candidates; on the recorded set it is within about 20% of XLA's number.

Sources: parameter shapes of MaxText's ``llama2`` decoder block
(``maxtext/models/llama2.py``: attention q/k/v/o, SwiGLU MLP ``wi_0``,
``wi_1``, ``wo``, two RMSNorms per layer), remat policies
(``maxtext/layers/decoders.py``, ``get_remat_policy``), host offload flags
(``optimizer_memory_host_offload``, ``parameter_memory_host_offload`` in
``maxtext/configs/base.yml``; parameter offload needs ``param_scan_axis=0``).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from multislice import maxtext

if TYPE_CHECKING:  # annotations only: the config checks use this model (through multislice.exporting)
    from multislice.config import Stage

#: Bytes of one bf16 activation element (MaxText's ``dtype: bfloat16``).
ACTIVATION_BYTES = 2
#: Bytes per logit element: the bf16 logits and the fp32 copy the cross entropy works in.
LOGIT_BYTES = 2 + 4


@dataclass(frozen=True)
class ModelDims:
    """A dense decoder's shape (MaxText's names without ``base_``).

    Attributes:
        emb_dim: Model width E.
        num_query_heads: Query heads.
        num_kv_heads: Key/value heads (grouped-query attention).
        num_decoder_layers: Layers L.
        mlp_dim: MLP hidden width M.
        head_dim: Width of one head D.
        vocab_size: Vocabulary V.
        gated_mlp: Two input projections (SwiGLU ``[silu, linear]``) rather than one.
        tied_embedding: The output head reuses the input embedding (``logits_via_embedding``).
    """

    emb_dim: int
    num_query_heads: int
    num_kv_heads: int
    num_decoder_layers: int
    mlp_dim: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool = True
    tied_embedding: bool = False

    @property
    def layer_parameters(self) -> int:
        """Parameters of one decoder layer: attention, MLP and two norms."""
        e, d = self.emb_dim, self.head_dim
        attention = e * (self.num_query_heads + 2 * self.num_kv_heads) * d + self.num_query_heads * d * e
        mlp = ((2 if self.gated_mlp else 1) + 1) * e * self.mlp_dim
        return attention + mlp + 2 * e

    @property
    def parameters(self) -> int:
        """All parameters: embedding, layers, final norm, output head."""
        head = 0 if self.tied_embedding else self.vocab_size * self.emb_dim
        return self.vocab_size * self.emb_dim + self.num_decoder_layers * self.layer_parameters + self.emb_dim + head


def model_dims(stage: Stage) -> ModelDims | None:
    """The stage's model shape: a Llama model MaxText names, or explicit dims; None when unknown."""
    model = stage.model
    if model.name:
        dims = maxtext.MODEL_DIMS.get(model.name)
        if dims is None:
            return None
        return ModelDims(
            emb_dim=dims["emb_dim"],
            num_query_heads=dims["num_query_heads"],
            num_kv_heads=dims["num_kv_heads"],
            num_decoder_layers=dims["num_decoder_layers"],
            mlp_dim=dims["mlp_dim"],
            head_dim=dims["head_dim"],
            vocab_size=dims["vocab_size"],
        )
    e, q, kv, layers, mlp, vocab = (
        model.emb_dim,
        model.num_query_heads,
        model.num_kv_heads,
        model.num_decoder_layers,
        model.mlp_dim,
        model.vocab_size,
    )
    if e is None or q is None or kv is None or layers is None or mlp is None or vocab is None:
        return None  # ModelSpec refuses a model with neither a name nor these dims
    return ModelDims(
        emb_dim=e,
        num_query_heads=q,
        num_kv_heads=kv,
        num_decoder_layers=layers,
        mlp_dim=mlp,
        head_dim=model.head_dim or maxtext.MODEL_DIMS["llama3-8b"]["head_dim"],
        vocab_size=vocab,
        gated_mlp=len(model.mlp_activations or ("silu", "linear")) == 2,
        tied_embedding=bool(model.logits_via_embedding),
    )


@dataclass(frozen=True)
class Knobs:
    """What the planner varies, read from a stage (fields and ``maxtext_overrides``).

    Attributes:
        per_device_batch_size: Sequences per chip per step.
        remat_policy: MaxText ``remat_policy``.
        ici: Resolved ICI degrees of every axis (product = chips per slice).
        dcn: Resolved DCN degrees of every axis (product = slices).
        optimizer_offload: ``optimizer_memory_host_offload``.
        parameter_offload: ``parameter_memory_host_offload``.
        weight_dtype: ``weight_dtype`` (``float32`` or ``bfloat16``).
    """

    per_device_batch_size: float
    remat_policy: str
    ici: dict[str, int]
    dcn: dict[str, int]
    optimizer_offload: bool = False
    parameter_offload: bool = False
    weight_dtype: str = "float32"

    @classmethod
    def from_stage(cls, stage: Stage, ici: dict[str, int], dcn: dict[str, int]) -> Knobs:
        """Knobs of a stage, given its resolved ICI and DCN degrees (:mod:`multislice.plan`)."""
        overrides = stage.maxtext_overrides

        def flag(key: str) -> bool:
            return str(overrides.get(key, "false")).lower() in ("true", "1")

        return cls(
            per_device_batch_size=stage.per_device_batch_size,
            remat_policy=stage.remat_policy,
            ici=dict(ici),
            dcn=dict(dcn),
            optimizer_offload=flag("optimizer_memory_host_offload"),
            parameter_offload=flag("parameter_memory_host_offload"),
            weight_dtype=str(overrides.get("weight_dtype", "float32")),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """HBM per chip, bytes (see the module docstring for what each number means).

    Attributes:
        lower_bound_bytes: Parameters and moments kept in HBM, plus gradients.
        estimate_bytes: The lower bound plus activations, logits and one layer's working set.
        parts: The terms, bytes per chip: ``parameters``, ``optimizer``,
            ``gradients``, ``saved_activations``, ``logits``, ``layer_working_set``.
    """

    lower_bound_bytes: int
    estimate_bytes: int
    parts: dict[str, int]

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return asdict(self)


def saved_width(dims: ModelDims, remat_policy: str) -> int:
    """Activation elements per token per layer that a remat policy keeps for the backward pass.

    ``full`` keeps the layer input (E); policies that save projections keep
    their outputs too; the ``*_offloaded`` policies keep them in host memory.
    ``custom`` is counted as ``minimal`` (the most it could keep).
    """
    e, m = dims.emb_dim, dims.mlp_dim
    qkv = (dims.num_query_heads + 2 * dims.num_kv_heads) * dims.head_dim
    mlp_in = (2 if dims.gated_mlp else 1) * m
    extra = {
        "full": 0,
        "minimal_offloaded": 0,
        "qkv_proj_offloaded": 0,
        "save_qkv_proj": qkv,
        "save_out_proj": e,
        "save_dot_except_mlp": qkv + e,
        "save_dot_with_context_except_mlp": qkv + 2 * e,
        "save_dot_except_mlpwi": qkv + e + m,
        "minimal": qkv + e + mlp_in + m,
        "custom": qkv + e + mlp_in + m,
    }
    return e + extra.get(remat_policy, extra["minimal"])


def estimate(dims: ModelDims, knobs: Knobs, max_target_length: int) -> MemoryEstimate:
    """HBM per chip of one train step (see the module docstring).

    Args:
        dims: The model's shape.
        knobs: Batch, remat, resolved parallelism, offload and weight dtype.
        max_target_length: Sequence length, tokens.

    Returns:
        The lower bound and the estimate, bytes per chip, with their terms.

    Raises:
        ValueError: an unknown ``weight_dtype``.
    """
    if knobs.weight_dtype not in maxtext.DTYPE_BYTES:
        raise ValueError(f"weight_dtype {knobs.weight_dtype!r}: use one of {', '.join(maxtext.DTYPE_BYTES)}")
    chips = math.prod(knobs.ici.values()) * math.prod(knobs.dcn.values())
    replicas = knobs.ici.get("data", 1) * knobs.dcn.get("data", 1)
    shards = chips // replicas
    weight = maxtext.DTYPE_BYTES[knobs.weight_dtype]
    state = dims.parameters * weight / shards
    parameters = 0 if knobs.parameter_offload else state
    optimizer = 0 if knobs.optimizer_offload else 2 * state
    gradients = state
    tokens = knobs.per_device_batch_size * max_target_length  # per chip: batch and widths shard over the same chips
    tensor = knobs.ici.get("tensor", 1) * knobs.dcn.get("tensor", 1)
    saved = dims.num_decoder_layers * tokens * saved_width(dims, knobs.remat_policy) * ACTIVATION_BYTES
    logits = tokens * dims.vocab_size * LOGIT_BYTES
    mlp_in = (2 if dims.gated_mlp else 1) + 1
    working = 2 * dims.layer_parameters * ACTIVATION_BYTES / tensor + tokens * dims.mlp_dim * mlp_in * ACTIVATION_BYTES
    parts = {
        "parameters": round(parameters),
        "optimizer": round(optimizer),
        "gradients": round(gradients),
        "saved_activations": round(saved),
        "logits": round(logits),
        "layer_working_set": round(working),
    }
    lower = parts["parameters"] + parts["optimizer"] + parts["gradients"]
    return MemoryEstimate(lower_bound_bytes=lower, estimate_bytes=sum(parts.values()), parts=parts)
