"""One Hugging Face loader's view of an export: ``LlamaForCausalLM``'s logits at chosen positions.

Run by the exporter (:class:`multislice.trainer.export.Loader`) once with the trainer environment's
transformers 5 and once with the pinned transformers 4.57 environment (``requirements/loader-hf4.txt``), so it
imports only what both have (torch, numpy, transformers)::

    python -m multislice.trainer.hf_loader request.json
    python -m multislice.trainer.hf_loader -     # the request on stdin, read after the imports

``request.json``: ``{"export_dir", "ids", "positions", "out"}``. With ``-`` the loader imports torch and
transformers first and then waits for the request on its standard input: the exporter starts it before the export
exists, so those imports (seconds) overlap the verification and the conversion
(:class:`multislice.trainer.export.Loader`); an empty input (the export was not made) ends it with exit 0 and no
output. The model is loaded from ``export_dir`` in float32 on CPU (bf16 weights are upcast exactly); its logits
``[len(positions), vocab]`` go to ``out`` (``.npy``). Printed last, one JSON line: ``transformers_version``,
``rope_theta`` as the loaded config has it,
``max_position_embeddings``, ``tokenizer_class`` and ``ids_round_trip`` (the export's tokenizer, loaded with
``AutoTokenizer``, encodes the ids' decoded text back to the same ids), ``logits_file``.
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


def main(argv: list[str] | None = None) -> int:
    """Load, compute, write; exit 0 (a load error is a traceback on stderr and a non-zero exit)."""
    import numpy as np
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM

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
    kwargs: dict[str, Any] = {"dtype": torch.float32} if int(transformers.__version__.split(".")[0]) >= 5 else {
        "torch_dtype": torch.float32}  # fmt: skip
    model = LlamaForCausalLM.from_pretrained(export_dir, **kwargs)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids], dtype=torch.long)).logits[0]
    np.save(request["out"], logits[positions].float().numpy())
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
        "logits_file": request["out"],
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
