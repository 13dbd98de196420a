"""An analytic HBM model of a MaxText dense-decoder train step, per chip, for the planner.

AOT compile (:mod:`multislice.preflight`) is the judge of whether a config
fits; this model only decides which configs are worth compiling, and in what
order. It gives, per chip:

- ``lower_bound_bytes``, a bound: what the train step must hold in HBM whatever XLA
  does: the parameters (also when ``parameter_memory_host_offload`` keeps them
  in host memory between steps: MaxText 0.2.5's ``train_step`` moves them all
  to device before the forward pass, ``maxtext/trainers/pre_train/train.py``),
  the AdamW moments unless offloaded (the compiled function's arguments, in
  HBM for the whole step), and one full set of gradients (MaxText clips
  gradients by their global norm, ``gradient_clipping_threshold: 1.0`` in
  ``base.yml``, so every gradient exists before any update). Each is divided
  by the number of chips that shard it: all chips except those of data
  parallelism (ICI and DCN ``data`` axes), over which MaxText replicates the
  train state. A config whose lower bound exceeds the usable HBM cannot fit,
  and the planner prunes it without compiling. ``tests/test_memory.py`` checks,
  on AOT results recorded on this machine, that it is never above XLA's figure.
- ``estimate_bytes``, not a bound: the lower bound plus the activations the remat
  policy saves in HBM for the backward pass (one layer input per decoder layer
  for ``full``; the named projections for the ``save_*`` policies; for
  ``custom``, the tensors set to ``device``; what ``offload`` moves to host memory
  is ``host_bytes``), and the larger of two phases that are never live at once:
  the loss phase (the logits and their cotangent, bf16 each, with the output
  head gathered in bf16 and its gradient before the reduce-scatter) and one
  layer's working set (its weights gathered in bf16, its MLP intermediates).
  The logits are freed before the first decoder layer's backward pass starts,
  and no layer's gathered weights are live while the head's are.
- ``high_bytes`` and ``low_bytes``: the estimate widened by the most it has
  missed XLA's figure on the recorded compiles (:data:`ESTIMATE_LOW_BY`,
  :data:`ESTIMATE_HIGH_BY`; ``python -m benchmarks.memory_model`` reports each
  compile's error). A fitted band, not a bound: the planner compiles first the
  candidates whose ``high_bytes`` fits, last those whose ``low_bytes`` does not.

The band is what is not modelled. XLA's own temporaries (collective buffers,
layers the scheduler prefetches) leave the estimate up to 18% low on the seed
70B's float32 full-remat configs (its stage's compile holds 21.97 GiB of
temporaries) and 20% low on the Llama 3 8B with 8192-token sequences, whose
compiles hold 1.5-2 bytes per logit more than the 4 counted.

Why 4 bytes per logit and not 6 (bf16 plus the fp32 copy ``cast_logits_to_fp32``
asks for): XLA fuses the cast into the cross entropy's reductions, and the
published runs bound it. MaxText's Llama 3.1 70B recipe on one v6e-256
(per-device batch 5 x 8192, tpu-recipes ``training/trillium/Llama3.1-70B-MaxText/v6e-256``)
ran on chips with 31.24 GiB usable, holding 5.25e9 logits per chip besides
10 GiB of train state and output head; that leaves at most 4.3 bytes per
logit. At 6 bytes, with the two phases summed, the model put it at 43.2 GiB,
and 7 other published runs of 23 over their chips' HBM
(``tests/test_memory_recipes.py``).

Sources: parameter shapes of MaxText's ``llama2`` decoder block
(``maxtext/models/llama2.py``: attention q/k/v/o, SwiGLU MLP ``wi_0``,
``wi_1``, ``wo``, two RMSNorms per layer), remat policies
(``maxtext/layers/nnx_decoders.py``, ``get_remat_policy``; the ``custom``
tensors and their defaults in ``maxtext/configs/base.yml``), host offload
(``optimizer_memory_host_offload``, ``parameter_memory_host_offload`` in
``base.yml``, used in ``train_step`` of ``maxtext/trainers/pre_train/train.py``;
parameter offload needs ``param_scan_axis=0``), all MaxText 0.2.5.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

from multislice import maxtext

if TYPE_CHECKING:  # annotations only: the config checks use this model (through multislice.exporting)
    from multislice.config import Stage

#: Bytes of one bf16 activation element (MaxText's ``dtype: bfloat16``).
ACTIVATION_BYTES = 2
#: Bytes per logit element held at the loss: the bf16 logits (saved for the backward pass) and their bf16
#: cotangent. The fp32 cast (``cast_logits_to_fp32: true``, ``maxtext/configs/base.yml``) is fused into the cross
#: entropy's reductions, not held: the published runs of ``tests/test_memory_recipes.py`` could not have fitted
#: with it (see the module docstring).
LOGIT_BYTES = 2 + 2
#: How far XLA's HBM figure has been above and below :func:`estimate`'s on the recorded AOT compiles
#: (``tests/data/aot_recorded.json``, models over 1 GiB per chip; ``python -m benchmarks.memory_model`` measures
#: it): at most 24.6% above (the production Llama 3 8B stage: 27.61 GiB for an estimate of 22.16), rounded up
#: to 25%; it has not been below (closest: Llama 3.1 70B on v6e-32, 28.71 GiB for 28.17), kept at 5%.
#: A fitted band, not a bound: the planner compiles first the candidates whose estimate times
#: ``1 + ESTIMATE_LOW_BY`` fits (:attr:`MemoryEstimate.high_bytes`).
ESTIMATE_LOW_BY = 0.25
ESTIMATE_HIGH_BY = 0.05


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

    @classmethod
    def from_table(cls, dims: dict[str, int], *, tied_embedding: bool = False) -> ModelDims:
        """From a row of :data:`multislice.maxtext.MODEL_DIMS` (or dims under the same keys)."""
        return cls(
            emb_dim=dims["emb_dim"],
            num_query_heads=dims["num_query_heads"],
            num_kv_heads=dims["num_kv_heads"],
            num_decoder_layers=dims["num_decoder_layers"],
            mlp_dim=dims["mlp_dim"],
            head_dim=dims["head_dim"],
            vocab_size=dims["vocab_size"],
            tied_embedding=tied_embedding,
        )

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
        return ModelDims.from_table(dims)
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


def weight_shards(ici: dict[str, int], dcn: dict[str, int]) -> int:
    """How many chips shard each weight of the train state: all of them but data parallelism's (ICI and DCN
    ``data``), over which MaxText replicates it. Orbax writes one storage chunk per such shard."""
    chips = math.prod(ici.values()) * math.prod(dcn.values())
    return max(1, chips // max(1, ici.get("data", 1) * dcn.get("data", 1)))


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
        custom_remat: For ``remat_policy: custom``, where each named tensor of :data:`CUSTOM_REMAT_DEFAULTS`
            goes: ``device`` (saved in HBM), ``offload`` (saved in host memory) or ``remat`` (recomputed);
            keys the stage does not set take MaxText's defaults.
        vocab_tiling: ``num_vocab_tiling``: the loss computes the logits in this many parts along the
            batch-sequence axis, one at a time (``maxtext/configs/base.yml``; ``vocab_tiling_nnx_loss`` of
            ``maxtext/utils/vocabulary_tiling.py``, used by ``maxtext/trainers/pre_train/train.py``), 1 by default.
    """

    per_device_batch_size: float
    remat_policy: str
    ici: dict[str, int]
    dcn: dict[str, int]
    optimizer_offload: bool = False
    parameter_offload: bool = False
    weight_dtype: str = "float32"
    custom_remat: dict[str, str] = field(default_factory=dict)
    vocab_tiling: int = 1

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
            custom_remat={k: str(overrides[k]) for k in CUSTOM_REMAT_DEFAULTS if k in overrides},
            vocab_tiling=int(str(overrides.get("num_vocab_tiling", 1))),
        )


@dataclass(frozen=True)
class MemoryEstimate:
    """HBM per chip, bytes (see the module docstring for what each number means).

    Attributes:
        lower_bound_bytes: Parameters and moments kept in HBM, plus gradients.
        estimate_bytes: The lower bound plus saved activations plus the larger phase: ``logits`` with
            ``output_head``, or ``layer_working_set`` (not the sum of ``parts``).
        parts: The terms, bytes per chip: ``parameters``, ``optimizer``, ``gradients``,
            ``saved_activations``, ``logits``, ``output_head``, ``layer_working_set``.
        host_bytes: Activations the remat policy moves to host memory, bytes per chip (not in HBM).
    """

    lower_bound_bytes: int
    estimate_bytes: int
    parts: dict[str, int]
    host_bytes: int = 0

    @property
    def high_bytes(self) -> int:
        """The estimate raised by the most XLA has exceeded it on recorded compiles (:data:`ESTIMATE_LOW_BY`).

        Not a bound: a config at or under the usable HBM by this figure has fitted every time so far.
        """
        return round(self.estimate_bytes * (1 + ESTIMATE_LOW_BY))

    @property
    def low_bytes(self) -> int:
        """The estimate lowered by the most XLA has been under it on recorded compiles (:data:`ESTIMATE_HIGH_BY`).

        Not a bound (that is :attr:`lower_bound_bytes`): a config whose figure here is over the usable HBM has
        never fitted so far.
        """
        return round(self.estimate_bytes / (1 + ESTIMATE_HIGH_BY))

    def as_dict(self) -> dict[str, Any]:
        """Plain data."""
        return {**asdict(self), "high_bytes": self.high_bytes, "low_bytes": self.low_bytes}


#: ``remat_policy: custom``'s tensors and MaxText's defaults for them (``maxtext/configs/base.yml``, 0.2.5:
#: ``decoder_layer_input: 'device'``, every projection ``'remat'``); ``layers/nnx_decoders.py``
#: (``get_remat_policy``) saves the ``device`` ones in HBM and moves the ``offload`` ones to pinned host memory.
CUSTOM_REMAT_DEFAULTS: dict[str, str] = {
    "decoder_layer_input": "device", "context": "remat", "mlpwi": "remat", "mlpwi_0": "remat",
    "mlpwi_1": "remat", "mlpwo": "remat", "query_proj": "remat", "key_proj": "remat", "value_proj": "remat",
    "kv_proj": "remat", "qkv_proj": "remat", "out_proj": "remat",
}  # fmt: skip


def tensor_widths(dims: ModelDims) -> dict[str, int]:
    """Elements per token of each tensor a remat policy names (``checkpoint_name`` in MaxText's Llama layer).

    ``kv_proj`` and ``qkv_proj`` (fused projections) do not occur in the ``llama2`` decoder block: 0.
    """
    e, m = dims.emb_dim, dims.mlp_dim
    return {
        "decoder_layer_input": e,
        "query_proj": dims.num_query_heads * dims.head_dim,
        "key_proj": dims.num_kv_heads * dims.head_dim,
        "value_proj": dims.num_kv_heads * dims.head_dim,
        "kv_proj": 0,
        "qkv_proj": 0,
        "context": dims.num_query_heads * dims.head_dim,
        "out_proj": e,
        "mlpwi_0": m if dims.gated_mlp else 0,
        "mlpwi_1": m if dims.gated_mlp else 0,
        "mlpwi": 0 if dims.gated_mlp else m,
        "mlpwo": e,
    }


#: Tensors each named policy saves in HBM besides the layer input (``get_remat_policy`` of
#: ``maxtext/layers/nnx_decoders.py``, MaxText 0.2.5: ``save_only_these_names``; ``minimal`` saves every dot).
SAVED_BY_POLICY: dict[str, tuple[str, ...]] = {
    "full": (),
    "minimal_offloaded": (),
    "qkv_proj_offloaded": (),
    "save_qkv_proj": ("query_proj", "key_proj", "value_proj"),
    "save_out_proj": ("out_proj",),
    "save_dot_except_mlp": ("query_proj", "key_proj", "value_proj", "out_proj"),
    "save_dot_with_context_except_mlp": ("query_proj", "key_proj", "value_proj", "context", "out_proj"),
    "save_dot_except_mlpwi": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwo"),
    "minimal": ("query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo"),
    "minimal_with_context": (
        "query_proj", "key_proj", "value_proj", "out_proj", "mlpwi_0", "mlpwi_1", "mlpwi", "mlpwo", "context",
    ),
}  # fmt: skip
#: Tensors the ``*_offloaded`` policies move to host memory (``save_and_offload_only_these_names``).
OFFLOADED_BY_POLICY: dict[str, tuple[str, ...]] = {
    "qkv_proj_offloaded": ("query_proj", "key_proj", "value_proj"),
    "minimal_offloaded": SAVED_BY_POLICY["minimal"],
}


def saved_widths(dims: ModelDims, remat_policy: str, custom: dict[str, str] | None = None) -> tuple[int, int]:
    """Activation elements per token per layer a remat policy keeps for the backward pass: (in HBM, in host memory).

    Every policy keeps the layer input (E), the start of each layer's recomputation, in HBM unless
    ``custom`` offloads it. ``custom`` follows ``custom`` (tensor name -> ``device``/``offload``/``remat``,
    MaxText's defaults for the rest); an unknown policy is counted as ``minimal`` (the most it could keep).
    """
    widths = tensor_widths(dims)
    if remat_policy == "custom":
        where = {**CUSTOM_REMAT_DEFAULTS, **(custom or {})}
        hbm = sum(widths[name] for name, place in where.items() if place == "device")
        host = sum(widths[name] for name, place in where.items() if place == "offload")
        return hbm, host
    saved = SAVED_BY_POLICY.get(remat_policy, SAVED_BY_POLICY["minimal"])
    host = sum(widths[name] for name in OFFLOADED_BY_POLICY.get(remat_policy, ()))
    return widths["decoder_layer_input"] + sum(widths[name] for name in saved), host


def saved_width(dims: ModelDims, remat_policy: str, custom: dict[str, str] | None = None) -> int:
    """Activation elements per token per layer a remat policy keeps in HBM (:func:`saved_widths`' first)."""
    return saved_widths(dims, remat_policy, custom)[0]


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
    shards = weight_shards(knobs.ici, knobs.dcn)
    weight = maxtext.DTYPE_BYTES[knobs.weight_dtype]
    state = dims.parameters * weight / shards
    # Parameter host offload does not lower the step's HBM in MaxText 0.2.5: train_step moves every parameter
    # to device before the forward pass (``maxtext/trainers/pre_train/train.py``, ``train_step``:
    # ``curr_params = jax.device_put(curr_params, device_param_shardings)``), so they are in HBM for the whole
    # forward and backward pass; it frees HBM only between steps.
    parameters = state
    # AdamW moments offloaded to host are moved to device for the update (same function:
    # ``jax.device_put(opt_state, device_opt_shardings)``), after the activations are freed, and XLA streams
    # them leaf by leaf (the fitting recorded compile of the seed 70B stage holds fewer bytes than
    # parameters + gradients + moments): not counted.
    optimizer = 0 if knobs.optimizer_offload else 2 * state
    gradients = state
    tokens = knobs.per_device_batch_size * max_target_length  # per chip: batch and widths shard over the same chips
    tensor = knobs.ici.get("tensor", 1) * knobs.dcn.get("tensor", 1)
    hbm_width, host_width = saved_widths(dims, knobs.remat_policy, knobs.custom_remat)
    saved = dims.num_decoder_layers * tokens * hbm_width * ACTIVATION_BYTES
    host = dims.num_decoder_layers * tokens * host_width * ACTIVATION_BYTES
    logits = tokens * dims.vocab_size * LOGIT_BYTES / max(1, knobs.vocab_tiling)
    # The output head (the embedding when tied) gathered in bf16 for the logits, and its full gradient in the
    # weight dtype before the reduce-scatter; sharded only by tensor parallelism, as a layer's gathered weights.
    head = dims.vocab_size * dims.emb_dim * (ACTIVATION_BYTES + weight) / tensor
    mlp_in = (2 if dims.gated_mlp else 1) + 1
    working = 2 * dims.layer_parameters * ACTIVATION_BYTES / tensor + tokens * dims.mlp_dim * mlp_in * ACTIVATION_BYTES
    parts = {
        "parameters": round(parameters),
        "optimizer": round(optimizer),
        "gradients": round(gradients),
        "saved_activations": round(saved),
        "logits": round(logits),
        "output_head": round(head),
        "layer_working_set": round(working),
    }
    lower = parts["parameters"] + parts["optimizer"] + parts["gradients"]
    # The loss phase and a layer's backward are never live at once: the peak is the larger of the two.
    phase = max(parts["logits"] + parts["output_head"], parts["layer_working_set"])
    return MemoryEstimate(
        lower_bound_bytes=lower,
        estimate_bytes=lower + parts["saved_activations"] + phase,
        parts=parts,
        host_bytes=round(host),
    )


def from_maxtext_args(args: list[str], chips_per_slice: int, num_slices: int) -> tuple[ModelDims, Knobs, int] | None:
    """Model shape, knobs and sequence length of a compile, read from its MaxText ``key=value`` arguments.

    What the recorded AOT results (``tests/data/aot_recorded.json``, the preflight verdict cache) hold; unset
    keys take MaxText's defaults (``maxtext/configs/base.yml``: ICI ``fsdp`` and DCN ``data`` take the rest of
    the chips, ``remat_policy: full``, ``weight_dtype: float32``). Returns None when the model is neither a
    ``model_name`` of :data:`multislice.maxtext.MODEL_DIMS` nor given by explicit dims.
    """
    given = dict(a.split("=", 1) for a in args if "=" in a)
    name = given.get("model_name")
    if name is not None:
        if name not in maxtext.MODEL_DIMS:
            return None
        d = maxtext.MODEL_DIMS[name]
    elif all(key in given for key in maxtext.MODEL_DIM_KEYS.values()):
        d = {k: int(given[key]) for k, key in maxtext.MODEL_DIM_KEYS.items()}
    else:
        return None
    dims = ModelDims.from_table(d, tied_embedding=name is None and given.get("logits_via_embedding") == "true")

    def degrees(net: str, defaults: dict[str, int], target: int) -> dict[str, int]:
        found = {a: int(given.get(f"{net}_{a}_parallelism", defaults.get(a, 1))) for a in maxtext.PARALLELISM_AXES}
        fixed = math.prod(d for d in found.values() if d != -1)
        return {a: target // fixed if d == -1 else d for a, d in found.items()}

    knobs = Knobs(
        per_device_batch_size=float(given["per_device_batch_size"]),
        remat_policy=given.get("remat_policy", "full"),
        ici=degrees("ici", maxtext.ICI_DEFAULTS, chips_per_slice),
        dcn=degrees("dcn", maxtext.DCN_DEFAULTS, num_slices),
        optimizer_offload=given.get("optimizer_memory_host_offload") == "true",
        parameter_offload=given.get("parameter_memory_host_offload") == "true",
        weight_dtype=given.get("weight_dtype", "float32"),
        custom_remat={k: given[k] for k in CUSTOM_REMAT_DEFAULTS if k in given},
        vocab_tiling=int(given.get("num_vocab_tiling", 1)),
    )
    return dims, knobs, int(given["max_target_length"])
