"""What a stage's Hugging Face export needs, known before anything runs: whether it can run, its dtype, its size.

Used by the plan (the export's dtype, :func:`default_dtype`), the config checks (:func:`model_issue`,
:func:`tokenizer_issue`: refused at plan, before anything is created) and the GKE export Job
(:func:`sizing`: its memory request and the size of its scratch volume); the model card's facts are
:func:`multislice.reports.model_card`. The exporter itself is
:mod:`multislice.trainer.export` (trainer image); what it supports is its :data:`~multislice.trainer.export.SUPPORTED`,
mirrored here from the stage's config, without MaxText.

Memory of the export (:func:`sizing`), ``P`` parameters, ``b`` bytes per exported element (2 for bfloat16, 4 for
float32), from the exporter's phases, which run one after the other (:mod:`multislice.trainer.export`):

* the streamed conversion (read a layer group of the checkpoint, convert it, write its safetensors shard, free
  it): the largest group in float32 plus its converted copy, ``2 x 4 x max(one layer, vocab x emb)`` bytes (the
  embedding and the output head are the largest single arrays of a Llama 3 model; :data:`CONVERSION_GROUP_COPIES`);
* MaxText's side of the logits check: the restored parameters in float32, their copy rounded to the export's dtype
  (bfloat16 only: the check compares against MaxText on the weights the loaders see), and the model's own JAX
  arrays: :data:`REFERENCE_FLOAT32_COPIES` float32 copies, ``3 x 4 P`` in bfloat16, ``2 x 4 P`` in float32;
* each loader (a separate process, after MaxText's side is freed): the exported weights read (``b P``) and the
  model in float32 (``4 P``);
* :data:`OVERHEAD_BYTES` for the interpreter, JAX, torch and the tokenizer, on top of the largest phase.

So Llama 3 8B (8.03e9 parameters) in bfloat16: 12 x 8.03e9 + 4 GiB = 100.6e9 bytes, a request of 94 GiB; Llama 3
70B (70.55e9): 12 x 70.55e9 + 4 GiB = 850.9e9 bytes, 793 GiB. MaxText's side dominates; an exporter that rounds in
place or feeds its arrays to JAX without a copy lowers :data:`REFERENCE_FLOAT32_COPIES` and these requests with it.
The scratch volume holds the export before it is copied to ``gs://``: ``b P`` plus :data:`SCRATCH_MARGIN`
(tokenizer files, the safetensors index; 10 %) and 1 GiB: 18 GiB for 8B, 146 GiB for 70B in bfloat16.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from multislice.memory import model_dims

#: Models of at least this many parameters are exported in bfloat16 by default (the issue's "a billion").
BFLOAT16_FROM_PARAMETERS = 10**9
#: Bytes per element of the export's dtypes.
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
#: MaxText's side of the logits check, float32 copies of the parameters held at once, by export dtype: the restored
#: parameters, the copy rounded to the export's dtype (bfloat16 only), the model's JAX arrays.
REFERENCE_FLOAT32_COPIES = {"bfloat16": 3, "float32": 2}
#: The conversion's largest group: read (float32) and converted, so two float32 copies of it.
CONVERSION_GROUP_COPIES = 2
#: Interpreter, JAX, torch, tokenizer and logits, bytes.
OVERHEAD_BYTES = 4 * 2**30
#: Scratch volume beyond the weights: 10 %, plus 1 GiB.
SCRATCH_MARGIN = 0.10
#: The MaxText model names whose config the exporter accepts (decoder block ``llama2``, SwiGLU, untied embeddings,
#: default RoPE): ``maxtext/configs/models/<name>.yml`` of MaxText 0.2.5. ``llama3.1-*`` use Llama 3.1's scaled,
#: interleaved RoPE (``maxtext/layers/attentions.py``: ``model_name.startswith("llama3.1")``), which it refuses.
EXPORTABLE_MODEL_NAMES = ("llama2-7b", "llama2-13b", "llama2-70b", "llama3-8b", "llama3-70b", "llama3.3-70b")
#: ``maxtext_overrides`` keys and the values the exporter accepts for them (anything else is refused at plan).
EXPORTABLE_OVERRIDES: dict[str, Any] = {
    "decoder_block": "llama2",
    "logits_via_embedding": False,
    "rope_type": "default",
    "rope_min_timescale": 1,
    "mlp_activations": ["silu", "linear"],
}
#: What the exporter supports, in words (kept in step with multislice.trainer.export.SUPPORTED).
SUPPORTED_MODELS = (
    "the Llama 2/3 decoder block (decoder_block llama2, mlp_activations [silu, linear], untied embeddings, default "
    f"RoPE): model.name one of {', '.join(EXPORTABLE_MODEL_NAMES)}, or explicit dims of that architecture"
)
SUPPORTED_TOKENIZERS = (
    "a tiktoken file (Llama 3's scheme, as MaxText's TikTokenTokenizer reads it), a sentencepiece .model file, or a "
    "Hugging Face tokenizer.json file or a directory holding one (local or gs://)"
)


def default_dtype(stage: Any) -> str:
    """The export dtype of a stage (``multislice.config.Stage``): its ``export_dtype``, else bfloat16 from
    :data:`BFLOAT16_FROM_PARAMETERS` parameters up, else float32 (also when the model's size is unknown)."""
    if stage.export_dtype:
        return stage.export_dtype
    dims = model_dims(stage)
    return "bfloat16" if dims is not None and dims.parameters >= BFLOAT16_FROM_PARAMETERS else "float32"


@dataclass(frozen=True)
class ExportSizing:
    """What one stage's export needs on a node (see the module docstring for the arithmetic).

    Attributes:
        parameters: The model's parameters.
        dtype: The exported dtype.
        memory_bytes: Peak resident memory of the exporter, bytes.
        scratch_bytes: Local disk for the export before it is copied to ``gs://``, bytes.
    """

    parameters: int
    dtype: str
    memory_bytes: int
    scratch_bytes: int

    @staticmethod
    def quantity(count: int) -> str:
        """``count`` bytes as a Kubernetes quantity in whole GiB, rounded up (``94Gi``)."""
        return f"{max(1, math.ceil(count / 2**30))}Gi"


def sizing(stage: Any, dtype: str) -> ExportSizing:
    """The export's memory and scratch disk for a stage (``multislice.config.Stage``) in ``dtype``.

    Raises:
        ValueError: the model's dimensions are unknown (:func:`model_issue` refuses such a stage at plan).
    """
    dims = model_dims(stage)
    if dims is None:
        raise ValueError(f"stage {stage.name}: the model's dimensions are unknown; cannot size its export")
    width = DTYPE_BYTES[dtype]
    largest = max(dims.layer_parameters, dims.vocab_size * dims.emb_dim)
    conversion = CONVERSION_GROUP_COPIES * 4 * largest
    reference = REFERENCE_FLOAT32_COPIES[dtype] * 4 * dims.parameters
    loader = (4 + width) * dims.parameters
    memory = max(conversion, reference, loader) + OVERHEAD_BYTES
    scratch = math.ceil(width * dims.parameters * (1 + SCRATCH_MARGIN)) + 2**30
    return ExportSizing(parameters=dims.parameters, dtype=dtype, memory_bytes=memory, scratch_bytes=scratch)


def model_issue(stage: Any) -> str | None:
    """Why the exporter cannot export the stage's model (``multislice.config.Stage``), or None when it can."""
    model = stage.model
    problems = []
    if model.name is not None and model.name not in EXPORTABLE_MODEL_NAMES:
        problems.append(f"model.name {model.name}")
    if model.name is None:
        if model.decoder_block not in (None, "llama2"):
            problems.append(f"model.decoder_block {model.decoder_block}")
        if model.mlp_activations is not None and list(model.mlp_activations) != ["silu", "linear"]:
            problems.append(f"model.mlp_activations {list(model.mlp_activations)}")
        if model.logits_via_embedding:
            problems.append("model.logits_via_embedding true (tied embeddings)")
    for key, accepted in EXPORTABLE_OVERRIDES.items():
        if key in stage.maxtext_overrides and stage.maxtext_overrides[key] != accepted:
            problems.append(f"maxtext_overrides.{key} {stage.maxtext_overrides[key]}")
    if not problems:
        return None
    return f"cannot export {', '.join(problems)} as a Hugging Face Llama; the exporter supports {SUPPORTED_MODELS}"


def tokenizer_issue(tokenizer: Any, *, read_files: bool = False) -> str | None:
    """Why the stage's tokenizer (``multislice.config.data.TokenizerSpec``) cannot be exported, or None.

    Without ``read_files`` only the spec is looked at (a Hub name, a sentencepiece file that is not ``.model``);
    with it (the plan step) a local Hugging Face path must be a ``.json`` file or a directory with
    ``tokenizer.json``, and a local tokenizer file must exist.
    """
    path = tokenizer.path
    local = not path.startswith(("gs://", "maxtext:"))
    if tokenizer.type == "sentencepiece" and not path.endswith(".model"):
        return f"tokenizer.path {path!r} is not a sentencepiece .model file; the exporter reads {SUPPORTED_TOKENIZERS}"
    if tokenizer.type == "huggingface":
        if local and not path.startswith(("/", ".")):
            return (
                f"tokenizer.path {path!r} names a Hugging Face Hub tokenizer, which the exporter does not download; "
                "give a local or gs:// tokenizer.json or a directory holding one"
            )
        if read_files and local:
            if os.path.isdir(path) and not os.path.isfile(os.path.join(path, "tokenizer.json")):
                return f"tokenizer.path {path!r} has no tokenizer.json; the exporter reads {SUPPORTED_TOKENIZERS}"
            if not os.path.isdir(path) and not path.endswith(".json"):
                return f"tokenizer.path {path!r} is not a tokenizer.json; the exporter reads {SUPPORTED_TOKENIZERS}"
    if read_files and local and not os.path.exists(path):
        return f"tokenizer.path {path!r} does not exist"
    return None


def hub_token_locally() -> bool:
    """Whether this machine's environment has a Hugging Face token in ``$HF_TOKEN``: what the exporter reads (its
    contract with :func:`multislice.trainer.export.command`; the token file of ``hf auth login`` is not read)."""
    return bool(os.environ.get("HF_TOKEN", "").strip())


def nearest_existing(path: str) -> str:
    """The deepest existing path (a directory or a file) at or above local ``path``."""
    current = os.path.abspath(path)
    while not os.path.exists(current):
        parent = os.path.dirname(current)
        if parent == current:
            break
        current = parent
    return current


def destination_issue(export_dir: str) -> str | None:
    """Why a local export directory cannot be written, or None: a file stands where a directory of its path must be,
    or its deepest existing directory is not writable by this user (``os.access``; root may write anywhere).

    A ``gs://`` destination is the run directory's bucket, which the plan step writes its report to first.
    """
    if export_dir.startswith("gs://"):
        return None
    found = nearest_existing(export_dir)
    if os.path.abspath(export_dir) != found and not os.path.isdir(found):
        return f"the export directory {export_dir} cannot be created: {found} is a file"
    if os.path.isdir(found) and not os.access(found, os.W_OK | os.X_OK):
        return f"the export directory {export_dir} cannot be created: {found} is not writable by this user"
    if os.path.abspath(export_dir) == found and not os.path.isdir(found):
        return f"the export directory {export_dir} is a file"
    return None
