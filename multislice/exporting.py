"""What a stage's Hugging Face export needs, known before anything runs: whether it can run, its dtype, its size.

Used by the plan (the export's dtype, :func:`default_dtype`), the config checks (:func:`model_issue`,
:func:`tokenizer_issue`: refused at plan, before anything is created) and the GKE export Job
(:func:`sizing`: its memory request and the size of its scratch volume); the model card's facts are
:func:`multislice.reports.model_card`. The exporter itself is
:mod:`multislice.trainer.export` (trainer image); what it supports is its :data:`~multislice.trainer.export.SUPPORTED`,
mirrored here from the stage's config, without MaxText.

Memory of the export (:func:`sizing`), from the exporter's phases, which run one after the other in one process
(:mod:`multislice.trainer.export`), with ``G`` the parameters of its largest conversion group (the embedding or the
output head, ``vocab x emb``) and ``Y`` those of one decoder layer:

* the streamed conversion with MaxText's side of the logits check fed by it: a group's arrays read in float32,
  MaxText's hooks' output, the cast copy and safetensors' serialised copy, :data:`GROUP_BYTES_PER_PARAMETER`
  (12) bytes a parameter of the largest group, measured 8.6 to 10.4 for Llama 3 8B at 4 and 32 layers
  (``benchmarks/results/export_memory.json``); a decoder layer's group also holds MaxText's rounded and JAX
  copies of the layer, :data:`LAYER_BYTES_PER_PARAMETER` (14) bytes a parameter; plus one decoded storage chunk
  of a stacked array (the stacked layers are split once into local files, a chunk at a time:
  :meth:`multislice.trainer.export.CheckpointReader.layer`), the largest stacked weight over its shards;
* each loader (a separate process, layer by layer): one layer in float32 and its tensors read,
  :data:`LOADER_BYTES_PER_LAYER_PARAMETER` (8) bytes a parameter of a layer, plus a block of the embedding or head;
* :data:`OVERHEAD_BYTES` for the interpreter, JAX, MaxText, torch and the tokenizer, on top of the largest phase.

So Llama 3 8B (G = 525M, Y = 218M): max(12 x 525M, 14 x 218M) + 4 GiB = 10.6e9 bytes, and one storage chunk;
Llama 3 70B (G = 1.05B, Y = 856M): max(12.6e9, 14 x 856M = 12.0e9) + 4 GiB = 16.9e9 bytes and one chunk, decoded
and its layer's copy (2 x 4 B x 80 x 8192 x 28672 / 32 = 4.7e9 for the seed's float32 checkpoint sharded 32 ways;
2.3e9 in bfloat16): requests of 21 GiB and 18 GiB (793 GiB when the check restored the model). Depth enters only
through the chunk (a stacked weight spans every layer).
The scratch volume holds the export before it is copied to ``gs://`` (``b P``, ``b`` bytes per exported element)
and the split stacked layers while they are converted (the checkpoint's bytes of the layers, 2 or 4 a parameter by
the stage's ``weight_dtype``; each layer's file is deleted once converted, so the most at once is all of them
beside the embedding's shard, or the whole export at the end), plus :data:`SCRATCH_MARGIN` (tokenizer files, the
safetensors index; 10 %) and 1 GiB.

Time (:attr:`ExportSizing.seconds`): the exporter's conversion and check are CPU-bound; measured on the development
machine (2 cores) at Llama 3 8B's width, :data:`CONVERSION_PARAMETERS_PER_SECOND` and
:data:`CHECK_PARAMETERS_PER_SECOND`; the export Job gets twice the estimate (:data:`TIME_MARGIN`) after the
verifier's own timeout. Llama 3 8B: 2 x (8.03e9 / 45e6 + 8.03e9 / 55e6) = 649 s; 70B: 5,701 s.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from multislice import maxtext
from multislice.memory import model_dims

#: Models of at least this many parameters are exported in bfloat16 by default (the issue's "a billion").
BFLOAT16_FROM_PARAMETERS = 10**9
#: Bytes per element of the export's dtypes.
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
#: Bytes a parameter of the conversion's largest group (embedding or output head) while it is converted (measured
#: at Llama 3 8B's width: 8.6 at 4 layers, 10.4 at 32: benchmarks/results/export_memory.json, ``llama3-8b``).
GROUP_BYTES_PER_PARAMETER = 12
#: Bytes a parameter of a decoder layer while it is converted and MaxText's side of the check applies it.
LAYER_BYTES_PER_PARAMETER = 14
#: A loader's bytes a parameter of the layer it holds (multislice.trainer.export.LOADER_BYTES_PER_LAYER_PARAMETER).
LOADER_BYTES_PER_LAYER_PARAMETER = 8
#: A loader's memory beyond its layer: interpreter, torch, transformers and one block of the embedding or head
#: (multislice.trainer.export.LOADER_BASELINE_BYTES).
LOADER_BASELINE_BYTES = 2**30 + 2 * 256 * 2**20
#: Interpreter, JAX, MaxText, torch, tokenizer and logits, bytes.
OVERHEAD_BYTES = 4 * 2**30
#: Parameters a second the exporter converts (and MaxText's side of the check applies), measured at Llama 3 8B on
#: the development machine (2 cores: 8.03e9 in 152 s, 53e6; benchmarks/results/export_memory.json, ``llama3-8b``).
CONVERSION_PARAMETERS_PER_SECOND = 45e6
#: Parameters a second the two loaders check, layer by layer (same measurement: both loaders in 121 s, 66e6).
CHECK_PARAMETERS_PER_SECOND = 55e6
#: The export Job's time: this many times the estimate.
TIME_MARGIN = 2.0
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
        scratch_bytes: Local disk for the export and the split layers before the copy to ``gs://``, bytes.
        seconds: The export's run time to allow (conversion and check, :data:`TIME_MARGIN` over the estimate).
    """

    parameters: int
    dtype: str
    memory_bytes: int
    scratch_bytes: int
    seconds: float

    @staticmethod
    def quantity(count: int) -> str:
        """``count`` bytes as a Kubernetes quantity in whole GiB, rounded up (``94Gi``)."""
        return f"{max(1, math.ceil(count / 2**30))}Gi"


def checkpoint_bytes_per_parameter(stage: Any) -> int:
    """Bytes a parameter in the stage's checkpoint: 2 when it trains with ``weight_dtype: bfloat16``, else 4
    (MaxText's default float32)."""
    return maxtext.DTYPE_BYTES.get(str(stage.maxtext_overrides.get("weight_dtype", "float32")), 4)


def sizing(stage: Any, dtype: str, weight_shards: int = 1) -> ExportSizing:
    """The export's memory, scratch disk and time for a stage (``multislice.config.Stage``) in ``dtype``.

    ``weight_shards``: how many ways the training sharded each weight (its checkpoint's storage chunks of a stacked
    weight: one decoded at a time); 1 counts a whole stacked weight.

    Raises:
        ValueError: the model's dimensions are unknown (:func:`model_issue` refuses such a stage at plan).
    """
    dims = model_dims(stage)
    if dims is None:
        raise ValueError(f"stage {stage.name}: the model's dimensions are unknown; cannot size its export")
    width = DTYPE_BYTES[dtype]
    stored = checkpoint_bytes_per_parameter(stage)
    layer = dims.layer_parameters
    group = dims.vocab_size * dims.emb_dim
    largest_weight = dims.num_decoder_layers * dims.emb_dim * max(dims.mlp_dim, dims.num_query_heads * dims.head_dim)
    chunk = 2 * stored * largest_weight // max(1, weight_shards)  # one decoded chunk and its layer's copy
    conversion = max(GROUP_BYTES_PER_PARAMETER * group, LAYER_BYTES_PER_PARAMETER * layer) + chunk
    loader = LOADER_BYTES_PER_LAYER_PARAMETER * layer + LOADER_BASELINE_BYTES
    memory = max(conversion, loader) + OVERHEAD_BYTES
    # the split layers are deleted as each is converted: at most all of them beside the embedding's shard, or the
    # whole export at the end
    layers_bytes = stored * layer * dims.num_decoder_layers
    disk = max(layers_bytes + width * group, width * dims.parameters)
    scratch = math.ceil(disk * (1 + SCRATCH_MARGIN)) + 2**30
    seconds = TIME_MARGIN * (
        dims.parameters / CONVERSION_PARAMETERS_PER_SECOND + dims.parameters / CHECK_PARAMETERS_PER_SECOND
    )
    return ExportSizing(
        parameters=dims.parameters, dtype=dtype, memory_bytes=memory, scratch_bytes=scratch, seconds=seconds
    )


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
