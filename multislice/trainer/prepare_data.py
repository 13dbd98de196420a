"""prepare_data's work, in the trainer environment: raw text -> tokenized sequences -> ArrayRecord shards.

Usage::

    python -m multislice.trainer.prepare_data --request '{"data": {...}, "tokenizer": {...},
        "max_target_length": 128, "out_dir": "..."}'

Reads the stage's ``text`` data (:class:`multislice.config.data.TextData`: text files, JSON Lines or
Parquet; local, ``gs://`` or ``site-packages:``), tokenizes it with MaxText's own tokenizer
(``maxtext.input_pipeline.tokenizer.build_tokenizer``, the one its grain pipeline would build from the same
``tokenizer_type`` and ``tokenizer_path``), and writes:

- ``<out_dir>/train-NNNNN.array_record`` and ``eval-NNNNN.array_record``: one serialized ``tf.train.Example``
  a record (MaxText's ``protos/example_pb2``), feature ``text`` an ``int64_list`` of at most
  ``max_target_length`` token ids, as MaxText's grain pipeline reads with ``tokenize_train_data=false``
  (``input_pipeline_utils.ParseFeatures``); written with ``array_record`` (``group_size:1``, for grain's
  random access);
- ``<out_dir>/manifest.json`` last: the source files with their SHA-256 and size, the tokenizer and its
  vocabulary, token, record (``sequences``) and shard counts per split, what the records become in MaxText's
  rows (:func:`row_counts`), the corpus' unigram entropy.

Records keep document boundaries (``data.concatenate: false``, the default): a record is one document, or one
piece of at most ``max_target_length`` tokens of a longer one (its first piece starts with BOS, its last ends with
EOS), never two documents. MaxText then packs them itself: with ``packing: true`` its grain pipeline's
``FirstFitPackIterDataset`` (``grain_packing_type: first_fit``, ``data_processing_utils.format_and_batch``) fills
each row with whole records and gives each its own segment id, positions restarting at 0, so attention never
crosses a document boundary. Where MaxText cannot pack (``packing: false``, which its elastic iterator requires,
``configs/types.py``), each record is one row padded to ``max_target_length``. ``data.concatenate: true`` writes
the former layout instead: every document concatenated and cut into full ``max_target_length`` records, no
padding anywhere, one segment a row (documents attend to the ones before them).

Idempotent: ``out_dir`` is named by the recipe (:func:`multislice.config.data.recipe_key`), and when its
manifest's ``fingerprint`` (recipe + every source file's SHA-256) matches the inputs, nothing is tokenized
again (``reused: true``). Hashing the sources is the only work then.

Memory is bounded by :data:`CHUNK_BYTES`: text files are read and tokenized one chunk of at most 1 MiB
(cut at a line end) at a time, JSON Lines one line and Parquet one batch of :data:`PARQUET_BATCH_ROWS` rows
at a time; the token buffers hold less than one sequence plus one chunk's tokens; a shard is streamed to
its file. A single JSON Lines record or Parquet row is held whole.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from multislice.config.data import TextData, TokenizerSpec, expand_files, recipe_key, resolve_path

#: Text read (and tokenized) at a time from a text file, bytes.
CHUNK_BYTES = 1 << 20
#: Parquet rows read at a time.
PARQUET_BATCH_ROWS = 256
#: Bytes hashed at a time.
HASH_BYTES = 1 << 20
MANIFEST = "manifest.json"
#: A shard worker's token counts per id (JSON ``{"id": count}``), for the coordinator's unigram entropy.
COUNTS = "unigram_counts.json"
FORMAT_VERSION = 2  # 2: one record per document (piece); 1 concatenated them


def _open(path: str, mode: str = "rb"):
    if path.startswith("gs://"):
        from etils import epath

        return epath.Path(path).open(mode)
    return open(path, mode)


def file_sha256(path: str) -> tuple[str, int]:
    """(SHA-256 hex, size in bytes) of a file, read :data:`HASH_BYTES` at a time."""
    digest, size = hashlib.sha256(), 0
    with _open(path) as handle:
        while block := handle.read(HASH_BYTES):
            digest.update(block)
            size += len(block)
    return digest.hexdigest(), size


def in_eval(digest: str, fraction: float) -> bool:
    """Whether a document whose SHA-256 is ``digest`` belongs to the eval split (first ``fraction`` of hashes)."""
    return int(digest[:8], 16) < fraction * 2**32


def documents(path: str, data: TextData, file_digest: str) -> Iterator[tuple[str, Iterator[str]]]:
    """The documents of one file as ``(sha256, chunks of text)``; chunks are read lazily (bounded memory)."""
    if data.format == "text":

        def chunks() -> Iterator[str]:
            with _open(path) as handle:
                rest = b""
                while block := handle.read(CHUNK_BYTES):
                    block = rest + block
                    cut = block.rfind(b"\n") + 1 or len(block)
                    block, rest = block[:cut], block[cut:]
                    yield block.decode("utf-8", errors="replace")
                if rest:
                    yield rest.decode("utf-8", errors="replace")

        yield file_digest, chunks()
    elif data.format == "jsonl":
        with _open(path) as handle:
            for line in handle:
                if not line.strip():
                    continue
                text = json.loads(line).get(data.text_field)
                if isinstance(text, str) and text:
                    yield hashlib.sha256(text.encode()).hexdigest(), iter((text,))
    else:
        import pyarrow.parquet as pq

        with _open(path) as handle:
            for batch in pq.ParquetFile(handle).iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[data.text_field]):
                for text in batch.column(0).to_pylist():
                    if isinstance(text, str) and text:
                        yield hashlib.sha256(text.encode()).hexdigest(), iter((text,))


class ShardWriter:
    """Writes one split's sequences as ArrayRecord shards of ``per_shard`` records each, streaming."""

    def __init__(self, folder: str, split: str, per_shard: int):
        from maxtext.input_pipeline.protos import example_pb2

        self.example_pb2 = example_pb2
        self.folder, self.split, self.per_shard = folder, split, per_shard
        self.shards: list[str] = []
        self.sequences = self.tokens = self._in_shard = 0
        self._writer = None

    def add(self, tokens: list[int]) -> None:
        """Write one sequence (token ids) as a record."""
        from array_record.python.array_record_module import ArrayRecordWriter

        if self._writer is None:
            name = f"{self.split}-{len(self.shards):05d}.array_record"
            self._writer = ArrayRecordWriter(os.path.join(self.folder, name), "group_size:1")
            self.shards.append(name)
        # protobuf makes the module's message classes at import: the checker cannot see them
        example = self.example_pb2.Example()  # pyright: ignore[reportAttributeAccessIssue]
        example.features.feature["text"].int64_list.value.extend(tokens)
        self._writer.write(example.SerializeToString())
        self.sequences += 1
        self.tokens += len(tokens)
        self._in_shard += 1
        if self._in_shard == self.per_shard:
            self.close()

    def close(self) -> None:
        """Finish the open shard, if any."""
        if self._writer is not None:
            self._writer.close()
            self._writer, self._in_shard = None, 0


def fingerprint(key: str, sources: list[dict[str, Any]]) -> str:
    """SHA-256 over the recipe key and every source's name and content identity: its SHA-256 (local files), else
    what Cloud Storage keeps of it (:func:`multislice.trainer.prepare_shards.source_identity`)."""
    text = json.dumps([key, [(s["path"], s.get("sha256") or s["identity"]) for s in sources]], sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def prepare(
    data: TextData,
    tokenizer: TokenizerSpec,
    max_target_length: int,
    out_dir: str,
    say: Callable[[str], None] = print,
    site_packages: str | None = None,
    *,
    sources: list[dict[str, Any]] | None = None,
    part: bool = False,
) -> dict[str, Any]:
    """Tokenize ``data`` into ArrayRecord shards in ``out_dir`` (local or ``gs://``), or reuse them; the manifest.

    ``sources``: the files already listed, each ``{"path", "bytes", "_local", "sha256" or "identity"}``
    (:func:`multislice.trainer.prepare_shards.list_sources`); None: ``data.files`` expanded here, each file
    SHA-256'd. ``part``: one shard worker's range of a larger preparation (:mod:`.prepare_shards`): a split may
    be empty, and the token counts per id are kept beside the shards (:data:`COUNTS`) for the coordinator.

    Raises:
        FileNotFoundError: the globs match no file.
    """
    import numpy as np  # the token counts only: the pipeline image imports this module for its names (0.3-0.8 s)

    started = time.monotonic()
    if sources is None:
        files = expand_files(data.files, data.exclude, site_packages)
        if not files:
            raise FileNotFoundError(f"data.files {list(data.files)} match no file")
        root = resolve_path("site-packages:", site_packages)
        sources = []
        for path in files:
            digest, size = file_sha256(path)
            shown = "site-packages:" + path.removeprefix(root) if path.startswith(root) else path
            sources.append({"path": shown, "sha256": digest, "bytes": size, "_local": path})
    key = recipe_key(data, tokenizer, max_target_length)
    print_sources = [{k: v for k, v in s.items() if k != "_local"} for s in sources]
    wanted = fingerprint(key, print_sources)
    from etils import epath

    target = epath.Path(out_dir)
    old = json.loads((target / MANIFEST).read_text()) if (target / MANIFEST).exists() else None
    if old and old.get("fingerprint") == wanted and all((target / s).exists() for s in old["shards"]):
        old.update(reused=True, seconds=round(time.monotonic() - started, 2))
        say(
            f"reusing {old['shard_count']} shards in {out_dir}: same {len(sources)} source files (SHA-256) "
            f"and tokenizer, {old['token_count']:,} tokens; nothing tokenized"
        )
        return old

    from maxtext.input_pipeline.tokenizer import build_tokenizer

    model = build_tokenizer(resolve_path(tokenizer.path, site_packages), tokenizer.type, False, False, None)
    vocab = vocab_size(model)
    say(f"tokenizing {len(sources)} files ({sum(s['bytes'] for s in sources):,} bytes) with {tokenizer.path}")
    remote = out_dir.startswith("gs://")
    # Written aside, then moved into place whole: runs sharing an output directory (and so this recipe's
    # directory) may prepare at the same time; the directory appears complete or not at all.
    local = (
        tempfile.mkdtemp(prefix="prepare-data-") if remote else f"{out_dir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    )
    os.makedirs(local, exist_ok=True)
    writers = {split: ShardWriter(local, split, data.shard_sequences) for split in ("train", "eval")}
    buffers: dict[str, list[int]] = {"train": [], "eval": []}
    counts = np.zeros(vocab, dtype=np.int64)
    documents_seen = {"train": 0, "eval": 0}
    length = max_target_length

    def flush(split: str, final: bool) -> None:
        buffer = buffers[split]
        whole = len(buffer) - len(buffer) % length
        for start in range(0, whole, length):
            writers[split].add(buffer[start : start + length])
        del buffer[:whole]
        if final and buffer:
            # A 1-token piece (a lone EOS after a full piece) predicts nothing once MaxText shifts the targets.
            if len(buffer) > 1:
                writers[split].add(list(buffer))
            buffer.clear()

    for source in sources:
        # a text file is one document, split by its SHA-256: read here when the store gave no SHA-256 (gs://)
        file_digest = source.get("sha256") or (file_sha256(source["_local"])[0] if data.format == "text" else "")
        for digest, chunks in documents(source["_local"], data, file_digest):
            split = "eval" if in_eval(digest, data.eval_fraction) else "train"
            documents_seen[split] += 1
            buffer = buffers[split]
            if tokenizer.add_bos:
                buffer.append(model.bos_id)
            for chunk in chunks:
                ids = model.encode(chunk)
                counts += np.bincount(np.asarray(ids, dtype=np.int64), minlength=vocab)[:vocab]
                buffer.extend(ids)
                flush(split, final=False)
            if tokenizer.add_eos:
                buffer.append(model.eos_id)
            flush(split, final=not data.concatenate)  # a document's last piece is its own record
    for split in writers:
        flush(split, final=True)
        writers[split].close()
    if not part and (not writers["eval"].sequences or not writers["train"].sequences):
        empty = "eval" if not writers["eval"].sequences else "train"
        shutil.rmtree(local, ignore_errors=True)
        raise ValueError(
            f"the {empty} split got no document ({documents_seen}); with {len(sources)} files, raise "
            "data.eval_fraction or give more files (format text: each file is one document)"
        )
    total = int(counts.sum())
    p = counts[counts > 0] / max(total, 1)
    shards = [*writers["train"].shards, *writers["eval"].shards]
    manifest = {
        "format_version": FORMAT_VERSION,
        "recipe_key": key,
        "fingerprint": wanted,
        "uri": out_dir,
        "format": "arrayrecord of tf.train.Example, feature text: int64 token ids (tokenize_train_data=false)",
        "tokenizer": {**tokenizer.model_dump(), "vocab_size": vocab},
        "max_target_length": max_target_length,
        "packing": data.packing,
        "concatenate": data.concatenate,
        "sources": print_sources,
        "source_bytes": sum(s["bytes"] for s in sources),
        "splits": {
            split: {
                "documents": documents_seen[split],
                "sequences": w.sequences,
                "tokens": w.tokens,
                **row_counts(w.sequences, w.tokens, max_target_length),
                "shards": w.shards,
            }
            for split, w in writers.items()
        },
        "token_count": writers["train"].tokens + writers["eval"].tokens,
        "shard_count": len(shards),
        "shards": shards,
        "unigram_entropy_nats": round(float(-(p * np.log(p)).sum()), 4),
        "reused": False,
        "seconds": round(time.monotonic() - started, 2),
    }
    manifest["tokens_per_second"] = round(total / max(manifest["seconds"], 1e-9))
    if part:
        Path(local, COUNTS).write_text(json.dumps({str(i): int(counts[i]) for i in np.flatnonzero(counts)}))
    manifest = _publish(local, out_dir, [*shards, COUNTS] if part else shards, manifest)
    say(
        f"wrote {len(shards)} shards to {out_dir}: {manifest['token_count']:,} tokens "
        f"(train {writers['train'].sequences} records, eval {writers['eval'].sequences}; "
        + (
            "documents concatenated, no padding"
            if data.concatenate
            else f"one document a record: {manifest['splits']['train']['padding_fraction_unpacked']:.1%} padding "
            "where MaxText cannot pack"
        )
        + f") in {manifest['seconds']} s; "
        f"unigram entropy {manifest['unigram_entropy_nats']} nats (ln vocab {math.log(vocab):.2f})"
    )
    return manifest


def row_counts(records: int, tokens: int, max_target_length: int) -> dict[str, Any]:
    """What ``records`` records of ``tokens`` tokens in all become in MaxText's rows of ``max_target_length`` tokens.

    Returns:
        ``rows_unpacked``: rows with MaxText's ``packing: false`` (one record a row, padded; its elastic
        iterator's case); ``padding_tokens_unpacked`` and ``padding_fraction_unpacked``: the pad tokens those rows
        hold, and their share of all the rows' tokens; ``rows_packed_at_least``: rows with ``packing: true``, at
        least (``ceil(tokens / max_target_length)``: first-fit packing leaves a row's tail empty when no record
        left in its bins fits).
    """
    capacity = records * max_target_length
    return {
        "rows_unpacked": records,
        "padding_tokens_unpacked": capacity - tokens,
        "padding_fraction_unpacked": round((capacity - tokens) / capacity, 4) if capacity else 0.0,
        "rows_packed_at_least": -(-tokens // max_target_length),
    }


def _publish(local: str, out_dir: str, shards: list[str], manifest: dict[str, Any]) -> dict[str, Any]:
    """Move the shards written in ``local`` to ``out_dir``, the manifest last; the manifest in place.

    Local: one directory rename (atomic); when another run put the same fingerprint there first, its shards
    are kept and ours dropped; an older preparation (other sources) is renamed away and removed. ``gs://``:
    the shards are copied, then the manifest (Cloud Storage has no directory rename).
    """
    Path(local, MANIFEST).write_text(json.dumps(manifest, indent=1))
    if out_dir.startswith("gs://"):
        from etils import epath

        for name in [*shards, MANIFEST]:
            epath.Path(local, name).copy(epath.Path(out_dir) / name, overwrite=True)
        shutil.rmtree(local, ignore_errors=True)
        return manifest
    os.makedirs(os.path.dirname(out_dir) or ".", exist_ok=True)
    try:
        os.rename(local, out_dir)
        return manifest
    except OSError:
        pass
    existing = Path(out_dir, MANIFEST)
    if existing.exists() and json.loads(existing.read_text()).get("fingerprint") == manifest["fingerprint"]:
        shutil.rmtree(local, ignore_errors=True)  # a run beside this one prepared the same data first
        return json.loads(existing.read_text())
    retired = f"{out_dir}.old-{uuid.uuid4().hex[:8]}"
    os.rename(out_dir, retired)
    os.rename(local, out_dir)
    shutil.rmtree(retired, ignore_errors=True)
    return manifest


def vocab_size(model: Any) -> int:
    """The vocabulary size of a tokenizer MaxText's ``build_tokenizer`` made: its token ids are below it.

    Each of MaxText's classes keeps it elsewhere (``maxtext/input_pipeline/tokenizer.py``): ``TikTokenTokenizer``
    as ``n_words``; ``SentencePieceTokenizer`` in its sentencepiece processor (``GetPieceSize``);
    ``HFTokenizer`` in its transformers tokenizer (``len``: added tokens included).
    """
    from maxtext.input_pipeline.tokenizer import HFTokenizer, SentencePieceTokenizer, TikTokenTokenizer

    if isinstance(model, TikTokenTokenizer):
        return int(model.n_words)
    if isinstance(model, SentencePieceTokenizer):
        return int(model._tokenizer_model.GetPieceSize())
    if isinstance(model, HFTokenizer):
        return len(model.tokenizer)
    raise TypeError(f"not one of MaxText's tokenizers: {type(model).__name__}")


def main(argv: list[str] | None = None) -> int:
    """Run :func:`prepare` for a JSON request; prints progress and, last, ``MANIFEST <json>``."""
    parser = argparse.ArgumentParser(
        prog="python -m multislice.trainer.prepare_data", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--request", required=True, help="JSON: data, tokenizer, max_target_length, out_dir")
    args = parser.parse_args(argv)
    request = json.loads(args.request)
    manifest = prepare(
        TextData.model_validate(request["data"]),
        TokenizerSpec.model_validate(request["tokenizer"]),
        int(request["max_target_length"]),
        request["out_dir"],
        say=lambda m: print(f"prepare_data: {m}", flush=True),
    )
    print("MANIFEST " + json.dumps(manifest), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
