"""Hugging Face export: a stage's final checkpoint as a Llama model that ``transformers`` loads, checked by its logits.

Usage (trainer environment)::

    python -m multislice.trainer.export --checkpoint-dir DIR --step N --output DIR \
        [--report report.json] [--tokens T] [--atol A] [--rtol R] -- key=value ...   # the stage's MaxText arguments

What it does:

1. restores the parameters (only: no optimizer state) of checkpoint ``N`` onto this CPU process
   (:func:`multislice.trainer.verify.restore_arrays`);
2. maps them to Hugging Face's Llama names and layouts with MaxText's own conversion tables for Llama 3.1
   (``maxtext/checkpoint_conversion/utils/param_mapping.py``: ``LLAMA31_MAXTEXT_TO_HF_PARAM_MAPPING`` and
   its hooks, which scale the query by sqrt(head_dim), turn RoPE's interleaved layout into HF's
   concatenated one and transpose kernels; ``hf_shape.py``; ``utils.process_maxtext_param``), scanned
   or unscanned as the stage trained, and writes ``model.safetensors`` + ``config.json`` with MaxText's
   ``utils.save_model_files``. MaxText's ``to_huggingface.main`` is not called as a whole: it takes the
   architecture from a named Hugging Face model (``HF_MODEL_CONFIGS``, Llama 3.1 8B and up) and downloads
   the tokenizer from the Hub; here the ``LlamaConfig`` is built from the stage's MaxText config
   (:func:`hf_config`) and the tokenizer comes from the maxtext package;
3. writes the tokenizer: the Llama 3 tiktoken BPE that the maxtext package ships
   (``maxtext/assets/tokenizers/tokenizer_llama3.tiktoken``) with the special tokens MaxText's
   ``TikTokenTokenizer`` adds (``maxtext/input_pipeline/tokenizer.py``), converted by ``transformers``'
   ``TikTokenConverter`` to ``tokenizer.json`` (+ ``tokenizer_config.json``); nothing is downloaded;
4. checks it: ``transformers.LlamaForCausalLM`` loads the export (float32, CPU) and its logits on
   ``--tokens`` tokens are compared with those of MaxText's own model (float32 activations, highest
   matmul precision) with the checkpoint's parameters on the same tokens (:func:`compare_logits`).

Tolerance: ``|hf - maxtext| <= atol + rtol * |maxtext|`` elementwise, with ``atol`` :data:`ATOL` and
``rtol`` :data:`RTOL`. Both sides compute in float32 on CPU from the same float32 weights; they differ
only by the order of floating-point operations (attention, RMSNorm, RoPE's sin/cos computed by each
library) which, at float32's 6e-8 unit roundoff over a few layers, leaves differences of order 1e-6 to
1e-5 on logits of order 1 (measured on the local profile's stages: see the report's ``max_abs_diff``).
A wrong conversion (an untransposed kernel, RoPE's layout not permuted, the query scale missing) moves
logits by order 0.1 to 1, four orders of magnitude above the tolerance. The argmax token must agree at
every position too.

The tokens: the exported tokenizer's encoding of a fixed English text (:data:`TEXT`), each id taken
modulo the model's vocab size (the tiny presets' vocab, 1024, is smaller than the tokenizer's 128256).

Exit status: 0 when the export was written and its logits matched, 1 when they did not, 2 when the
export could not be made (the JSON report, printed last, says why).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from multislice.trainer import verify

#: This module, as the trainer image runs it.
MODULE = "multislice.trainer.export"
#: Absolute and relative tolerance of the logits comparison (see the module docstring).
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
#: Tokenizer file of the maxtext package (relative to the package).
TOKENIZER_ASSET = "assets/tokenizers/tokenizer_llama3.tiktoken"
#: What the exporter supports (the Llama 2/3 decoder block MaxText names ``llama2``).
SUPPORTED = "decoder_block llama2 with mlp_activations [silu, linear], untied embeddings, default RoPE"


class Unsupported(ValueError):
    """The stage's model cannot be exported as a Hugging Face Llama (the message says which setting)."""


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
            (:func:`multislice.exporting.model_card`).
    """
    argv = [python, "-m", MODULE, "--checkpoint-dir", checkpoint_dir, "--step", str(step), "--output", output]
    if dtype:
        argv += ["--dtype", dtype]
    if hub_repo:
        argv += ["--hub-repo", hub_repo]
    if report:
        argv += ["--report", report]
    for key, option in CARD_OPTIONS.items():
        if (card or {}).get(key) is not None:
            argv += [option, str(card[key])]
    return [*argv, "--", *maxtext_args]


def tokenizer_path() -> Path:
    """The Llama 3 tiktoken file that the installed maxtext package ships."""
    import maxtext

    return Path(maxtext.__file__).parent / TOKENIZER_ASSET


def hf_tokenizer() -> Any:
    """The maxtext package's Llama 3 tokenizer as a ``transformers.PreTrainedTokenizerFast``.

    Its BPE ranks and special tokens are exactly those of MaxText's ``TikTokenTokenizer``
    (``maxtext/input_pipeline/tokenizer.py``), converted by ``transformers``' ``TikTokenConverter``.
    """
    from maxtext.input_pipeline.tokenizer import TikTokenTokenizer
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    source = TikTokenTokenizer(str(tokenizer_path()), add_bos=True, add_eos=False)
    converter = TikTokenConverter(
        vocab_file=str(tokenizer_path()),
        pattern=source.pat_str,
        extra_special_tokens=source.special_tokens,
    )
    converter.additional_special_tokens = list(source.special_tokens)
    backend = converter.converted()
    # BOS first, as MaxText's tokenizer (add_bos) and Meta's Llama 3 tokenizer.json (TemplateProcessing) do.
    bos = "<|begin_of_text|>"
    backend.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A:0 {bos}:1 $B:1", special_tokens=[(bos, source.special_tokens[bos])]
    )
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
        model_max_length=131072,
    )
    return tokenizer


def hf_config(config: Any, tokenizer_vocab: dict[str, int]) -> Any:
    """The ``transformers.LlamaConfig`` of the stage's MaxText model.

    Raises:
        Unsupported: the model is not a Llama (see :data:`SUPPORTED`).
    """
    import transformers

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
    vocab = int(config.vocab_size)
    bos, eos = tokenizer_vocab["<|begin_of_text|>"], tokenizer_vocab["<|end_of_text|>"]
    return transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=int(config.emb_dim),
        intermediate_size=int(config.mlp_dim),
        num_hidden_layers=int(config.num_decoder_layers),
        num_attention_heads=int(config.num_query_heads),
        num_key_value_heads=int(config.num_kv_heads),
        head_dim=int(config.head_dim),
        max_position_embeddings=int(config.max_target_length),
        rms_norm_eps=float(config.normalization_layer_epsilon),
        rope_theta=float(config.rope_max_timescale),
        tie_word_embeddings=False,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
        # The tokenizer's BOS/EOS ids, where the model's vocab has them (the tiny presets' 1024 does not).
        bos_token_id=bos if bos < vocab else None,
        eos_token_id=eos if eos < vocab else None,
        architectures=["LlamaForCausalLM"],
        torch_dtype="float32",
    )


def _params(items_dir: Any) -> dict[str, Any]:
    """The checkpoint's parameters: ``params/params/decoder/...`` path -> float32 numpy array."""
    tree, why = verify._tree(items_dir)
    if tree is None:
        raise ValueError(why)
    wanted = [p for p in verify._leaves(tree) if p.startswith("params/params/")]
    return verify.restore_arrays(items_dir, tree, wanted)


def convert(flat: dict[str, Any], config: Any, hf: Any) -> dict[str, Any]:
    """MaxText parameters (``params/params/a/b`` -> array) to Hugging Face's (``model.layers.0...`` -> array).

    With MaxText's conversion tables for :data:`MAPPING_MODEL` (``maxtext/checkpoint_conversion``).

    Raises:
        ValueError: a parameter is missing from the checkpoint or has no mapping.
    """
    from maxtext.checkpoint_conversion.utils.hf_shape import HF_SHAPE
    from maxtext.checkpoint_conversion.utils.param_mapping import HOOK_FNS, PARAM_MAPPING
    from maxtext.checkpoint_conversion.utils.utils import process_maxtext_param

    hf_dict = hf.to_dict()
    param_map = PARAM_MAPPING[MAPPING_MODEL](hf_dict, config, config.scan_layers)
    hooks = HOOK_FNS[MAPPING_MODEL](hf_dict, config, config.scan_layers, saving_to_hf=True)
    # The tables' ``adjust_rope`` hook turns the interleaved RoPE layout of MaxText's Llama 3.1 rotary embedding
    # (``LLaMARotaryEmbedding``) into HF's halves. A stage with ``rope_type: default`` (not a ``llama3.1*``
    # model_name) uses ``RotaryEmbedding`` (``maxtext/layers/embeddings.py``), which already rotates halves as HF
    # does (``_rotate_half``): the permutation would scramble it (the logits check caught it: |diff| 1.5).
    hooks = {key: _without_rope_permutation(fns) for key, fns in hooks.items()}
    shapes = HF_SHAPE[MAPPING_MODEL](hf_dict)
    weights = {"params-" + "-".join(path.split("/")[2:]): value for path, value in flat.items()}
    missing = sorted(set(param_map) - set(weights))
    unmapped = sorted(set(weights) - set(param_map))
    if missing or unmapped:
        raise ValueError(f"checkpoint parameters and MaxText's {MAPPING_MODEL} mapping differ: "
                         f"missing {missing[:5]}, unmapped {unmapped[:5]}")  # fmt: skip
    out: dict[str, Any] = {}
    for key in param_map:
        out.update(process_maxtext_param(key, weights[key], param_map, hooks, shapes, config))
    return out


def _without_rope_permutation(fns: Any) -> Any:
    """A hook chain without MaxText's ``adjust_rope`` (see :func:`convert`)."""
    if isinstance(fns, list):
        return [fn for fn in fns if getattr(fn, "__name__", "") != "adjust_rope"]
    return fns


def maxtext_logits(config: Any, flat: dict[str, Any], tokens: list[int]) -> Any:
    """MaxText's logits (numpy, ``[len(tokens), vocab]``) of its own model with the checkpoint's parameters."""
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
    inputs = jnp.asarray([tokens], jnp.int32)
    positions = jnp.arange(len(tokens), dtype=jnp.int32)[None, :]
    segments = jnp.ones_like(inputs)
    key = jax.random.PRNGKey(0)
    logits = model.apply(
        params, inputs, positions, decoder_segment_ids=segments, enable_dropout=False,
        rngs={"aqt": key, "params": key},
    )  # fmt: skip
    return np.asarray(logits[0], np.float32)


def hf_logits(export_dir: str, tokens: list[int]) -> Any:
    """``transformers.LlamaForCausalLM``'s logits (numpy, float32, CPU) of the export on ``tokens``."""
    import torch
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(export_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        out = model(input_ids=torch.tensor([tokens], dtype=torch.long))
    return out.logits[0].float().numpy()


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


def export(
    checkpoint_dir: Any, step: int, output: str, maxtext_args: list[str], tokens: int, atol: float, rtol: float
) -> dict[str, Any]:
    """Export checkpoint ``step`` to ``output`` (local or ``gs://``) and check it; returns the report."""
    import jax
    from maxtext.checkpoint_conversion.utils.utils import save_model_files

    started = time.time()
    jax.config.update("jax_default_prng_impl", "unsafe_rbg")
    # Float32 activations and the highest matmul precision for the comparison; shapes are unchanged.
    config = verify._config([*maxtext_args, "dtype=float32", "matmul_precision=highest"])
    tokenizer = hf_tokenizer()
    hf = hf_config(config, tokenizer.get_vocab())
    flat = _params(checkpoint_dir / str(step) / "items")
    weights = convert(flat, config, hf)
    count = int(sum(v.size for v in weights.values()))
    save_model_files(weights, hf, tokenizer, None, str(output))
    ids = tokenizer(TEXT, add_special_tokens=True)["input_ids"][: min(tokens, int(config.max_target_length))]
    ids = [i % int(config.vocab_size) for i in ids]
    check = compare_logits(maxtext_logits(config, flat, ids), hf_logits(str(output), ids), atol, rtol)
    return {
        "verdict": "PASS" if check["passed"] else "FAIL",
        "format": "huggingface",
        "export_dir": str(output),
        "checkpoint_dir": str(checkpoint_dir),
        "checkpoint_step": step,
        "parameter_count": count,
        "architecture": "LlamaForCausalLM",
        "vocab_size": int(config.vocab_size),
        "tokenizer": TOKENIZER_ASSET,
        "tokenizer_vocab_size": len(tokenizer),
        "scan_layers": bool(config.scan_layers),
        "files": sorted(p.name for p in verify.checkpoint_path(str(output)).iterdir()),
        "logits_check": check,
        "seconds": round(time.time() - started, 2),
    }


def main(argv: list[str] | None = None) -> int:
    """CLI entry; prints the JSON report last (and writes ``--report``). Exit 0 PASS, 1 FAIL, 2 error."""
    argv = sys.argv[1:] if argv is None else argv
    own, maxtext_args = (argv[: argv.index("--")], argv[argv.index("--") + 1 :]) if "--" in argv else (argv, [])
    parser = argparse.ArgumentParser(prog=f"python -m {MODULE}", description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint-dir", required=True, type=verify.checkpoint_path)
    parser.add_argument("--step", required=True, type=int, help="the checkpoint step to export")
    parser.add_argument("--output", required=True, help="the export directory (local or gs://)")
    parser.add_argument("--report", type=Path, help="write the JSON report here too")
    parser.add_argument("--tokens", type=int, default=TOKENS, help="tokens whose logits are compared")
    parser.add_argument("--atol", type=float, default=ATOL, help="absolute tolerance of the logits check")
    parser.add_argument("--rtol", type=float, default=RTOL, help="relative tolerance of the logits check")
    options = parser.parse_args(own)
    if not maxtext_args:
        parser.error("give the stage's MaxText arguments after --, so the model can be built")
    try:
        report = export(
            options.checkpoint_dir, options.step, options.output, maxtext_args, options.tokens, options.atol,
            options.rtol,
        )  # fmt: skip
        status = 0 if report["verdict"] == "PASS" else 1
    except Exception as error:  # the report must say why the export could not be made
        report = {"verdict": "ERROR", "error": f"{type(error).__name__}: {error}", "export_dir": options.output}
        status = 2
    verify.emit_report(report, options.report)
    return status


if __name__ == "__main__":
    sys.exit(main())
