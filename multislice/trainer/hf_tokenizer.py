"""The Hugging Face-format Llama 3 tokenizer shipped in the package, for MaxText's ``hf`` input pipeline.

MaxText 0.2.5's hf pipeline always loads its tokenizer with ``transformers.AutoTokenizer.from_pretrained(
tokenizer_path, add_bos_token=..., add_eos_token=...)`` (``maxtext/input_pipeline/hf_data_processing.py``), which
cannot read the tiktoken file that is every stage's default tokenizer (it raises ``OSError ... is not a valid JSON
file``). So a stage on ``hf`` data with the default tokenizer is given this directory instead
(:data:`multislice.config.data.HF_LLAMA3_TOKENIZER`): the same vocabulary, converted from MaxText's
``tokenizer_llama3.tiktoken`` by ``transformers``' ``TikTokenConverter`` exactly as the exporter converts it
(:func:`multislice.trainer.export._tiktoken`), so the ids equal MaxText's ``TikTokenTokenizer``'s. transformers 5
applies ``add_bos_token`` / ``add_eos_token`` to it at load time, so one file serves every ``add_bos`` /
``add_eos`` choice. Nothing is downloaded: the file is in the package (``multislice/data/tokenizers/llama3-hf``).

Regenerate it (trainer environment) with::

    python -m multislice.trainer.hf_tokenizer multislice/data/tokenizers/llama3-hf
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

#: What ``tokenizer_config.json`` says; ``PreTrainedTokenizerFast`` is known to transformers 4.57 and 5.
TOKENIZER_CONFIG = {
    "tokenizer_class": "PreTrainedTokenizerFast",
    "bos_token": "<|begin_of_text|>",
    "eos_token": "<|end_of_text|>",
    "model_max_length": 131072,
}


def write(out_dir: Path) -> Path:
    """Write ``tokenizer.json`` (compact, about 7.2 MB) and ``tokenizer_config.json`` of Llama 3 into ``out_dir``.

    Returns:
        ``out_dir``.
    """
    from multislice.config.data import DEFAULT_TOKENIZER, resolve_path
    from multislice.trainer import export

    tokenizer = export._tiktoken(resolve_path(DEFAULT_TOKENIZER), add_bos=True, add_eos=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    as_json = json.loads(tokenizer.backend_tokenizer.to_str())
    (out_dir / "tokenizer.json").write_text(
        json.dumps(as_json, ensure_ascii=False, separators=(",", ":")), encoding="utf-8"
    )
    (out_dir / "tokenizer_config.json").write_text(json.dumps(TOKENIZER_CONFIG, indent=2) + "\n", encoding="utf-8")
    return out_dir


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
