"""One Hugging Face loader's view of an export: Llama's logits at chosen positions, computed layer by layer.

Run by the exporter (:class:`multislice.trainer.export.Loader`) once with the trainer environment's
transformers 5 and once with the pinned transformers 4.57 environment (``requirements/loader-hf4.txt``), so it
imports only what both have (torch, numpy, safetensors, transformers)::

    python -m multislice.trainer.hf_loader request.json
    python -m multislice.trainer.hf_loader -     # the request on stdin, read after the imports

``request.json``: ``{"export_dir", "ids", "positions", "out"}``. With ``-`` the loader imports torch and
transformers first and then waits for the request on its standard input: the exporter starts it before the export
exists, so those imports (seconds) overlap the verification and the conversion
(:class:`multislice.trainer.export.Loader`); an empty input (the export was not made) ends it with exit 0 and no
output.

**Bounded memory** (:func:`layerwise_logits`). The model is never held whole: the export's config is read with
``AutoConfig`` and the installed transformers' own Llama modules compute in float32 on CPU, one at a time, from
the safetensors shards (bf16 weights upcast exactly): the embedding rows of ``ids`` (read in row blocks), each
``LlamaDecoderLayer`` built, loaded with its layer's tensors (``load_state_dict(strict=True)``: a missing,
extra or misshapen tensor is an error), applied with ``LlamaRotaryEmbedding``'s cos/sin and a causal mask
(eager attention, ``modeling_llama.eager_attention_forward``) and freed, then ``LlamaRMSNorm`` and the output head
in vocabulary blocks. Peak memory: one decoder layer in float32 plus one block (about 0.9 GB for Llama 3 8B, 3.4
GB for 70B), not the model. That the export also loads whole is checked without its weights: ``LlamaForCausalLM``
built on the ``meta`` device from the config has exactly the export's tensor names and shapes (what
``from_pretrained`` would report as missing or unexpected keys). The logits ``[len(positions), vocab]`` go to
``out`` (``.npy``), the hidden states after the embedding and after each layer ``[layers + 1, len(ids), emb]`` to
``<out>.hidden.npy``. Printed last, one JSON line: ``transformers_version``, ``rope_theta`` as the loaded config
has it, ``max_position_embeddings``, ``tokenizer_class`` and ``ids_round_trip`` (the export's tokenizer, loaded
with ``AutoTokenizer``, encodes the ids' decoded text back to the same ids), ``structure`` (``{"missing",
"unexpected", "misshapen"}``), ``peak_rss_bytes``, ``logits_file``, ``hidden_file``.
"""

from __future__ import annotations

import json
import sys
from typing import Any


def load(export_dir: str, **from_pretrained: Any) -> tuple[Any, Any]:
    """An export's model and tokenizer: ``AutoModelForCausalLM`` and ``AutoTokenizer`` ``.from_pretrained``.

    For users (:func:`multislice.delivery.results.load_hf_model`), in any Python with transformers and torch.

    Raises:
        ImportError: transformers (or torch) is not installed in this Python.
    """
    import transformers  # deferred: the pipeline environment imports this module and has no transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(export_dir, **from_pretrained)
    return model, transformers.AutoTokenizer.from_pretrained(export_dir, **from_pretrained)


#: Bytes of float32 in one block of rows of the embedding or the output head (a bound on the loader's memory
#: beside one decoder layer).
BLOCK_BYTES = 256 * 2**20


def _tensors(export_dir: str) -> dict[str, str]:
    """Tensor name -> shard file of the export (``model.safetensors.index.json``, or the one ``model.safetensors``)."""
    import os

    index = os.path.join(export_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index, encoding="utf-8") as handle:
            return {name: os.path.join(export_dir, f) for name, f in json.load(handle)["weight_map"].items()}
    from safetensors import safe_open

    single = os.path.join(export_dir, "model.safetensors")
    with safe_open(single, "pt") as shard:
        return dict.fromkeys(shard.keys(), single)


def _read(files: dict[str, str], name: str, start: int | None = None, stop: int | None = None) -> Any:
    """Tensor ``name`` (rows ``start:stop`` when given) in float32."""
    import torch
    from safetensors import safe_open

    with safe_open(files[name], "pt") as shard:
        if start is None:
            return shard.get_tensor(name).to(torch.float32)
        return shard.get_slice(name)[start:stop].to(torch.float32)


def _rows(files: dict[str, str], name: str) -> tuple[int, int, int]:
    """``(rows, columns, rows per block)`` of a 2-D tensor, a block being at most :data:`BLOCK_BYTES` in float32."""
    from safetensors import safe_open

    with safe_open(files[name], "pt") as shard:
        rows, columns = shard.get_slice(name).get_shape()
    return rows, columns, max(1, BLOCK_BYTES // (4 * columns))


def structure(config: Any, files: dict[str, str]) -> dict[str, list[str]]:
    """The export's tensors against ``LlamaForCausalLM`` built from ``config`` on the ``meta`` device (no memory):
    ``{"missing", "unexpected", "misshapen"}`` names, all empty when ``from_pretrained`` would load it cleanly."""
    import torch
    from safetensors import safe_open
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    wanted = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    if getattr(config, "tie_word_embeddings", False):
        wanted.pop("lm_head.weight", None)
    found = {}
    for name, path in files.items():
        with safe_open(path, "pt") as shard:
            found[name] = tuple(shard.get_slice(name).get_shape())
    return {
        "missing": sorted(set(wanted) - set(found)),
        "unexpected": sorted(set(found) - set(wanted)),
        "misshapen": sorted(n for n in set(wanted) & set(found) if wanted[n] != found[n]),
    }


def layerwise_logits(config: Any, files: dict[str, str], ids: list[int], positions: list[int]) -> tuple[Any, Any]:
    """``(logits [len(positions), vocab], hidden states [layers + 1, len(ids), emb])``, float32 numpy, computed one
    module at a time with the installed transformers' Llama (see the module docstring).

    Raises:
        RuntimeError: a layer's tensors do not fit its ``LlamaDecoderLayer`` (``load_state_dict``'s message).
    """
    import numpy as np
    import torch
    from transformers.models.llama import modeling_llama

    config._attn_implementation = "eager"  # the causal mask below; sdpa would take it too, eager is the reference
    count = len(ids)
    wanted = torch.tensor(ids, dtype=torch.long)
    rows, _, block = _rows(files, "model.embed_tokens.weight")
    hidden = torch.zeros(count, config.hidden_size, dtype=torch.float32)
    for start in range(0, rows, block):
        chosen = (wanted >= start) & (wanted < start + block)
        if bool(chosen.any()):
            part = _read(files, "model.embed_tokens.weight", start, min(start + block, rows))
            hidden[chosen] = part[wanted[chosen] - start]
            del part
    hidden = hidden[None]
    states = [hidden[0].numpy().copy()]
    position_ids = torch.arange(count, dtype=torch.long)[None]
    try:
        rotary = modeling_llama.LlamaRotaryEmbedding(config=config)
    except TypeError:
        rotary = modeling_llama.LlamaRotaryEmbedding(config)
    mask = torch.full((count, count), torch.finfo(torch.float32).min).triu(1)[None, None]
    with torch.no_grad():
        position_embeddings = rotary(hidden, position_ids)
        for index in range(config.num_hidden_layers):
            prefix = f"model.layers.{index}."
            layer = modeling_llama.LlamaDecoderLayer(config, layer_idx=index).to(torch.float32)
            weights = {name[len(prefix) :]: _read(files, name) for name in files if name.startswith(prefix)}
            layer.load_state_dict(weights, strict=True)
            del weights
            layer.eval()
            out = layer(hidden, attention_mask=mask, position_ids=position_ids,
                        position_embeddings=position_embeddings)  # fmt: skip
            hidden = out[0] if isinstance(out, tuple) else out
            states.append(hidden[0].numpy().copy())
            del layer
        norm = modeling_llama.LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        norm.load_state_dict({"weight": _read(files, "model.norm.weight")}, strict=True)
        final = norm(hidden)[0][positions]
        head = "model.embed_tokens.weight" if getattr(config, "tie_word_embeddings", False) else "lm_head.weight"
        vocab, _, block = _rows(files, head)
        logits = torch.empty(len(positions), vocab, dtype=torch.float32)
        for start in range(0, vocab, block):
            stop = min(start + block, vocab)
            logits[:, start:stop] = final @ _read(files, head, start, stop).T
    return logits.numpy(), np.stack(states)


def peak_rss_bytes() -> int:
    """This process's peak resident set size (``VmHWM``, else ``getrusage``), bytes."""
    import resource

    try:
        with open("/proc/self/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def main(argv: list[str] | None = None) -> int:
    """Load, compute, write; exit 0 (a load error is a traceback on stderr and a non-zero exit)."""
    import numpy as np
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    argv = sys.argv[1:] if argv is None else argv
    if argv[0] == "-":
        text = sys.stdin.read()  # blocks until the exporter hands the request over (or closes: nothing to do)
        if not text.strip():
            return 0
        request = json.loads(text)
    else:
        with open(argv[0], encoding="utf-8") as handle:
            request = json.load(handle)
    export_dir, ids, positions = request["export_dir"], request["ids"], request["positions"]
    config = AutoConfig.from_pretrained(export_dir)
    tokenizer = AutoTokenizer.from_pretrained(export_dir)
    files = _tensors(export_dir)
    found = structure(config, files)
    logits, hidden = layerwise_logits(config, files, ids, positions)
    np.save(request["out"], logits)
    hidden_file = request["out"].removesuffix(".npy") + ".hidden.npy"
    np.save(hidden_file, hidden)
    text = tokenizer.decode(ids, skip_special_tokens=True)
    rope = getattr(config, "rope_theta", None)
    if rope is None:
        rope = (getattr(config, "rope_parameters", None) or {}).get("rope_theta")
    print(json.dumps({
        "transformers_version": transformers.__version__,
        "rope_theta": rope,
        "max_position_embeddings": config.max_position_embeddings,
        "tokenizer_class": type(tokenizer).__name__,
        "ids_round_trip": tokenizer(text)["input_ids"] == ids,
        "structure": found,
        "peak_rss_bytes": peak_rss_bytes(),
        "logits_file": request["out"],
        "hidden_file": hidden_file,
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
