"""prepare_data over shard workers: list the sources, split them into ranges, tokenize each range, assemble.

The three roles (the step calls the first and the last; the backend runs the middle one,
:meth:`multislice.backends.base.Backend.run_data_workers`):

1. **List** (:func:`list_sources`, :func:`work_request`; the step, in any environment): every source file with
   what the store already knows of it, no byte read: on ``gs://`` its size, ``generation`` and ``crc32c`` from
   the listing (gcsfs keeps the listing's object resources: ``fs.info`` answers from it), locally its size,
   ``st_mtime_ns``, ``st_ctime_ns`` and inode, and a SHA-256 cached under those
   (:func:`cached_sha256`: computed again only for a file that changed). The run's ``fingerprint`` is over the
   recipe and these identities (:func:`multislice.trainer.prepare_data.fingerprint`: a local file's SHA-256,
   else ``crc32c:<base64>:<bytes>``, the content's and not the upload's, so a re-upload of the same bytes keeps
   it). A ``manifest.json`` in the recipe's directory with that fingerprint is reused (:func:`reusable`) without
   starting a worker. Else the files are cut into ``data.workers`` contiguous ranges of about equal bytes
   (:func:`split_ranges`), written with the listing to ``<parts_dir>/sources.json``.
2. **Tokenize** (:func:`worker`, ``python -m multislice.trainer.prepare_shards worker``; the trainer
   environment: MaxText's tokenizer): worker ``i`` (``--index``, else ``$JOB_COMPLETION_INDEX``, which the Job
   controller gives each pod of an Indexed Job) runs :func:`multislice.trainer.prepare_data.prepare` on range
   ``i`` into ``<parts_dir>/part-<i>-of-<n>``: the same records, the same packing, its own shards and manifest,
   plus its token counts per id. A worker run again (a retried pod) on a finished part reuses it.
3. **Assemble** (:func:`assemble`; the step): the parts' shards are renumbered in range order into the recipe's
   directory (``train-NNNNN.array_record``, ``eval-NNNNN.array_record``: the names and records a one-process
   preparation writes, so ``grain_train_files`` and MaxText's grain pipeline read them unchanged), the
   manifest summed from the parts' (unigram entropy from their summed counts) and written last; the parts are
   removed. Locally a rename of each file and of the directory; on ``gs://`` a server-side copy (``rewrite``) of
   each object, the manifest last.

A record is one document, or a piece of one (:mod:`multislice.trainer.prepare_data`; MaxText packs them when it
reads), so the ranges change where the shards split, not the records. With ``data.concatenate: true`` the
documents are concatenated per range: a range's last sequence of each split may be short (at most
``workers - 1`` more short sequences than one process writes).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

from multislice import storage
from multislice.config.data import SITE_PACKAGES_PREFIX, TextData, TokenizerSpec, expand_files, recipe_key, resolve_path
from multislice.trainer import prepare_data as work

#: The listing and ranges the workers read, in the parts directory.
SOURCES = "sources.json"
#: The environment variable the Job controller sets to a pod's completion index (kubernetes
#: ``pkg/controller/job/indexed_job_utils.go``, ``addCompletionIndexEnvVariable``: ``JOB_COMPLETION_INDEX``
#: from the pod's ``batch.kubernetes.io/job-completion-index`` label or annotation).
INDEX_ENV = "JOB_COMPLETION_INDEX"
#: The prefix of the lines a worker prints for the step to pass on.
SAY = "prepare_data: "
#: The last line a worker prints: its part's manifest.
PART = "PART "


def default_hash_cache() -> str:
    """Where local files' SHA-256 are cached: ``$MULTISLICE_CACHE_DIR`` or ``$XDG_CACHE_HOME/multislice`` (default
    ``~/.cache/multislice``), file ``source-sha256.json``."""
    root = os.environ.get("MULTISLICE_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "multislice"
    )
    return os.path.join(root, "source-sha256.json")


def cached_sha256(paths: list[str], cache_file: str | None = None) -> tuple[list[str], int]:
    """SHA-256 hex of each local file, from ``cache_file`` where its stat is the one cached; ``(digests, files read)``.

    The cache key is the file's real path; its entry ``[size, st_mtime_ns, st_ctime_ns, st_ino, sha256]``. A file
    whose stat differs (written, replaced, touched) is read and hashed again; the cache is rewritten (atomically:
    :func:`multislice.storage.write_text`) when anything was.
    """
    cache_file = cache_file or default_hash_cache()
    try:
        cache = json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        cache = {}
    digests, read = [], 0
    for path in paths:
        real = os.path.realpath(path)
        stat = os.stat(real)
        key = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
        entry = cache.get(real)
        if entry and entry[:4] == key:
            digests.append(entry[4])
            continue
        digest, _ = work.file_sha256(real)
        cache[real] = [*key, digest]
        digests.append(digest)
        read += 1
    if read:
        try:
            storage.write_text(cache_file, json.dumps(cache))
        except OSError:
            pass  # a read-only home: the next run hashes again
    return digests, read


def source_identity(path: str) -> dict[str, Any]:
    """What Cloud Storage knows of object ``path`` (``gs://``): ``bytes``, ``generation``, ``crc32c`` (base64, as
    the JSON API's object resource has it) and ``identity`` ``crc32c:<crc32c>:<bytes>``.

    From gcsfs' cache of the listing that matched the glob (``fs.info`` reads it; one ``objects.get`` when the
    listing was not cached).
    """
    import fsspec  # gcsfs' filesystem: only for gs:// sources (its import is the gcsfs one, 0.3 s)

    info = fsspec.filesystem("gs").info(path)
    crc = info.get("crc32c") or ""
    size = int(info["size"])
    return {"bytes": size, "generation": str(info.get("generation", "")), "crc32c": crc,
            "identity": f"crc32c:{crc}:{size}"}  # fmt: skip


def list_sources(
    data: TextData, site_packages: str | None = None, cache_file: str | None = None
) -> list[dict[str, Any]]:
    """Every file of ``data`` with its identity, no byte of a ``gs://`` object read: ``[{"path" (as shown:
    ``site-packages:`` kept), "_local" (the path to open), "bytes", and "sha256" (local) or "identity",
    "generation", "crc32c" (gs://)}]``, in sorted path order.

    Raises:
        FileNotFoundError: the globs match no file.
    """
    files = expand_files(data.files, data.exclude, site_packages)
    if not files:
        raise FileNotFoundError(f"data.files {list(data.files)} match no file")
    root = resolve_path(SITE_PACKAGES_PREFIX, site_packages)
    local = [f for f in files if not storage.is_remote(f)]
    digests = dict(zip(local, cached_sha256(local, cache_file)[0], strict=True))
    sources = []
    for path in files:
        shown = SITE_PACKAGES_PREFIX + path.removeprefix(root) if path.startswith(root) else path
        if path in digests:
            sources.append({"path": shown, "sha256": digests[path], "bytes": os.path.getsize(path), "_local": path})
        else:
            sources.append({"path": shown, **source_identity(path), "_local": path})
    return sources


def split_ranges(sizes: list[int], workers: int) -> list[tuple[int, int]]:
    """Cut files of ``sizes`` (bytes, in order) into at most ``workers`` contiguous, non-empty ``[start, end)``
    ranges of about equal bytes: each range takes files while it stays within an equal share of the bytes left
    (at least one file, and leaving one to each range after it). ``min(workers, len(sizes))`` ranges.

    Raises:
        ValueError: no file, or ``workers`` below 1.
    """
    if not sizes or workers < 1:
        raise ValueError(f"cannot split {len(sizes)} files into {workers} ranges")
    count = min(workers, len(sizes))
    weights = sizes if sum(sizes) else [1] * len(sizes)  # empty files only: by count
    total = sum(weights)
    ranges, start, seen = [], 0, 0
    for k in range(count - 1):
        target = seen + (total - seen) / (count - k)  # an equal share of what is left
        end, seen = start + 1, seen + weights[start]
        while end < len(sizes) - (count - 1 - k) and seen + weights[end] <= target:
            seen, end = seen + weights[end], end + 1
        ranges.append((start, end))
        start = end
    ranges.append((start, len(sizes)))
    return ranges


def reusable(out_dir: str, wanted: str) -> dict[str, Any] | None:
    """The manifest in ``out_dir`` when its fingerprint is ``wanted`` and its shards are all there, else None."""
    old = storage.read_json(storage.join(out_dir, work.MANIFEST))
    if not old or old.get("fingerprint") != wanted:
        return None
    if not all(storage.path(storage.join(out_dir, name)).exists() for name in old.get("shards", [])):
        return None
    return old


def fingerprint_of(
    data: TextData, tokenizer: TokenizerSpec, max_target_length: int, sources: list[dict[str, Any]]
) -> str:
    """The preparation's fingerprint: the recipe (:func:`multislice.config.data.recipe_key`) and every source's
    path and identity (:func:`multislice.trainer.prepare_data.fingerprint`)."""
    shown = [{k: v for k, v in s.items() if k != "_local"} for s in sources]
    return work.fingerprint(recipe_key(data, tokenizer, max_target_length), shown)


def work_request(
    data: TextData, tokenizer: TokenizerSpec, max_target_length: int, out_dir: str, sources: list[dict[str, Any]]
) -> dict[str, Any]:
    """The workers' request, after :data:`SOURCES` (listing, ranges, fingerprint) is written to its parts directory.

    ``{"data", "tokenizer", "max_target_length", "out_dir", "parts_dir", "fingerprint", "workers" (ranges)}``;
    ``parts_dir`` is ``<out_dir>.parts-<fingerprint[:16]>``: beside the recipe's directory, one per source set.
    """
    wanted = fingerprint_of(data, tokenizer, max_target_length, sources)
    ranges = split_ranges([int(s["bytes"]) for s in sources], data.workers)
    parts_dir = f"{out_dir}.parts-{wanted[:16]}"
    storage.write_text(
        storage.join(parts_dir, SOURCES), json.dumps({"fingerprint": wanted, "ranges": ranges, "sources": sources})
    )
    return {
        "data": data.model_dump(mode="json"), "tokenizer": tokenizer.model_dump(mode="json"),
        "max_target_length": max_target_length, "out_dir": out_dir, "parts_dir": parts_dir, "fingerprint": wanted,
        "workers": len(ranges),
    }  # fmt: skip


def part_dir(request: dict[str, Any], index: int) -> str:
    """Where worker ``index`` writes its part: ``<parts_dir>/part-<index>-of-<workers>``."""
    return storage.join(request["parts_dir"], f"part-{index:05d}-of-{int(request['workers']):05d}")


def worker(request: dict[str, Any], index: int, say: Callable[[str], None] = print) -> dict[str, Any]:
    """Tokenize range ``index`` of the request's sources into its part directory (or reuse it); the part's manifest.

    Raises:
        ValueError: ``index`` is not one of the request's ranges.
        FileNotFoundError: :data:`SOURCES` is missing (the step did not write it, or the parts were removed).
    """
    listing = storage.read_json(storage.join(request["parts_dir"], SOURCES))
    if listing is None:
        raise FileNotFoundError(f"{storage.join(request['parts_dir'], SOURCES)} does not exist")
    if not 0 <= index < len(listing["ranges"]):
        raise ValueError(f"shard worker index {index} is not in 0..{len(listing['ranges']) - 1}")
    start, end = listing["ranges"][index]
    sources = listing["sources"][start:end]
    data = TextData.model_validate(request["data"])
    say(f"shard worker {index}: {end - start} files ({sum(int(s['bytes']) for s in sources):,} bytes)")
    return work.prepare(
        data, TokenizerSpec.model_validate(request["tokenizer"]), int(request["max_target_length"]),
        part_dir(request, index), say=say, sources=sources, part=True,
    )  # fmt: skip


def assemble(request: dict[str, Any], started: float, say: Callable[[str], None] = print) -> dict[str, Any]:
    """The coordinator: move the parts' shards into ``out_dir`` renumbered, write the manifest last, remove the
    parts; the manifest (the keys a one-process preparation writes, plus ``workers`` and ``parts``).

    ``started``: ``time.monotonic()`` when the step began (the manifest's ``seconds``).

    Raises:
        FileNotFoundError: a part has no manifest (its worker did not finish).
        ValueError: a split got no document in any part (the same message a one-process preparation gives).
    """
    listing = storage.read_json(storage.join(request["parts_dir"], SOURCES))
    count = int(request["workers"])
    parts = []
    for index in range(count):
        found = storage.read_json(storage.join(part_dir(request, index), work.MANIFEST))
        if found is None:
            raise FileNotFoundError(f"shard worker {index} left no manifest in {part_dir(request, index)}")
        parts.append(found)
    counts: Counter[int] = Counter()
    for index in range(count):
        counts.update({int(k): v for k, v in (storage.read_json(storage.join(part_dir(request, index), work.COUNTS))
                                              or {}).items()})  # fmt: skip
    moves: list[tuple[str, str]] = []  # (part's file, name in out_dir)
    splits: dict[str, dict[str, Any]] = {}
    for split in ("train", "eval"):
        names: list[str] = []
        for index, part in enumerate(parts):
            for name in part["splits"][split]["shards"]:
                names.append(f"{split}-{len(names):05d}.array_record")
                moves.append((storage.join(part_dir(request, index), name), names[-1]))
        totals = {key: sum(p["splits"][split][key] for p in parts) for key in ("documents", "sequences", "tokens")}
        splits[split] = {
            **totals,
            # the rows MaxText makes of all the parts' records (one record per document piece: packing is MaxText's)
            **work.row_counts(totals["sequences"], totals["tokens"], int(parts[0]["max_target_length"])),
            "shards": names,
        }
    sources = [{k: v for k, v in s.items() if k != "_local"} for s in (listing or {}).get("sources", [])]
    if not splits["eval"]["sequences"] or not splits["train"]["sequences"]:
        empty = "eval" if not splits["eval"]["sequences"] else "train"
        raise ValueError(
            f"the {empty} split got no document ({ {s: splits[s]['documents'] for s in splits} }); with "
            f"{len(sources)} files, raise data.eval_fraction or give more files (format text: each file is one "
            "document)"
        )
    total = sum(counts.values())
    entropy = -sum(c / total * math.log(c / total) for c in counts.values() if c) if total else 0.0
    shards = [*splits["train"]["shards"], *splits["eval"]["shards"]]
    seconds = round(time.monotonic() - started, 2)
    manifest = {
        "format_version": work.FORMAT_VERSION,
        "recipe_key": parts[0]["recipe_key"],
        "fingerprint": request["fingerprint"],
        "uri": request["out_dir"],
        "format": parts[0]["format"],
        "tokenizer": parts[0]["tokenizer"],
        "max_target_length": parts[0]["max_target_length"],
        "packing": parts[0]["packing"],
        "concatenate": parts[0].get("concatenate", False),
        "sources": sources,
        "source_bytes": sum(int(s["bytes"]) for s in sources),
        "splits": splits,
        "token_count": splits["train"]["tokens"] + splits["eval"]["tokens"],
        "shard_count": len(shards),
        "shards": shards,
        "unigram_entropy_nats": round(entropy, 4),
        "reused": False,
        "seconds": seconds,
        "tokens_per_second": round(total / max(seconds, 1e-9)),
        "workers": count,
        "parts": [
            {"index": i, "sources": len(p["sources"]), "tokens": p["token_count"], "seconds": p["seconds"],
             "reused": bool(p.get("reused"))}
            for i, p in enumerate(parts)
        ],
    }  # fmt: skip
    manifest = _publish_parts(moves, request["out_dir"], shards, manifest)
    storage.path(request["parts_dir"]).rmtree(missing_ok=True)
    say(
        f"assembled {len(shards)} shards from {count} shard workers in {request['out_dir']}: "
        f"{manifest['token_count']:,} tokens (train {splits['train']['sequences']} sequences, eval "
        f"{splits['eval']['sequences']})"
    )
    return manifest


def _publish_parts(
    moves: list[tuple[str, str]], out_dir: str, shards: list[str], manifest: dict[str, Any]
) -> dict[str, Any]:
    """Put each part's file at its name in ``out_dir``, the manifest last; the manifest in place.

    Local: the files are renamed into a directory beside ``out_dir``, which then replaces it as a one-process
    preparation's does (:func:`multislice.trainer.prepare_data._publish`). ``gs://``: each object copied server-side
    (gcsfs ``copy``: the JSON API's ``objects.rewrite``), then the manifest written.
    """
    if storage.is_remote(out_dir):
        for source, name in moves:
            storage.path(source).copy(storage.path(storage.join(out_dir, name)), overwrite=True)
        storage.write_text(storage.join(out_dir, work.MANIFEST), json.dumps(manifest, indent=1))
        return manifest
    local = f"{out_dir}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    os.makedirs(local)
    try:
        for source, name in moves:
            os.rename(source, os.path.join(local, name))
        return work._publish(local, out_dir, shards, manifest)  # noqa: SLF001 - the one-process publish, shared
    finally:
        shutil.rmtree(local, ignore_errors=True)


def worker_command(request: dict[str, Any], python: str = "python", index: int | None = None) -> list[str]:
    """The argv of one shard worker: ``python -m multislice.trainer.prepare_shards worker --request <json>``,
    with ``--index`` when given (else the worker reads :data:`INDEX_ENV`)."""
    argv = [python, "-m", "multislice.trainer.prepare_shards", "worker", "--request", json.dumps(request)]
    return argv if index is None else [*argv, "--index", str(index)]


def main(argv: list[str] | None = None) -> int:
    """``worker --request JSON [--index I]``: run :func:`worker`; prints progress lines (:data:`SAY`) and, last,
    ``PART <manifest json>``. Exit status 0, or 1 with the reason on stderr."""
    parser = argparse.ArgumentParser(prog="python -m multislice.trainer.prepare_shards", description="a shard worker")
    parser.add_argument("role", choices=["worker"])
    parser.add_argument("--request", required=True, help="JSON from work_request")
    parser.add_argument("--index", type=int, default=None, help=f"the range to tokenize (default ${INDEX_ENV})")
    args = parser.parse_args(argv)
    index = args.index if args.index is not None else int(os.environ.get(INDEX_ENV, "-1"))
    try:
        manifest = worker(json.loads(args.request), index, say=lambda m: print(SAY + m, flush=True))
    except (OSError, ValueError) as error:
        print(f"shard worker {index} failed: {error}", file=sys.stderr, flush=True)
        return 1
    print(PART + json.dumps({k: v for k, v in manifest.items() if k != "sources"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
