"""Hugging Face export: a stage's checkpoint as a Llama that transformers 4.x and 5.x load, checked by its logits.

Usage (trainer environment)::

    python -m multislice.trainer.export --checkpoint-dir DIR --step N --output DIR \
        [--report report.json] [--dtype bfloat16|float32] [--hub-repo OWNER/NAME] [--tokens T] \
        [--sample-fraction F] [--layers-per-shard K] [--run-name R --data-fingerprint D --steps S \
        --train-loss L --eval-loss E] -- key=value ...   # the stage's MaxText arguments

``--checkpoint-dir``, ``--output`` and ``--report`` may be ``gs://`` URIs: the export is written to a local
scratch directory, checked there, then copied to ``--output`` with ``etils.epath`` (the report names the final
URI). ``--hub-repo`` uploads the checked export with ``huggingface_hub``'s API (token from ``HF_TOKEN``).

What it does:

1. **Streaming conversion, bounded memory.** The checkpoint's arrays are not restored as a tree: each weight
   is opened as the TensorStore array Orbax wrote (Orbax's own read spec,
   ``orbax/checkpoint/_src/serialization/tensorstore_utils.py``: ``build_array_read_spec`` and
   ``get_ts_context``; OCDBT or not as ``type_handlers.is_ocdbt_checkpoint`` says) and only the slice of a layer
   group is read: MaxText's scanned layers stack every layer of a weight in one array along ``param_scan_axis``
   (1), so layer ``i`` of ``decoder/layers/mlp/wi_0/kernel`` is ``array[:, i, :]``. Each slice is read one
   storage chunk at a time (a chunk is a device's shard as the trainer saved it: with the layer axis unsharded
   it spans all layers, so at most one chunk's decoded bytes are held beside the slice). The slices are mapped
   to Hugging Face's Llama names and layouts with MaxText's own conversion tables for Llama 3.1
   (``maxtext/checkpoint_conversion/utils/param_mapping.py``: ``LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING`` and its
   hooks, which scale the query by sqrt(head_dim) and transpose kernels; ``hf_shape.py``;
   ``utils.process_maxtext_param``, called once per layer slice), cast to ``--dtype`` and written as one
   safetensors shard per group (the embedding; ``--layers-per-shard`` decoder layers; the final norm and output
   head) with ``model.safetensors.index.json`` (Hugging Face's sharded format), then freed. Peak memory of the
   conversion: the largest group in float32 plus its converted copy plus one storage chunk (see
   ``docs/delivery.md`` for 8B and 70B). The price: each group reads the chunks that hold its slice, so the
   stacked layer weights are read ``num_layers / layers_per_shard`` times.
2. **Metadata that every Llama loader reads.** ``config.json`` has transformers 5's ``rope_parameters`` and
   4.x's top-level ``rope_theta`` / ``rope_scaling`` and ``torch_dtype`` as well as ``dtype``;
   ``max_position_embeddings`` is the model family's context (:func:`max_positions`), not the training
   sequence length; ``generation_config.json`` has BOS/EOS; ``README.md`` is a model card with the run, data
   fingerprint, steps and final losses.
3. **The stage's own tokenizer** (:func:`stage_tokenizer`): Llama 3 tiktoken (MaxText's ``TikTokenTokenizer``
   with its special tokens, converted by ``transformers``' ``TikTokenConverter``), sentencepiece (the ``.model``'s
   BPE or unigram pieces and normalizer, as MaxText's ``SentencePieceTokenizer`` encodes) or a Hugging Face
   tokenizer directory, written as ``tokenizer.json`` with ``tokenizer_class: PreTrainedTokenizerFast``.
4. **The check, twice, layer by layer.** MaxText's own model (float32 activations, highest matmul precision)
   computes, as the conversion reads each group (:class:`MaxTextReference`: its ``LlamaDecoderLayer`` one layer
   at a time, then the final norm and head), the hidden states and logits of the exported tokenizer's encoding of
   :data:`TEXT` (real token ids, each below the model's vocab: a tokenizer with more tokens than the model is an
   error); then each loader, a separate process (:mod:`multislice.trainer.hf_loader`), computes them from the
   export one ``LlamaDecoderLayer`` at a time in float32, and checks the export has exactly ``LlamaForCausalLM``'s
   tensors: the trainer environment's transformers 5 and the pinned transformers 4.57 environment
   (``requirements/loader-hf4.txt``, ``make env``). Both must pass; the per-layer differences say where a wrong
   conversion starts. ``--sample-fraction`` compares a seeded random fraction of the positions (the report
   states it) for large vocabularies and long inputs. Memory is a layer group's, not the model's: flat in depth.

Tolerance: ``|hf - maxtext| <= atol + rtol * |maxtext|`` elementwise, with ``atol`` :data:`ATOL` and
``rtol`` :data:`RTOL`. Both sides compute in float32 on CPU; with ``--dtype float32`` the weights are the same
and the sides differ only by the order of floating-point operations (order 1e-6 on logits of order 1). With
``--dtype bfloat16`` the loaders compute from the bf16-rounded weights (upcast to float32) while MaxText uses
the checkpoint's float32 ones, so the comparison is against MaxText run on the same bf16-rounded weights
(:func:`as_exported` rounds them the same way): the check tests the conversion, not the rounding. A wrong
conversion (an untransposed kernel, RoPE's layout permuted, the query scale missing, the wrong rope_theta)
moves logits by order 0.1 to 1. The argmax token must agree at every compared position too.

Exit status: 0 when the export was written and both loaders' logits matched, 1 when they did not, 2 when the
export could not be made (the JSON report, printed last, says why).
"""

from __future__ import annotations

import argparse
import atexit
import itertools
import json
import math
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from multislice.trainer import digests, verify
from multislice.trainer.worker import resolve_package_paths

#: This module, as the trainer image runs it.
MODULE = "multislice.trainer.export"
#: Absolute and relative tolerance of the logits check (see the module docstring).
ATOL = 1e-3
RTOL = 1e-3
#: Tokens compared (at most the stage's ``max_target_length``).
TOKENS = 64
#: The text whose tokens both models see.
TEXT = (
    "The quick brown fox jumps over the lazy dog. Kubeflow Pipelines trains a model on multislice TPU with "
    "MaxText, verifies its checkpoint and exports it in Hugging Face format, so that anyone can serve it."
)
#: The MaxText conversion tables used: those of Llama 3.1 (same parameter names as our Llama 3 presets).
MAPPING_MODEL = "llama3.1-8b"
#: Tokenizer file of the maxtext package (relative to the package): the default when a stage names none.
TOKENIZER_ASSET = "assets/tokenizers/tokenizer_llama3.tiktoken"
#: What the exporter supports (the Llama 2/3 decoder block MaxText names ``llama2``).
SUPPORTED = "decoder_block llama2 with mlp_activations [silu, linear], untied embeddings, default RoPE"
#: Tokenizer types the exporter writes (MaxText's ``tokenizer_type`` values, ``maxtext/configs/base.yml``).
TOKENIZER_TYPES = ("tiktoken", "sentencepiece", "huggingface")
#: Models of at least this many parameters are exported in bfloat16 unless ``--dtype`` says otherwise.
BF16_FROM_PARAMETERS = 1_000_000_000
#: Decoder layers per safetensors shard (a layer group: what the conversion holds at once).
LAYERS_PER_SHARD = 1
#: ``max_position_embeddings`` of the Llama families by RoPE theta: Meta's ``config.json`` of Llama 3 8B/70B
#: (rope_theta 500000, 8192 positions) and Llama 2 (rope_theta 10000, 4096 positions).
MAX_POSITIONS_BY_THETA = {500000.0: 8192, 10000.0: 4096}
#: The pinned transformers 4.x loader's interpreter: this environment variable, else ``<venvs>/loader-hf4``
#: beside the trainer environment (``make env``; the trainer image's ``/opt/loader-hf4``).
LOADER4_ENV = "MULTISLICE_LOADER_HF4_PYTHON"
#: The Hub token's environment variable (``huggingface_hub``'s own name for it).
HF_TOKEN_ENV = "HF_TOKEN"


class Unsupported(ValueError):
    """The stage's model or tokenizer cannot be exported as a Hugging Face Llama (the message says which setting)."""


#: The model card's facts (:func:`command`'s ``card``) and the exporter's options for them.
CARD_OPTIONS = {
    "run": "--run-name", "stage": "--stage", "data_fingerprint": "--data-fingerprint", "steps": "--steps",
    "train_loss": "--train-loss", "eval_loss": "--eval-loss",
}  # fmt: skip


def command(
    checkpoint_dir: str,
    step: int,
    output: str,
    maxtext_args: list[str],
    python: str = "python",
    *,
    dtype: str | None = None,
    hub_repo: str | None = None,
    report: str | None = None,
    card: dict[str, Any] | None = None,
    export_format: str = "huggingface",
) -> list[str]:
    """The exporter's command line for a stage (an argument list, never a shell string).

    Args:
        checkpoint_dir: The stage's checkpoint directory (local or ``gs://``).
        step: The checkpoint step to export.
        output: The export directory (local or ``gs://``).
        maxtext_args: The stage's MaxText ``key=value`` arguments.
        python: The interpreter.
        dtype: ``--dtype`` (``bfloat16`` or ``float32``); None: the exporter's default.
        hub_repo: ``--hub-repo OWNER/NAME`` (the token from ``$HF_TOKEN``, never an argument); None: no upload.
        report: ``--report``: where the exporter writes its JSON report too (local or ``gs://``).
        card: The model card's facts, each given one an option (None values left out): ``run`` (``--run-name``),
            ``stage``, ``data_fingerprint``, ``steps``, ``train_loss``, ``eval_loss``
            (:func:`multislice.reports.model_card`).
        export_format: ``--format`` (:data:`FORMATS`, the stage's ``export``); the default is left out.
    """
    argv = [python, "-m", MODULE, "--checkpoint-dir", checkpoint_dir, "--step", str(step), "--output", output]
    if export_format != "huggingface":
        argv += ["--format", export_format]
    if dtype:
        argv += ["--dtype", dtype]
    if hub_repo:
        argv += ["--hub-repo", hub_repo]
    if report:
        argv += ["--report", report]
    for key, option in CARD_OPTIONS.items():
        value = (card or {}).get(key)
        if value is not None:
            argv += [option, str(value)]
    return [*argv, "--", *maxtext_args]


def tokenizer_path() -> Path:
    """The Llama 3 tiktoken file that the installed maxtext package ships."""
    import maxtext

    return Path(maxtext.__file__).parent / TOKENIZER_ASSET


def _tokenizer_spec(config: Any) -> tuple[str, str, bool, bool]:
    """``(type, path, add_bos, add_eos)`` of the stage's tokenizer (MaxText's ``tokenizer_*`` keys).

    A stage whose MaxText arguments name no ``tokenizer_path`` (synthetic data) gets the project's default, the
    maxtext package's Llama 3 tokenizer with BOS (``multislice.config.data.DEFAULT_TOKENIZER``), not MaxText's
    own default (``tokenizer.llama2``, a path under ``src/`` that the installed package does not have).
    """
    if not getattr(config, "_stage_names_tokenizer", True):
        return "tiktoken", str(tokenizer_path()), True, False
    kind = getattr(config, "tokenizer_type", "sentencepiece")
    kind = str(getattr(kind, "value", kind))
    return kind, str(config.tokenizer_path), bool(config.add_bos), bool(config.add_eos)


def stage_config(maxtext_args: list[str]) -> Any:
    """MaxText's config of the stage for the export: float32 activations and weights, highest matmul precision
    (shapes are unchanged), and whether the stage named its tokenizer (:func:`_tokenizer_spec`)."""
    # the plan names the maxtext package's tokenizers as maxtext:assets/... (resolved as the trainer does)
    maxtext_args = resolve_package_paths(maxtext_args)
    # weight_dtype float32 too: MaxText's conversion casts each converted tensor to it (utils._process's
    # save_dtype), so a bfloat16-trained stage's query (x sqrt(head_dim)) would be rounded to bfloat16 before the
    # export's own cast; the export's dtype is --dtype's alone
    config = verify._config([*maxtext_args, "dtype=float32", "weight_dtype=float32", "matmul_precision=highest"])
    named = any(a.startswith("tokenizer_path=") for a in maxtext_args)
    object.__setattr__(config, "_stage_names_tokenizer", named)
    return config


def maxtext_tokenizer(config: Any) -> Any:
    """MaxText's own tokenizer of the stage (``maxtext/input_pipeline/tokenizer.py``: ``build_tokenizer``)."""
    from maxtext.input_pipeline.tokenizer import build_tokenizer

    kind, path, add_bos, add_eos = _tokenizer_spec(config)
    return build_tokenizer(path, kind, add_bos, add_eos, None)


def _template(bos: tuple[str, int] | None, eos: tuple[str, int] | None) -> Any:
    """The post-processor that adds BOS/EOS as MaxText's tokenizer does (``add_bos``, ``add_eos``)."""
    from tokenizers import processors

    single = " ".join(([bos[0]] if bos else []) + ["$A"] + ([eos[0]] if eos else []))
    pair = " ".join(([bos[0]] if bos else []) + ["$A:0"] + ([bos[0] + ":1"] if bos else []) + ["$B:1"])
    return processors.TemplateProcessing(single=single, pair=pair, special_tokens=[t for t in (bos, eos) if t])


def _tiktoken(path: str, add_bos: bool, add_eos: bool, model_max_length: int = 131072) -> Any:
    """A tiktoken BPE file with MaxText's ``TikTokenTokenizer`` special tokens, as a fast tokenizer.

    ``model_max_length`` (tokens) goes to ``tokenizer_config.json``; 131072 is Llama 3.1's context, kept for the
    training-time tokenizer file (:mod:`multislice.trainer.hf_tokenizer`), which MaxText never truncates by.
    """
    from maxtext.input_pipeline.tokenizer import TikTokenTokenizer
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    source = TikTokenTokenizer(path, add_bos=add_bos, add_eos=add_eos)
    converter = TikTokenConverter(vocab_file=path, pattern=source.pat_str, extra_special_tokens=source.special_tokens)
    # transformers 4.57 (the second loader's) reads this attribute, 5.x the extra_special_tokens argument above;
    # the checker sees 5.x's TikTokenConverter only
    converter.additional_special_tokens = list(source.special_tokens)  # pyright: ignore[reportAttributeAccessIssue]
    backend = converter.converted()
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    backend.post_processor = _template(
        (bos, source.special_tokens[bos]) if add_bos else None, (eos, source.special_tokens[eos]) if add_eos else None
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, model_max_length=model_max_length
    )


def _sentencepiece(path: str, add_bos: bool, add_eos: bool, model_max_length: int = int(1e30)) -> Any:
    """A sentencepiece ``.model`` as a fast tokenizer that encodes as MaxText's ``SentencePieceTokenizer``.

    Built from the model's own pieces and normalizer spec (``sentencepiece_model.proto``): BPE (merges from the
    piece scores, ``transformers.tokenization_utils_base.generate_merges``) or unigram, byte fallback,
    the dummy prefix (``add_dummy_prefix``), spaces as ``▁``, the precompiled normalization map; control
    pieces (``<s>``, ``</s>``) and unknown (``<unk>``) special. One difference remains by design: a literal
    ``<s>`` in the text is a control token to Hugging Face tokenizers and plain text to sentencepiece.

    Raises:
        Unsupported: a sentencepiece model type other than BPE or unigram (char, word).
    """
    from sentencepiece import sentencepiece_model_pb2
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.tokenization_utils_base import generate_merges

    # protobuf makes the module's message classes at import: the checker cannot see them
    proto = sentencepiece_model_pb2.ModelProto()  # pyright: ignore[reportAttributeAccessIssue]
    proto.ParseFromString(verify.checkpoint_path(path).read_bytes())
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    pieces = list(proto.pieces)
    if trainer.model_type == 2:  # BPE
        vocab = {p.piece: i for i, p in enumerate(pieces)}
        merges = generate_merges(vocab, {p.piece: p.score for p in pieces})
        model = models.BPE(
            vocab=vocab, merges=merges, unk_token=pieces[trainer.unk_id].piece, fuse_unk=True,
            byte_fallback=trainer.byte_fallback,
        )  # fmt: skip
    elif trainer.model_type == 1:  # unigram
        model = models.Unigram([(p.piece, p.score) for p in pieces], trainer.unk_id, trainer.byte_fallback)
    else:
        raise Unsupported(f"sentencepiece model type {trainer.model_type} of {path}: only BPE (2) and unigram (1)")
    backend = Tokenizer(model)
    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:
        steps += [normalizers.Strip(), normalizers.Replace(Regex(" {2,}"), " ")]
    steps += ([normalizers.Prepend("▁")] if spec.add_dummy_prefix else []) + [normalizers.Replace(" ", "▁")]
    backend.normalizer = normalizers.Sequence(steps)
    fallback = [decoders.ByteFallback()] if trainer.byte_fallback else []
    strip = [decoders.Strip(" ", 1, 0)] if spec.add_dummy_prefix else []
    backend.decoder = decoders.Sequence([decoders.Replace("▁", " "), *fallback, decoders.Fuse(), *strip])
    control = [p.piece for p in pieces if p.type in (2, 3)]  # UNKNOWN, CONTROL
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    bos = pieces[trainer.bos_id].piece if trainer.bos_id >= 0 else None
    eos = pieces[trainer.eos_id].piece if trainer.eos_id >= 0 else None
    backend.post_processor = _template(
        (bos, trainer.bos_id) if add_bos and bos else None, (eos, trainer.eos_id) if add_eos and eos else None
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token=bos, eos_token=eos, unk_token=pieces[trainer.unk_id].piece,
        model_max_length=model_max_length,
    )  # fmt: skip


def stage_tokenizer(config: Any) -> tuple[Any, str]:
    """The stage's tokenizer as a ``transformers.PreTrainedTokenizerFast``, and what it was made from.

    MaxText's ``tokenizer_type`` / ``tokenizer_path`` / ``add_bos`` say which: ``tiktoken``
    (:func:`_tiktoken`), ``sentencepiece`` (:func:`_sentencepiece`) or ``huggingface`` (a local directory or
    ``gs://`` one with ``tokenizer.json``; a Hub name would need the network and is refused).

    The tokenizer is for inference: it adds BOS when the stage did (``add_bos``) and never EOS. ``add_eos`` is a
    training setting (MaxText ends each packed document with it); an exported tokenizer that appended
    ``<|end_of_text|>`` to every prompt would make ``model.generate(**tokenizer(prompt))`` condition on an ended
    document. Meta's Llama 3 ``tokenizer.json`` does the same (its post-processor adds ``<|begin_of_text|>``
    only). ``model_max_length`` is the exported model's ``max_position_embeddings`` (:func:`max_positions`).

    Raises:
        Unsupported: another type, a Hugging Face tokenizer without ``tokenizer.json``.
    """
    kind, path, add_bos, _ = _tokenizer_spec(config)  # add_eos: a training setting, not the exported tokenizer's
    positions = max_positions(config)
    if kind == "tiktoken":
        return _tiktoken(path, add_bos, False, positions), f"tiktoken {path}"
    if kind == "sentencepiece":
        return _sentencepiece(path, add_bos, False, positions), f"sentencepiece {path}"
    if kind == "huggingface":
        from transformers import PreTrainedTokenizerFast

        source = verify.checkpoint_path(path)
        if not (source / "tokenizer.json").exists():
            raise Unsupported(f"tokenizer_path {path}: no tokenizer.json there (a Hub name is not fetched); "
                              "give a directory with the tokenizer's files")  # fmt: skip
        local = Path(tempfile.mkdtemp(prefix="tokenizer-"))
        for item in source.iterdir():
            if item.is_file():
                (local / item.name).write_bytes(item.read_bytes())
        # transformers 5 rebuilds the post-processor from add_bos_token / add_eos_token (as MaxText's hf pipeline
        # loads it, maxtext/input_pipeline/hf_data_processing.py); the saved tokenizer.json then has BOS only
        tokenizer = PreTrainedTokenizerFast.from_pretrained(
            str(local), add_bos_token=add_bos, add_eos_token=False, model_max_length=positions
        )
        return tokenizer, f"huggingface {path}"
    raise Unsupported(f"tokenizer_type {kind}: the exporter writes {', '.join(TOKENIZER_TYPES)}")


#: What :func:`stage_setup` made, by the stage's MaxText arguments (:func:`warm_up` makes it ahead).
_SETUP: dict[tuple[str, ...], tuple[Any, Any, str]] = {}


def stage_setup(maxtext_args: list[str]) -> tuple[Any, Any, str]:
    """``(config, tokenizer, tokenizer source)`` of the stage (:func:`stage_config`, :func:`check_model`,
    :func:`stage_tokenizer`), made once per process for the same MaxText arguments: :func:`warm_up` makes it while
    the stage trains, so the export finds it (on this machine about 5 s of MaxText's config and the tiktoken
    tokenizer's conversion).

    Raises:
        Unsupported: as :func:`check_model` and :func:`stage_tokenizer`.
    """
    key = tuple(maxtext_args)
    if key not in _SETUP:
        config = stage_config(maxtext_args)
        check_model(config)
        tokenizer, source = stage_tokenizer(config)
        _SETUP[key] = (config, tokenizer, source)
    return _SETUP[key]


def warm_up(maxtext_args: list[str]) -> None:
    """The export's work that needs no checkpoint, done ahead in a verifier started while the stage trains
    (:func:`multislice.trainer.verify_export.warm_up`): torch, safetensors and MaxText's conversion tables
    imported (and transformers' Llama config, which :func:`hf_config` builds), :func:`stage_setup` made,
    and both loaders started (:func:`start_loaders` takes them), so their imports of torch and transformers also
    run beside the training. A stage the export refuses is left to the export to report. The loaders are stopped
    at this process's exit if nothing took them."""
    import torch  # noqa: F401 (imported ahead: this function's whole point)
    from maxtext.checkpoint_conversion.utils import param_mapping  # noqa: F401 (imported ahead)
    from safetensors import torch as safetensors_torch  # noqa: F401 (imported ahead)
    from transformers import LlamaConfig  # noqa: F401 (imported ahead: hf_config builds one)

    try:
        stage_setup(maxtext_args)
    except Exception:  # noqa: BLE001 - the export itself makes it again and reports why it failed
        pass
    _AHEAD.update(start_loaders())
    atexit.register(_stop_ahead)


def check_model(config: Any) -> None:
    """Refuse a model that is not a Hugging Face Llama.

    Raises:
        Unsupported: the settings that differ (see :data:`SUPPORTED`).
    """
    problems = []
    block = getattr(config.decoder_block, "value", config.decoder_block)
    if str(block) != "llama2":
        problems.append(f"decoder_block {block}")
    if list(config.mlp_activations) != ["silu", "linear"]:
        problems.append(f"mlp_activations {list(config.mlp_activations)}")
    if config.logits_via_embedding:
        problems.append("logits_via_embedding true (tied embeddings)")
    rope = getattr(config, "rope_type", "default")
    if str(getattr(rope, "value", rope)) != "default":
        problems.append(f"rope_type {rope}")
    if str(config.model_name).startswith("llama3.1"):
        problems.append(f"model_name {config.model_name} (Llama 3.1's scaled, interleaved RoPE)")
    if getattr(config, "rope_min_timescale", 1) != 1:
        problems.append(f"rope_min_timescale {config.rope_min_timescale}")
    if problems:
        raise Unsupported(f"cannot export as a Hugging Face Llama: {', '.join(problems)}; supported: {SUPPORTED}")


def max_positions(config: Any) -> int:
    """``max_position_embeddings``: the model family's context, not the stage's training sequence length.

    Llama 3 (rope_theta 500000) 8192 and Llama 2 (10000) 4096, as Meta's ``config.json``
    (:data:`MAX_POSITIONS_BY_THETA`); the tiny presets are Llama 3's architecture with its RoPE, so 8192
    (what vLLM takes as ``max_model_len``; they were trained on shorter sequences). Another theta: the
    stage's ``max_target_length``.
    """
    return MAX_POSITIONS_BY_THETA.get(float(config.rope_max_timescale), int(config.max_target_length))


def parameter_count(config: Any) -> int:
    """Parameters of the Llama the MaxText config describes (embedding, layers, final norm, output head)."""
    emb = int(config.emb_dim)
    return 2 * int(config.vocab_size) * emb + int(config.num_decoder_layers) * layer_parameters(config) + emb


def default_dtype(config: Any) -> str:
    """``bfloat16`` for models of :data:`BF16_FROM_PARAMETERS` or more, else ``float32``."""
    return "bfloat16" if parameter_count(config) >= BF16_FROM_PARAMETERS else "float32"


def hf_config(config: Any, tokenizer: Any, dtype: str) -> dict[str, Any]:
    """``config.json`` of the stage's model, readable by transformers 4.x and 5.x (and converters that read it).

    transformers 5 reads ``rope_parameters``; 4.x reads the top-level ``rope_theta`` and ``rope_scaling`` (a
    config without them silently gets rope_theta 10000) and ``torch_dtype``; both are written.

    Raises:
        Unsupported: the model is not a Llama (:func:`check_model`).
    """
    import transformers

    check_model(config)
    vocab = int(config.vocab_size)
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    theta = float(config.rope_max_timescale)
    hf = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(config.emb_dim),
        intermediate_size=int(config.mlp_dim),
        num_hidden_layers=int(config.num_decoder_layers),
        num_attention_heads=int(config.num_query_heads),
        num_key_value_heads=int(config.num_kv_heads),
        head_dim=int(config.head_dim),
        max_position_embeddings=max_positions(config),
        rms_norm_eps=float(config.normalization_layer_epsilon),
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        bos_token_id=bos if bos is not None and bos < vocab else None,
        eos_token_id=eos if eos is not None and eos < vocab else None,
        architectures=["LlamaForCausalLM"],
    )
    out = hf.to_dict()
    out.update(
        rope_theta=theta, rope_scaling=None, rope_parameters={"rope_type": "default", "rope_theta": theta},
        torch_dtype=dtype, dtype=dtype, model_type="llama", architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    return out


# --- streaming conversion -------------------------------------------------------------------------------------


class CheckpointReader:
    """Reads slices of a checkpoint item's arrays straight from the TensorStore arrays Orbax wrote.

    Orbax's read spec (``tensorstore_utils.build_array_read_spec``, ``get_ts_context``) opens each array as
    ``PyTreeCheckpointer.restore`` would, but nothing is read until a slice is asked for.

    Raises:
        ValueError: the item has no usable tree metadata (``verify._tree``'s reason).
    """

    def __init__(self, items_dir: Any, scratch: Path | None = None) -> None:
        import orbax.checkpoint as ocp

        self.items_dir = items_dir
        self.scratch = scratch
        self._layers: dict[str, tuple[Path, Any, tuple[int, ...]]] = {}
        self.destacked_bytes = 0
        tree, why = verify._tree(items_dir)
        if tree is None:
            raise ValueError(why)
        self.leaves = {path: leaf for path, leaf in verify._leaves(tree).items() if path.startswith("params/params/")}
        metadata = ocp.PyTreeCheckpointer().metadata(items_dir).item_metadata
        self.use_zarr3 = bool(getattr(metadata, "_use_zarr3", False))
        self.use_ocdbt = bool(ocp.type_handlers.is_ocdbt_checkpoint(items_dir))
        self._open: dict[str, Any] = {}

    def array(self, path: str) -> Any:
        """The TensorStore of the parameter at ``path`` (``params/params/decoder/...``), opened once."""
        if path not in self._open:
            import tensorstore as ts
            from orbax.checkpoint._src.serialization import tensorstore_utils, types

            leaf = self.leaves[path]
            info = types.ParamInfo(name=leaf.name, parent_dir=self.items_dir, use_zarr3=self.use_zarr3)
            spec = tensorstore_utils.build_array_read_spec(info, use_ocdbt=self.use_ocdbt).json
            context = tensorstore_utils.get_ts_context(use_ocdbt=self.use_ocdbt)
            self._open[path] = ts.open(spec, context=context, open=True, read=True).result()
        return self._open[path]

    def layer(self, path: str, axis: int, index: int, consume: bool = False) -> Any:
        """Layer ``index`` of a stacked array (MaxText's scanned layers, stacked along ``axis``), as numpy, the layer
        axis removed.

        Without ``scratch``, :meth:`read` of that layer: the storage chunks of a stacked array span every layer
        (the layer axis is never sharded), so each layer's read decodes all of them, ``num_layers`` times over a
        conversion. With ``scratch`` (a local directory), the first read of the array splits it once, a storage
        chunk at a time, into one raw file per layer there (:attr:`destacked_bytes` in all), and each layer is then
        read from its file: the checkpoint is read and decoded once, for the price of the stacked arrays' bytes on
        local disk. ``consume``: the layer's file is deleted once read (the conversion reads each layer once, so the
        split arrays' disk shrinks as the export's grows). Memory: one storage chunk and one layer.
        """
        import numpy as np

        if self.scratch is None:
            return self.read(path, axis, index, index + 1).squeeze(axis)
        if path not in self._layers:
            self._destack(path, axis)
        directory, dtype, shape = self._layers[path]
        array = np.fromfile(directory / f"{index}.raw", dtype=dtype).reshape(shape)
        if consume:
            (directory / f"{index}.raw").unlink()
        return array

    def _destack(self, path: str, axis: int) -> None:
        """Split the stacked array at ``path`` into ``<scratch>/<n>/<layer>.raw`` (see :meth:`layer`)."""
        import numpy as np

        assert self.scratch is not None
        store = self.array(path)
        shape = tuple(store.shape)
        dtype = store.dtype.numpy_dtype
        layer_shape = shape[:axis] + shape[axis + 1 :]
        directory = self.scratch / str(len(self._layers))
        directory.mkdir(parents=True, exist_ok=True)
        for index in range(shape[axis]):
            np.memmap(directory / f"{index}.raw", dtype=dtype, mode="w+", shape=layer_shape).flush()
        chunk = tuple(store.chunk_layout.read_chunk.shape or shape)
        ranges = []
        for dim, (n, c) in enumerate(zip(shape, chunk, strict=True)):
            step = n if dim == axis else max(1, int(c))
            ranges.append([slice(a, min(a + step, n)) for a in range(0, n, step)])
        for cell in itertools.product(*ranges):
            block = store[cell].read().result()  # every layer of one storage chunk, decoded once
            region = cell[:axis] + cell[axis + 1 :]
            for index in range(shape[axis]):
                target = np.memmap(directory / f"{index}.raw", dtype=dtype, mode="r+", shape=layer_shape)
                target[region] = np.take(block, index, axis=axis)
                target.flush()
                del target
            del block
        self.destacked_bytes += int(np.prod(shape)) * np.dtype(dtype).itemsize
        self._layers[path] = (directory, dtype, layer_shape)

    def read(self, path: str, axis: int | None = None, start: int = 0, stop: int | None = None) -> Any:
        """``array[..., start:stop, ...]`` along ``axis`` (the whole array when ``axis`` is None), as numpy.

        Read one storage chunk at a time, so the decoded bytes held beside the result are one chunk's.
        """
        import numpy as np

        store = self.array(path)
        shape = tuple(store.shape)
        window = [slice(0, n) for n in shape]
        if axis is not None:
            window[axis] = slice(start, shape[axis] if stop is None else stop)
        chunk = tuple(store.chunk_layout.read_chunk.shape or shape)
        out = np.empty([w.stop - w.start for w in window], dtype=store.dtype.numpy_dtype)
        ranges = []
        for dim, (w, c) in enumerate(zip(window, chunk, strict=True)):
            step = shape[dim] if dim == axis else max(1, int(c))
            ranges.append([slice(a, min(a + step, w.stop)) for a in range(w.start, w.stop, step)])
        for cell in itertools.product(*ranges):
            target = tuple(slice(s.start - w.start, s.stop - w.start) for s, w in zip(cell, window, strict=True))
            out[target] = store[cell].read().result()
        return out


def layer_groups(param_map: dict[str, Any], layers: int, per_shard: int) -> list[list[tuple[str, int | None, str]]]:
    """The conversion's groups: ``[(maxtext key, layer index or None, hf name), ...]`` per safetensors shard.

    The embedding first, then ``per_shard`` decoder layers at a time, then the final norm and output head.
    A scanned key (MaxText's stacked layers) maps to one HF name per layer; an unscanned one to one name.
    """
    embed: list[tuple[str, int | None, str]] = []
    final: list[tuple[str, int | None, str]] = []
    by_layer: dict[int, list[tuple[str, int | None, str]]] = {i: [] for i in range(layers)}
    for key, target in param_map.items():
        names = target if isinstance(target, list) else [target]
        for index, name in enumerate(names):
            if not isinstance(name, str):
                raise Unsupported(f"{key}: a multi-axis stacked parameter (MoE), not a Llama")
            found = re.match(r"model\.layers\.(\d+)\.", name)
            entry = (key, index if isinstance(target, list) else None, name)
            if found:
                by_layer[int(found.group(1))].append(entry)
            elif "embed_tokens" in name:
                embed.append(entry)
            else:
                final.append(entry)
    groups = [embed] + [
        sum((by_layer[i] for i in range(start, min(start + per_shard, layers))), [])
        for start in range(0, layers, per_shard)
    ]
    return [g for g in groups + [final] if g]


def _to_torch(array: Any, dtype: str) -> Any:
    """A float32 numpy array as a contiguous torch tensor of ``dtype`` (bfloat16 rounds to nearest even)."""
    import torch

    return torch.from_numpy(array.astype("float32", copy=False)).to(getattr(torch, dtype)).contiguous()


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes, or None where there is none."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def rss_bytes() -> int:
    """This process's resident set size now (``VmRSS``), in bytes (the peak where ``/proc`` has no status)."""
    return _status_bytes("VmRSS") or rss_peak_bytes()


def reset_rss_peak() -> bool:
    """Start a new phase's peak: write ``5`` to ``/proc/self/clear_refs``, which resets ``VmHWM`` to the current RSS
    (Linux 4.0 and later, ``Documentation/admin-guide/mm/soft-dirty.rst`` / ``proc(5)``). A process that ran a
    warm-up (a verifier started ahead) would otherwise report the warm-up's peak as each phase's.

    Returns:
        Whether the kernel took it (False: the phases' peaks are the process's lifetime peak so far).
    """
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def rss_peak_bytes() -> int:
    """This process's peak resident set size since the last :func:`reset_rss_peak` (``VmHWM``), in bytes; where
    ``/proc`` has no status, the lifetime peak (``getrusage``'s ``ru_maxrss``, KiB on Linux)."""
    return _status_bytes("VmHWM") or int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def convert_streaming(
    reader: CheckpointReader,
    config: Any,
    hf: dict[str, Any],
    dtype: str,
    out_dir: Path,
    per_shard: int,
    reference: MaxTextReference | None = None,
) -> dict[str, Any]:
    """Convert the checkpoint group by group (:func:`layer_groups`) into safetensors shards in ``out_dir``.

    Each group's slices are read (:meth:`CheckpointReader.read`), mapped with MaxText's tables
    (``process_maxtext_param`` with the group's one HF name per key), cast to ``dtype``, written as
    ``model-0000K-of-0000N.safetensors`` and freed before the next group; ``model.safetensors.index.json`` maps
    each tensor to its shard. With ``reference``, the same slices, as read, are handed to MaxText's side of the
    check before they are freed (:func:`feed`): the checkpoint is read once for both.

    Returns:
        ``{"parameter_count", "shards", "total_bytes", "largest_group_bytes"}`` (bytes as written).

    Raises:
        ValueError: a parameter is missing from the checkpoint or has no mapping.
    """
    import gc

    from maxtext.checkpoint_conversion.utils.hf_shape import HF_SHAPE
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.utils import process_maxtext_param
    from safetensors.torch import save_file

    scan = bool(config.scan_layers)
    param_map = PARAM_MAPPING[MAPPING_MODEL](hf, config, scan)
    hooks = HOOK_FNS[MAPPING_MODEL](hf, config, scan, saving_to_hf=True)
    # The tables' ``adjust_rope`` hook turns the interleaved RoPE layout of MaxText's Llama 3.1 rotary embedding
    # (``LLaMARotaryEmbedding``) into HF's halves. A stage with ``rope_type: default`` (not a ``llama3.1*``
    # model_name) uses ``RotaryEmbedding`` (``maxtext/layers/embeddings.py``), which already rotates halves as HF
    # does (``_rotate_half``): the permutation would scramble it (the logits check caught it: |diff| 1.5).
    hooks = {key: _without_rope_permutation(fns) for key, fns in hooks.items()}
    shapes = HF_SHAPE[MAPPING_MODEL](hf)
    paths = {"params-" + "-".join(path.split("/")[2:]): path for path in reader.leaves}
    missing = sorted(set(param_map) - set(paths))
    unmapped = sorted(set(paths) - set(param_map))
    if missing or unmapped:
        raise ValueError(f"checkpoint parameters and MaxText's {MAPPING_MODEL} mapping differ: "
                         f"missing {missing[:5]}, unmapped {unmapped[:5]}")  # fmt: skip
    groups = layer_groups(param_map, int(config.num_decoder_layers), per_shard)
    weight_map: dict[str, str] = {}
    total = count = largest = 0
    for number, group in enumerate(groups, start=1):
        name = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        read: list[tuple[str, int | None, Any]] = []
        for key, layer, hf_name in group:
            path = paths[key]
            if layer is None:
                weight = reader.read(path)
            else:
                ndim = len(reader.leaves[path].shape)
                axis = int(config.param_scan_axis) if ndim > int(config.param_scan_axis) else 0
                weight = reader.layer(path, axis, layer, consume=True)
            # float32 before MaxText's hooks: scale_query_layer casts its product back to the input's dtype
            weight = weight.astype("float32", copy=False)
            for out_name, value in process_maxtext_param(key, weight, {key: hf_name}, hooks, shapes, config):
                tensors[out_name] = _to_torch(value, dtype)
            if reference is not None:
                read.append((path, layer, weight))
            del weight
        size = sum(t.numel() * t.element_size() for t in tensors.values())
        save_file(tensors, str(out_dir / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        count += sum(t.numel() for t in tensors.values())
        del tensors
        if reference is not None:
            feed(reference, read)
        del read
        total += size
        largest = max(largest, size)
        gc.collect()
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return {"parameter_count": count, "shards": len(groups), "total_bytes": total, "largest_group_bytes": largest}


def feed(reference: MaxTextReference, read: list[tuple[str, int | None, Any]]) -> None:
    """Hand one conversion group's arrays (``(checkpoint path, stacked layer index or None, array)`` as read) to
    MaxText's side of the check: the embedding, each decoder layer in order, or the final norm and output head."""
    layers: dict[int, dict[str, tuple[str, Any]]] = {}
    final: dict[str, tuple[str, Any]] = {}
    for path, stacked, array in read:
        found = layer_key(path)
        index = found[0] if found is not None and found[0] is not None else stacked
        if found is not None and index is not None:
            layers.setdefault(index, {})[found[1]] = (path, array)
        elif path.endswith("token_embedder/embedding"):
            reference.embedding_rows(path, array, 0)
        else:
            final[path.rsplit("/", 2)[-2]] = (path, array)
    for index in sorted(layers):
        reference.layer(layers[index])
    if final:
        reference.head(final["decoder_norm"], final["logits_dense"])


def _without_rope_permutation(fns: Any) -> Any:
    """A hook chain without MaxText's ``adjust_rope`` (see :func:`convert_streaming`)."""
    if isinstance(fns, list):
        return [fn for fn in fns if getattr(fn, "__name__", "") != "adjust_rope"]
    return fns


# --- metadata files -------------------------------------------------------------------------------------------


def write_metadata(out_dir: Path, hf: dict[str, Any], tokenizer: Any, card: dict[str, Any]) -> None:
    """``config.json``, ``generation_config.json``, the tokenizer files and the model card (``README.md``).

    ``tokenizer_config.json`` names ``PreTrainedTokenizerFast`` (transformers 5 writes ``TokenizersBackend``,
    which 4.x cannot import).
    """
    (out_dir / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    generation = {"_from_model_config": True, "bos_token_id": hf.get("bos_token_id"),
                  "eos_token_id": hf.get("eos_token_id")}  # fmt: skip
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n", encoding="utf-8")
    tokenizer.save_pretrained(str(out_dir))
    settings_file = out_dir / "tokenizer_config.json"
    settings = json.loads(settings_file.read_text(encoding="utf-8"))
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings.pop("backend", None)
    settings_file.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")
    (out_dir / "README.md").write_text(model_card(hf, card), encoding="utf-8")


def model_card(hf: dict[str, Any], card: dict[str, Any]) -> str:
    """The model card (``README.md``): what was trained, on what, for how long, and its final losses."""

    def value(key: str) -> str:
        return "not recorded" if card.get(key) is None else str(card[key])

    return "\n".join([
        "---", "library_name: transformers", "pipeline_tag: text-generation", "tags: [llama, maxtext, multislice]",
        "---", "", f"# {card.get('run') or 'multislice export'}", "",
        "A Llama model trained with MaxText by multislice-pipelines and exported in Hugging Face format; its "
        "logits were checked against MaxText's with transformers 4.57 and 5.",
        "", "| | |", "|---|---|",
        f"| run | {value('run')} |", f"| stage | {value('stage')} |",
        f"| data fingerprint | {value('data_fingerprint')} |", f"| training steps | {value('steps')} |",
        f"| final train loss | {value('train_loss')} |", f"| final eval loss | {value('eval_loss')} |",
        f"| source checkpoint | {value('checkpoint')} |", f"| tokenizer | {value('tokenizer')} |",
        f"| layers, hidden size, vocab | {hf['num_hidden_layers']}, {hf['hidden_size']}, {hf['vocab_size']} |",
        f"| weights dtype | {hf['torch_dtype']} |", "",
    ])  # fmt: skip


# --- the check -------------------------------------------------------------------------------------------------


def check_ids(tokenizer: Any, vocab: int, tokens: int) -> list[int]:
    """The tokenizer's real ids of :data:`TEXT` (with BOS as the tokenizer adds it), at most ``tokens``.

    Raises:
        Unsupported: an id at or above the model's vocab (the tokenizer has more tokens than the model).
    """
    ids = tokenizer(TEXT, add_special_tokens=True)["input_ids"][:tokens]
    if len(tokenizer) > vocab or max(ids) >= vocab:
        raise Unsupported(f"the tokenizer has {len(tokenizer)} tokens (ids up to {max(ids)} here) but the model's "
                          f"vocab_size is {vocab}: its ids would index past the embedding; export the model's own "
                          "tokenizer")  # fmt: skip
    return ids


def sample_positions(count: int, fraction: float, seed: int = 0) -> list[int]:
    """A seeded random ``fraction`` of ``range(count)`` (at least one position, sorted); all when 1."""
    import numpy as np

    if fraction >= 1:
        return list(range(count))
    chosen = np.random.default_rng(seed).choice(count, size=max(1, math.ceil(fraction * count)), replace=False)
    return sorted(int(i) for i in chosen)


def reference_params(reader: CheckpointReader, dtype: str, head_dim: int) -> dict[str, Any]:
    """The whole checkpoint's parameters as the export holds them (path -> float32 ``jax.Array``,
    :func:`as_exported`), for :func:`maxtext_logits`' whole-model forward: a test's reference for
    :func:`maxtext_layerwise`, which the check uses (this holds the model once in float32)."""
    import jax.numpy as jnp

    out = {}
    for path in reader.leaves:
        array = reader.read(path)
        out[path] = jnp.asarray(as_exported(path, array, dtype, head_dim), jnp.float32)
        del array
    return out


def maxtext_logits(config: Any, flat: dict[str, Any], tokens: list[int]) -> Any:
    """MaxText's logits (numpy, ``[len(tokens), vocab]``) of its own model with the checkpoint's parameters.

    The forward pass is one ``jax.jit`` program (one XLA compile): on this machine 0.9 s to compile and 0.02 s
    to run for the tiny 70B recipe, where Flax's op-by-op dispatch of the same ``model.apply`` took 9.7 s
    (benchmarks/README.md); the logits were bit-identical.
    """
    import jax
    import jax.numpy as jnp
    import numpy as np
    from maxtext.utils import model_creation_utils

    params: dict[str, Any] = {}
    for path, values in flat.items():
        node = params
        *parents, leaf = path.split("/")[1:]
        for parent in parents:
            node = node.setdefault(parent, {})
        node[leaf] = jnp.asarray(values, jnp.float32)
    model = model_creation_utils.from_config(config)

    def forward(params: Any, inputs: Any) -> Any:
        positions = jnp.arange(inputs.shape[1], dtype=jnp.int32)[None, :]
        key = jax.random.PRNGKey(0)
        return model.apply(
            params, inputs, positions, decoder_segment_ids=jnp.ones_like(inputs), enable_dropout=False,
            rngs={"aqt": key, "params": key},
        )  # fmt: skip

    logits = jax.jit(forward)(params, jnp.asarray([tokens], jnp.int32))
    return np.asarray(logits[0], np.float32)


#: Bytes of float32 of the output head that MaxText's side rounds to the export's dtype at a time (beside the head
#: the conversion holds).
HEAD_BLOCK_BYTES = 256 * 2**20


def as_exported(path: str, array: Any, dtype: str, head_dim: int) -> Any:
    """A checkpoint array (float32 numpy) as the export's loaders see it: rounded to ``dtype`` and back.

    In ``bfloat16`` the query kernel is rounded after the export's scale by sqrt(head_dim) (MaxText's
    ``scale_query_layer``) and scaled back; in ``float32`` nothing changes.
    """
    import numpy as np

    if dtype == "float32":
        return np.asarray(array, np.float32)
    import torch

    def rounded(values: Any) -> Any:
        return torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16).float().numpy()

    if path.endswith("self_attention/query/kernel"):
        scale = np.float32(np.sqrt(head_dim))
        return rounded(np.asarray(array, np.float32) * scale) * np.float32(1 / np.sqrt(head_dim))
    return rounded(array)


def _nest(flat: dict[str, Any]) -> dict[str, Any]:
    """``{"a/b/c": x}`` as ``{"a": {"b": {"c": x}}}``."""
    tree: dict[str, Any] = {}
    for key, value in flat.items():
        node = tree
        *parents, name = key.split("/")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[name] = value
    return tree


def layer_key(path: str) -> tuple[int | None, str] | None:
    """``(layer index or None for stacked layers, key inside the layer)`` of a decoder layer's checkpoint path
    (``params/params/decoder/layers/mlp/wi_0/kernel``, ``.../decoder/layers_3/mlp/wi_0/kernel``); None for the
    embedding, the final norm and the output head."""
    found = re.search(r"/decoder/layers(?:_(\d+))?/(.+)$", path)
    if not found:
        return None
    return (int(found.group(1)) if found.group(1) is not None else None), found.group(2)


class MaxTextReference:
    """MaxText's side of the logits check, computed one layer at a time as the conversion reads the checkpoint.

    The conversion (:func:`convert_streaming`) hands it each group's arrays as it reads them (float32 numpy, the
    layer's slice of a stacked array): the embedding (:meth:`embedding`: the rows of ``ids``), each decoder layer
    (:meth:`layer`: applied with MaxText's own ``LlamaDecoderLayer``, ``maxtext/models/llama2.py``, in its Linen form
    ``LlamaDecoderLayerToLinen``; one ``jax.jit`` program serves every layer, the shapes being the same), then the
    final norm and output head (:meth:`head`: MaxText's RMSNorm, ``x * rsqrt(mean(x^2) + eps) * scale``,
    ``maxtext/layers/normalizations.py``, and ``decoder/logits_dense/kernel`` ``[emb, vocab]``). Every array is taken
    as exported (:func:`as_exported`). So the checkpoint is read once for both the conversion and the check, and the
    check's memory is one group's, not the model's. Its logits equal :func:`maxtext_logits`' whole-model forward to
    float32 rounding (``tests/trainer/test_export.py``).

    Attributes:
        states: Hidden states ``[len(ids), emb]`` (float32 numpy) after the embedding and after each layer.
        logits: ``[len(positions), vocab]`` once :meth:`head` ran, else None.
    """

    def __init__(self, config: Any, dtype: str, ids: list[int], positions: list[int]) -> None:
        import jax
        import jax.numpy as jnp
        from maxtext.common.common_types import MODEL_MODE_TRAIN
        from maxtext.models.llama2 import LlamaDecoderLayerToLinen
        from maxtext.utils import maxtext_utils

        self.config, self.dtype, self.ids, self.positions = config, dtype, list(ids), list(positions)
        self.head_dim = int(config.head_dim)
        self.states: list[Any] = []
        self.logits: Any = None
        self._hidden: Any = None
        mesh = maxtext_utils.get_mesh_from_config(config)
        # nnx_wrappers.to_linen_class's class: the checker sees its factory's signature, not the Linen module's
        layer = LlamaDecoderLayerToLinen(config=config, model_mode=MODEL_MODE_TRAIN, mesh=mesh, quant=None)  # pyright: ignore[reportCallIssue]
        segments = jnp.ones((1, len(ids)), jnp.int32)
        token_positions = jnp.arange(len(ids), dtype=jnp.int32)[None]

        def apply(params: Any, hidden: Any) -> Any:
            out = layer.apply({"params": params}, hidden, segments, token_positions, True, MODEL_MODE_TRAIN)
            return out[0] if isinstance(out, tuple) else out

        self._apply = jax.jit(apply)

    def embedding_rows(self, path: str, block: Any, start: int) -> None:
        """Take rows ``start : start + len(block)`` of the embedding table: those of ``ids`` among them."""
        import numpy as np

        if self._hidden is None:
            self._hidden = np.zeros((len(self.ids), block.shape[1]), np.float32)
        wanted = np.asarray(self.ids)
        chosen = (wanted >= start) & (wanted < start + block.shape[0])
        if chosen.any():
            self._hidden[chosen] = as_exported(path, block[wanted[chosen] - start], self.dtype, self.head_dim)

    def layer(self, arrays: dict[str, Any]) -> None:
        """Apply the next decoder layer: ``arrays`` maps each key inside the layer (``mlp/wi_0/kernel``) to
        ``(checkpoint path, float32 numpy array)``."""
        import jax.numpy as jnp
        import numpy as np

        if not self.states:
            self.states.append(np.asarray(self._hidden, np.float32).copy())
            self._hidden = jnp.asarray(self._hidden)[None]
        params = _nest({
            key: jnp.asarray(as_exported(path, array, self.dtype, self.head_dim), jnp.float32)
            for key, (path, array) in arrays.items()
        })  # fmt: skip
        self._hidden = self._apply(params, self._hidden)
        self.states.append(np.asarray(self._hidden[0], np.float32))

    def head(self, norm: tuple[str, Any], kernel: tuple[str, Any]) -> None:
        """The final RMSNorm (``(path, scale)``) and the output head (``(path, kernel [emb, vocab])``): sets
        :attr:`logits`."""
        import numpy as np

        x = np.asarray(self._hidden[0], np.float32)[self.positions]
        scale = as_exported(norm[0], norm[1], self.dtype, self.head_dim)
        eps = np.float32(self.config.normalization_layer_epsilon)
        normed = x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * scale
        path, weights = kernel
        vocab = weights.shape[1]
        step = max(1, HEAD_BLOCK_BYTES // (4 * weights.shape[0]))  # columns rounded at a time: bounded memory
        self.logits = np.empty((len(self.positions), vocab), np.float32)
        for start in range(0, vocab, step):
            block = as_exported(path, weights[:, start : start + step], self.dtype, self.head_dim)
            self.logits[:, start : start + step] = normed @ block


def maxtext_layerwise(
    config: Any, reader: CheckpointReader, dtype: str, ids: list[int], positions: list[int]
) -> MaxTextReference:
    """:class:`MaxTextReference` fed straight from the checkpoint, one array at a time, without a conversion (a
    test's and a tool's reference)."""
    reference = MaxTextReference(config, dtype, ids, positions)
    prefix = "params/params/"
    embedding = prefix + "token_embedder/embedding"
    reference.embedding_rows(embedding, reader.read(embedding), 0)
    scan_axis = int(config.param_scan_axis)
    for index in range(int(config.num_decoder_layers)):
        arrays = {}
        for path, leaf in reader.leaves.items():
            found = layer_key(path)
            if found is None or found[0] not in (None, index):
                continue
            if found[0] is None:
                axis = scan_axis if len(leaf.shape) > scan_axis else 0
                arrays[found[1]] = (path, reader.read(path, axis, index, index + 1).squeeze(axis))
            else:
                arrays[found[1]] = (path, reader.read(path))
        reference.layer(arrays)
    head = prefix + "decoder/logits_dense/kernel"
    norm = prefix + "decoder/decoder_norm/scale"
    reference.head((norm, reader.read(norm)), (head, reader.read(head)))
    return reference


def hf_logits(export_dir: str, tokens: list[int]) -> Any:
    """``transformers.LlamaForCausalLM``'s logits (numpy, float32, CPU) of the export on ``tokens``, in this process."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], dtype=torch.long))
    return out.logits[0].float().numpy()


def loader4_python() -> Path:
    """The pinned transformers 4.57 environment's interpreter (:data:`LOADER4_ENV`, else beside this one)."""
    if os.environ.get(LOADER4_ENV):
        return Path(os.environ[LOADER4_ENV])
    return Path(sys.prefix).parent / "loader-hf4" / "bin" / "python"


#: The loaders of the check: name and interpreter (None: this one, the trainer environment's transformers 5).
LOADER_NAMES = ("transformers5", "transformers4")


class Loader:
    """One loader process (:mod:`multislice.trainer.hf_loader` with ``-``), started before the export exists.

    Started, it imports torch and transformers (seconds of a fresh interpreter) and waits for its request on
    stdin, so those imports overlap whatever the exporter's process does meanwhile (the verification, the
    conversion); :meth:`hand` gives it the export, :meth:`result` waits for its report, :meth:`stop` ends it
    unused (the export was not made, or failed). Its stdout and stderr go to files in a scratch directory of its
    own, so a chatty import never blocks on a full pipe.

    Args:
        python: the loader's interpreter (:func:`loader4_python` for 4.57, ``sys.executable`` for 5).

    A missing interpreter is not raised: :meth:`result` returns ``{"error"}`` (the check fails with that detail).
    """

    def __init__(self, python: Path):
        self.python = python
        self.process: subprocess.Popen | None = None
        self.error = None
        if not python.exists():
            self.error = f"no loader interpreter at {python}: run make env (or set {LOADER4_ENV})"
        self.scratch = Path(tempfile.mkdtemp(prefix="hf-loader-"))
        if self.error is None:
            # USE_TF/USE_FLAX off: transformers 4.57 would otherwise find the trainer environment's JAX and Flax
            # and import JAX (a second) for its image utilities; the loader runs torch's Llama only.
            env = {**os.environ, "PYTHONNOUSERSITE": "1", "USE_TF": "0", "USE_FLAX": "0"}
            with open(self.scratch / "stdout", "w") as out, open(self.scratch / "stderr", "w") as err:
                self.process = subprocess.Popen([str(python), "-m", "multislice.trainer.hf_loader", "-"],
                                                stdin=subprocess.PIPE, stdout=out, stderr=err, env=env)  # fmt: skip

    def hand(self, export_dir: str, ids: list[int], positions: list[int]) -> None:
        """Give it the export to load and the token ids and positions whose logits it computes (it starts at once)."""
        if self.process is None or self.process.stdin is None:
            return
        out = str(self.scratch / "logits.npy")
        request = {"export_dir": export_dir, "ids": ids, "positions": positions, "out": out}
        try:
            self.process.stdin.write(json.dumps(request).encode())
            self.process.stdin.close()
        except BrokenPipeError:  # it died while importing: result() reports its exit and stderr
            pass

    def result(self) -> dict[str, Any]:
        """Wait for it; its report (``transformers_version``, ``rope_theta``, ``logits_file``, ...) or ``{"error"}``."""
        if self.process is None:
            return {"error": self.error}
        code = self.process.wait()
        stdout = (self.scratch / "stdout").read_text(errors="replace")
        lines = [line for line in stdout.splitlines() if line.startswith("{")]
        if code != 0 or not lines:
            stderr = (self.scratch / "stderr").read_text(errors="replace")
            return {"error": f"{self.python} exited {code}: {stderr[-1500:]}"}
        return json.loads(lines[-1])

    def stop(self) -> None:
        """End it if it still runs (unused, or no longer needed) and remove its scratch directory (not the logits
        file's copy the caller already read)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        shutil.rmtree(self.scratch, ignore_errors=True)


#: Loaders started by :func:`warm_up` (a verifier started ahead), taken by the next :func:`start_loaders`.
_AHEAD: dict[str, Loader] = {}


def start_loaders() -> dict[str, Loader]:
    """Both loaders of the check (:data:`LOADER_NAMES`), started now: transformers 5 with this interpreter, 4.57
    with :func:`loader4_python`. The caller stops them (:meth:`Loader.stop`) when done or when it gives up.

    Where :func:`warm_up` started them ahead and both still wait, those are returned (once) instead."""
    ahead = dict(_AHEAD)
    _AHEAD.clear()
    if ahead and all(loader.process is None or loader.process.poll() is None for loader in ahead.values()):
        return ahead
    for loader in ahead.values():  # one died while waiting: start both afresh
        loader.stop()
    return {"transformers5": Loader(Path(sys.executable)), "transformers4": Loader(loader4_python())}


def _stop_ahead() -> None:
    """Stop the loaders :func:`warm_up` started that nothing took (the tool was not used)."""
    for loader in _AHEAD.values():
        loader.stop()
    _AHEAD.clear()


def run_loader(python: Path, export_dir: str, ids: list[int], positions: list[int], scratch: Path) -> dict[str, Any]:
    """Logits of the export as ``python``'s transformers loads it (:mod:`multislice.trainer.hf_loader`), alone.

    Returns:
        The loader's report (``transformers_version``, ``rope_theta``, ``logits_file`` in ``scratch``, ...) or
        ``{"error"}``.
    """
    loader = Loader(python)
    try:
        loader.hand(export_dir, ids, positions)
        found = loader.result()
        if "logits_file" in found:
            kept = scratch / f"logits-{abs(hash(str(python)))}.npy"
            shutil.move(found["logits_file"], kept)
            found["logits_file"] = str(kept)
        return found
    finally:
        loader.stop()


def available_memory_bytes() -> int | None:
    """Memory this process may still use, bytes: ``MemAvailable`` (/proc/meminfo), lowered to the cgroup's
    ``memory.max`` minus ``memory.current`` (cgroup v2: a pod's limit) when there is one; None when unknown."""
    found: list[int] = []
    try:
        with open("/proc/meminfo", encoding="ascii") as handle:
            found += [int(line.split()[1]) * 1024 for line in handle if line.startswith("MemAvailable:")]
    except OSError:
        pass
    try:
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        if limit != "max":
            found.append(int(limit) - int(Path("/sys/fs/cgroup/memory.current").read_text()))
    except (OSError, ValueError):
        pass
    return min(found) if found else None


def layer_parameters(config: Any) -> int:
    """Parameters of one decoder layer of the stage's Llama (attention, SwiGLU MLP, two norms)."""
    emb, heads, kv, head_dim = (
        int(config.emb_dim),
        int(config.num_query_heads),
        int(config.num_kv_heads),
        int(config.head_dim),
    )
    return emb * head_dim * (2 * heads + 2 * kv) + 3 * emb * int(config.mlp_dim) + 2 * emb


#: A loader's bytes per parameter of the layer it holds: the layer's tensors read in float32 and the
#: ``LlamaDecoderLayer`` they are loaded into (:func:`multislice.trainer.hf_loader.layerwise_logits`).
LOADER_BYTES_PER_LAYER_PARAMETER = 8
#: A loader's memory beyond its layer: the interpreter, torch and transformers, and one block of the embedding or
#: the output head (``hf_loader.BLOCK_BYTES``, 256 MiB, and the block's float32 copy).
LOADER_BASELINE_BYTES = 2**30 + 2 * 256 * 2**20


def loader_bytes(layer_params: int) -> int:
    """Peak memory of one loader process, bytes: one decoder layer (:data:`LOADER_BYTES_PER_LAYER_PARAMETER`) and
    :data:`LOADER_BASELINE_BYTES`; flat in the model's depth."""
    return LOADER_BYTES_PER_LAYER_PARAMETER * layer_params + LOADER_BASELINE_BYTES


def concurrent_check(layer_params: int) -> bool:
    """Whether both loaders may run at once: when their memory (:func:`loader_bytes` each) takes at most half the
    available memory (:func:`available_memory_bytes`); else one after the other, as the GKE export Job's memory
    request assumes (``multislice.exporting.sizing``)."""
    available = available_memory_bytes()
    return available is not None and len(LOADER_NAMES) * loader_bytes(layer_params) <= available // 2


def compare_logits(reference: Any, other: Any, atol: float = ATOL, rtol: float = RTOL) -> dict[str, Any]:
    """The logits check: ``|other - reference| <= atol + rtol * |reference|`` everywhere, and equal argmax.

    Returns:
        ``{"passed", "max_abs_diff", "max_abs_logit", "argmax_agree", "atol", "rtol", "detail"}``.
    """
    import numpy as np

    if reference.shape != other.shape:
        return {"passed": False, "detail": f"logits shapes differ: MaxText {reference.shape}, HF {other.shape}",
                "atol": atol, "rtol": rtol}  # fmt: skip
    diff = np.abs(other - reference)
    within = bool(np.all(diff <= atol + rtol * np.abs(reference)))
    argmax = float(np.mean(np.argmax(other, -1) == np.argmax(reference, -1)))
    passed = within and argmax == 1.0
    detail = (
        f"{reference.shape[0]} tokens x {reference.shape[1]} logits: max |HF - MaxText| {float(diff.max()):.3g} "
        f"(logits up to {float(np.abs(reference).max()):.3g}; tolerance {atol:g} + {rtol:g} x |logit|), "
        f"argmax agrees at {argmax:.0%} of positions"
    )
    return {
        "passed": passed,
        "max_abs_diff": float(diff.max()),
        "max_abs_logit": float(np.abs(reference).max()),
        "argmax_agree": argmax,
        "atol": atol,
        "rtol": rtol,
        "detail": detail,
    }


def compare_hidden(reference: list[Any], other: Any, atol: float = ATOL, rtol: float = RTOL) -> dict[str, Any]:
    """Hidden states after the embedding and after each layer, MaxText's (``reference``) against a loader's
    (``other``, ``[layers + 1, tokens, emb]``): per layer ``max |other - reference|`` and ``max |reference|``, and
    the first layer whose difference exceeds ``atol + rtol * max |reference|`` (None when none does; layer 0 is
    the embedding). It locates a wrong conversion; the verdict is the logits' (:func:`compare_logits`).

    Returns:
        ``{"layers", "max_abs_diff" (per layer), "max_abs_hidden" (per layer), "first_divergent_layer"}``.
    """
    import numpy as np

    if len(reference) != len(other):
        return {"layers": len(other) - 1, "first_divergent_layer": 0,
                "detail": f"{len(other) - 1} layers in the export, {len(reference) - 1} in the checkpoint"}  # fmt: skip
    diffs = [float(np.abs(o - r).max()) for r, o in zip(reference, other, strict=True)]
    sizes = [float(np.abs(r).max()) for r in reference]
    first = next((i for i, (d, m) in enumerate(zip(diffs, sizes, strict=True)) if d > atol + rtol * m), None)
    return {"layers": len(reference) - 1, "max_abs_diff": diffs, "max_abs_hidden": sizes,
            "first_divergent_layer": first}  # fmt: skip


def check_export(
    reference: MaxTextReference,
    export_dir: Path,
    options: Any,
    loaders: dict[str, Loader],
    concurrent: bool = False,
) -> dict[str, Any]:
    """MaxText's logits and hidden states (``reference``, computed during the conversion) against each loader's
    (``loaders``: :func:`start_loaders`, transformers 5 and 4.57, each computing layer by layer from the export).

    ``concurrent`` (:func:`concurrent_check`): both loaders are handed the export at once; else one after the other.
    A loader passes when its logits match (:func:`compare_logits`) and the export has exactly the tensors
    ``LlamaForCausalLM`` expects (its ``structure``); its hidden states are compared per layer
    (:func:`compare_hidden`) to say where a failure starts.

    Returns:
        ``{"passed", "positions", "sample_fraction", "loaders": {name: compare_logits(...) + version + hidden}}``
        plus the transformers 5 comparison's fields at the top (what the run summary and lineage read).
    """
    import numpy as np

    ids, positions = reference.ids, reference.positions
    if concurrent:
        for loader in loaders.values():
            loader.hand(str(export_dir), ids, positions)
    compared_by_name = {}
    for name in LOADER_NAMES:
        loader = loaders[name]
        if not concurrent:
            loader.hand(str(export_dir), ids, positions)
        loaded = loader.result()
        if "error" in loaded:
            compared_by_name[name] = {"passed": False, "detail": loaded["error"], "atol": options.atol,
                                      "rtol": options.rtol}  # fmt: skip
            continue
        compared = compare_logits(reference.logits, np.load(loaded.pop("logits_file")), options.atol, options.rtol)
        hidden = compare_hidden(reference.states, np.load(loaded.pop("hidden_file")), options.atol, options.rtol)
        structure = loaded.get("structure") or {}
        clean = not any(structure.values())
        if not clean:
            compared["detail"] += f"; the export's tensors differ from LlamaForCausalLM's: {structure}"
        compared_by_name[name] = {**compared, "passed": compared["passed"] and clean, **loaded, "hidden": hidden}
    first = compared_by_name["transformers5"]
    return {
        **first,
        "passed": all(c["passed"] for c in compared_by_name.values()),
        "positions": len(positions),
        "tokens": len(ids),
        "sample_fraction": options.sample_fraction,
        "concurrent": concurrent,
        "layerwise": True,
        "loaders": compared_by_name,
    }


# --- formats: what is written and how it is checked -----------------------------------------------------------


class ExportFormat:
    """One export format: how a checkpoint, read once (:class:`CheckpointReader`) with MaxText's side of the check
    fed as it is read (:class:`MaxTextReference`), is written and checked.

    What every format shares stays in :func:`export`: the stage's config and tokenizer (:func:`stage_setup`), the
    reading, MaxText's reference, the per-phase memory figures, the copy to ``gs://``, the report. A second format
    is one module with one subclass, registered in :data:`FORMATS` under the name ``stages[].export`` takes
    (``multislice.config.models.Stage.export``) and the exporter's ``--format`` option.

    Attributes:
        name: The format's name (``stages[].export``, the report's ``format``).
        architecture: What the export is, for the report (``LlamaForCausalLM``).
    """

    name = ""
    architecture = ""

    def convert(
        self, reader: CheckpointReader, config: Any, tokenizer: Any, dtype: str, out_dir: Path, options: Any,
        reference: MaxTextReference,
    ) -> dict[str, Any]:  # fmt: skip
        """Write the weights into ``out_dir``, feeding ``reference`` as they are read.

        Returns:
            ``{"parameter_count", "shards", "largest_group_bytes", "metadata"}``: ``metadata`` is what
            :meth:`write_metadata` writes, with ``max_position_embeddings``.
        """
        raise NotImplementedError

    def write_metadata(self, out_dir: Path, metadata: dict[str, Any], tokenizer: Any, card: dict[str, Any]) -> None:
        """Write the format's metadata, tokenizer and model card into ``out_dir``."""
        raise NotImplementedError

    def check(
        self, reference: MaxTextReference, config: Any, out_dir: Path, options: Any, loaders: dict[str, Any]
    ) -> dict[str, Any]:
        """The export against MaxText's ``reference``: a dict with ``passed`` and the details the report keeps."""
        raise NotImplementedError


class HuggingFaceLlama(ExportFormat):
    """Hugging Face's Llama: safetensors shards with MaxText's conversion tables (:func:`convert_streaming`),
    ``config.json`` and the tokenizer (:func:`write_metadata`), checked by transformers 5 and 4.57 layer by layer
    (:func:`check_export`)."""

    name = "huggingface"
    architecture = "LlamaForCausalLM"

    def convert(
        self, reader: CheckpointReader, config: Any, tokenizer: Any, dtype: str, out_dir: Path, options: Any,
        reference: MaxTextReference,
    ) -> dict[str, Any]:  # fmt: skip
        hf = hf_config(config, tokenizer, dtype)
        written = convert_streaming(reader, config, hf, dtype, out_dir, options.layers_per_shard, reference)
        return {**written, "metadata": hf}

    def write_metadata(self, out_dir: Path, metadata: dict[str, Any], tokenizer: Any, card: dict[str, Any]) -> None:
        write_metadata(out_dir, metadata, tokenizer, card)

    def check(
        self, reference: MaxTextReference, config: Any, out_dir: Path, options: Any, loaders: dict[str, Any]
    ) -> dict[str, Any]:
        return check_export(reference, out_dir, options, loaders, concurrent_check(layer_parameters(config)))


#: The export formats by name (``stages[].export``, ``--format``).
FORMATS: dict[str, ExportFormat] = {form.name: form for form in (HuggingFaceLlama(),)}


# --- orchestration --------------------------------------------------------------------------------------------


def _is_remote(uri: str) -> bool:
    return "://" in str(uri)


def published_path(path: str, keep: int = 3) -> str:
    """``path`` as it may appear in what is published (model card, Hub commit message): no machine-local prefix.

    A URI (``gs://...``) is kept whole: it names the same object for every reader. A file in an installed package
    becomes ``<package>:<path in it>`` (``maxtext:assets/tokenizers/tokenizer_llama3.tiktoken``, the form the
    plan itself uses, :data:`multislice.config.data.DEFAULT_TOKENIZER`). Any other local path keeps only its last
    ``keep`` parts (``tiny-70b-recipe/checkpoints/19``): a home directory or a CI workspace says nothing to a
    model's user and would be published with it.
    """
    if _is_remote(path):
        return str(path)
    parts: tuple[str, ...] = Path(path).parts
    if "site-packages" in parts:
        inside = list(parts[parts.index("site-packages") + 1 :])
        if inside:
            return f"{inside[0]}:{'/'.join(inside[1:])}" if len(inside) > 1 else inside[0]
    return "/".join(parts[-keep:]) if parts else str(path)


def published_source(source: str) -> tuple[str, str]:
    """``(kind, published path)`` of :func:`stage_tokenizer`'s ``"<kind> <path>"`` (:func:`published_path`)."""
    kind, _, where = source.partition(" ")
    return kind, published_path(where, keep=1)


def export(options: Any, maxtext_args: list[str], loaders: dict[str, Loader]) -> dict[str, Any]:
    """Export ``options.step`` of ``options.checkpoint_dir`` to ``options.output`` and check it; the report.

    The files are written to a local scratch directory, checked there (by ``loaders``, :func:`start_loaders`),
    then copied to a ``gs://`` output (``etils.epath``); then uploaded to ``options.hub_repo`` when given.
    """
    import jax

    started = time.time()
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    # Float32 activations and the highest matmul precision for the comparison; shapes are unchanged.
    config, tokenizer, tokenizer_source = stage_setup(maxtext_args)
    dtype = options.dtype or default_dtype(config)
    options.dtype = dtype
    ids = check_ids(tokenizer, int(config.vocab_size), min(options.tokens, int(config.max_target_length)))
    form = FORMATS[options.format]
    scratch = Path(tempfile.mkdtemp(prefix="export-"))
    remote = _is_remote(options.output)
    local = scratch / "model" if remote else Path(options.output)
    local.mkdir(parents=True, exist_ok=True)
    checkpoint = verify.checkpoint_path(str(options.checkpoint_dir))
    # stacked layers split once into local files beside the export (CheckpointReader.layer): no read amplification
    reader = CheckpointReader(digests.item_dir(checkpoint / str(options.step)), scratch / "layers")
    before = rss_bytes()
    phases = reset_rss_peak()  # each phase's peak is its own, not the warm-up's or the other phase's
    reference = MaxTextReference(config, dtype, ids, sample_positions(len(ids), options.sample_fraction))
    converting = time.time()
    written = form.convert(reader, config, tokenizer, dtype, local, options, reference)
    metadata = written["metadata"]
    conversion_seconds = time.time() - converting
    conversion_peak = rss_peak_bytes()
    shutil.rmtree(scratch / "layers", ignore_errors=True)  # the split layers: read, converted, no longer needed
    reset_rss_peak()
    card = {"run": options.run_name, "stage": options.stage, "data_fingerprint": options.data_fingerprint,
            "steps": options.steps, "train_loss": options.train_loss, "eval_loss": options.eval_loss,
            "checkpoint": published_path(f"{checkpoint}/{options.step}"),
            "tokenizer": "{} {}".format(*published_source(tokenizer_source))}  # fmt: skip
    form.write_metadata(local, metadata, tokenizer, card)
    checking = time.time()
    check = form.check(reference, config, local, options, loaders)
    check["seconds"] = round(time.time() - checking, 2)
    check["conversion_seconds"] = round(conversion_seconds, 2)  # MaxText's side ran inside the conversion
    files = sorted(p.name for p in local.iterdir())
    if remote:
        destination = verify.checkpoint_path(options.output)
        destination.mkdir(parents=True, exist_ok=True)
        for name in files:
            (destination / name).write_bytes((local / name).read_bytes())
    hub = None
    if options.hub_repo and check["passed"]:
        from huggingface_hub import HfApi

        api = HfApi(token=os.environ[HF_TOKEN_ENV])
        api.create_repo(options.hub_repo, exist_ok=True, private=True)
        commit = api.upload_folder(folder_path=str(local), repo_id=options.hub_repo,
                                   commit_message=f"export of {card['checkpoint']}")  # fmt: skip
        hub = {"repo": options.hub_repo, "commit": getattr(commit, "oid", None), "url": str(commit)}
    report = {
        "verdict": "PASS" if check["passed"] else "FAIL",
        "format": form.name,
        "export_dir": str(options.output),
        "checkpoint_dir": str(checkpoint),
        "checkpoint_step": options.step,
        "parameter_count": written["parameter_count"],
        "dtype": dtype,
        "architecture": form.architecture,
        "vocab_size": int(config.vocab_size),
        "max_position_embeddings": metadata["max_position_embeddings"],
        "tokenizer": tokenizer_source,
        "tokenizer_vocab_size": len(tokenizer),
        "scan_layers": bool(config.scan_layers),
        "files": files,
        "shards": written["shards"],
        "layers_per_shard": options.layers_per_shard,
        "memory": {
            "rss_before_conversion_bytes": before,
            "conversion_peak_rss_bytes": conversion_peak,
            "largest_group_bytes": written["largest_group_bytes"],
            "check_peak_rss_bytes": rss_peak_bytes(),
            "peaks_per_phase": phases,
            "destacked_bytes": reader.destacked_bytes,
        },
        "logits_check": check,
        "hub": hub,
        "seconds": round(time.time() - started, 2),
    }
    shutil.rmtree(scratch, ignore_errors=True)  # the copy to gs:// (remote), else only the split layers' place
    return report


def _write_report(report: dict[str, Any], target: str | None) -> None:
    """Print the report and write it to ``target`` (local or ``gs://``) too."""
    verify.emit_report(report, None)
    if target:
        store_report(report, target)


def store_report(report: dict[str, Any], target: str) -> None:
    """Write the report as JSON to ``target`` (local or ``gs://``, with ``etils.epath``), creating its directory."""
    path = verify.checkpoint_path(target) if _is_remote(target) else Path(target)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=1), encoding="utf-8")


def parser(prog: str = f"python -m {MODULE}", description: str = "") -> argparse.ArgumentParser:
    """The exporter's options (its MaxText arguments follow ``--``); ``prog`` and ``description`` for ``--help``
    (default the exporter's own)."""
    p = argparse.ArgumentParser(prog=prog, description=description or (__doc__ or "").split("\n")[0])
    p.add_argument("--checkpoint-dir", required=True, help="the stage's checkpoint directory (local or gs://)")
    p.add_argument("--step", required=True, type=int, help="the checkpoint step to export")
    p.add_argument("--output", required=True, help="the export directory (local or gs://)")
    p.add_argument("--report", help="write the JSON report here too (local or gs://)")
    p.add_argument("--format", default="huggingface", choices=sorted(FORMATS), help="the export format")
    p.add_argument(
        "--dtype",
        choices=("bfloat16", "float32"),
        default=None,
        help=f"weights' dtype (default bfloat16 from {BF16_FROM_PARAMETERS:.0e} parameters, else float32)",
    )
    p.add_argument("--hub-repo", help="after the checks pass, upload to this Hugging Face Hub repository "
                   f"(OWNER/NAME; token from ${HF_TOKEN_ENV})")  # fmt: skip
    p.add_argument("--tokens", type=int, default=TOKENS, help="tokens whose logits are compared")
    p.add_argument(
        "--sample-fraction",
        type=float,
        default=1.0,
        help="fraction of the token positions whose logits are compared (seeded; for large models)",
    )
    p.add_argument(
        "--layers-per-shard",
        type=int,
        default=LAYERS_PER_SHARD,
        help="decoder layers converted and written at once (the memory bound's layer group)",
    )
    p.add_argument("--atol", type=float, default=ATOL, help="absolute tolerance of the logits check")
    p.add_argument("--rtol", type=float, default=RTOL, help="relative tolerance of the logits check")
    p.add_argument("--run-name", help="model card: the run")
    p.add_argument("--stage", help="model card: the stage")
    p.add_argument("--data-fingerprint", help="model card: the training data's fingerprint")
    p.add_argument("--steps", type=int, help="model card: training steps")
    p.add_argument("--train-loss", type=float, help="model card: final train loss")
    p.add_argument("--eval-loss", type=float, help="model card: final eval loss")
    return p


def main(argv: list[str] | None = None) -> int:
    """CLI entry; prints the JSON report last (and writes ``--report``). Exit 0 PASS, 1 FAIL, 2 error."""
    argv = sys.argv[1:] if argv is None else argv
    own, maxtext_args = verify.split_args(argv)
    p = parser()
    options = p.parse_args(own)
    check_options(p, options, maxtext_args)
    report, status = run(options, maxtext_args)
    _write_report(report, options.report)
    return status


def check_options(p: argparse.ArgumentParser, options: Any, maxtext_args: list[str]) -> None:
    """Refuse bad options through ``p.error`` (exit 2 with usage), before anything is read or written."""
    if not maxtext_args:
        p.error("give the stage's MaxText arguments after --, so the model can be built")
    if not 0 < options.sample_fraction <= 1:
        p.error(f"--sample-fraction {options.sample_fraction}: give a fraction in (0, 1]")
    if options.layers_per_shard < 1:
        p.error(f"--layers-per-shard {options.layers_per_shard}: give 1 or more")
    if options.hub_repo and (options.hub_repo.count("/") != 1 or not all(options.hub_repo.split("/"))):
        p.error(f"--hub-repo {options.hub_repo}: give OWNER/NAME")


def run(options: Any, maxtext_args: list[str], loaders: dict[str, Loader] | None = None) -> tuple[dict[str, Any], int]:
    """:func:`export` with its failures as reports: ``(report, exit status)``, 0 PASS, 1 FAIL, 2 ERROR.

    ERROR: ``--hub-repo`` without a token in ``$HF_TOKEN`` (refused before anything is exported), or the
    exception that stopped the export (its type and message in ``error``). Used by :func:`main` and by
    :mod:`multislice.trainer.verify_export`, which exports in the verifier's process and passes the ``loaders``
    it started before verifying (:func:`start_loaders`; None: started here). Either way they are stopped here.
    """
    if options.hub_repo and not os.environ.get(HF_TOKEN_ENV):
        report = {"verdict": "ERROR", "export_dir": options.output,
                  "error": f"--hub-repo {options.hub_repo} needs a Hugging Face token in ${HF_TOKEN_ENV} (a write "
                  "token of the repository's owner); nothing was exported"}  # fmt: skip
        return report, 2
    loaders = start_loaders() if loaders is None else loaders  # their imports overlap the conversion
    try:
        report = export(options, maxtext_args, loaders)
        return report, 0 if report["verdict"] == "PASS" else 1
    except Exception as error:  # the report must say why the export could not be made
        return {"verdict": "ERROR", "error": f"{type(error).__name__}: {error}", "export_dir": options.output}, 2
    finally:
        for loader in loaders.values():
            loader.stop()


if __name__ == "__main__":
    sys.exit(main())
