"""Checkpoint digests: a CRC-32C of every file of a committed Orbax step, recorded when it commits.

Neither Orbax nor MaxText records a checksum of what a checkpoint holds:
Orbax 0.12's Zarr v3 layout checksums only the shard index (``crc32c`` in
``index_codecs``, ``orbax/checkpoint/_src/serialization/tensorstore_utils.py``),
and OCDBT checksums its B+tree and version nodes but not the values stored in
its data files (the OCDBT format, ``tensorstore/kvstore/ocdbt``). A few bytes
changed in an array's chunk read back as other, often finite, numbers. So the
leader process of a stage records, per committed step, a digest of every file
of the step directory, and the verifier checks them before anything else.

**What is recorded** (:data:`DIGEST_FILE` in the step directory, JSON, format
:data:`FORMAT`): per file (path relative to the step directory) its size in
bytes and CRC-32C (base64 of the big-endian 4 bytes: the form Cloud Storage
keeps in an object's ``crc32c``); and, read from the OCDBT B+tree of
``items/manifest.ocdbt`` with ``tensorstore.ocdbt.dump``, where each array's
chunks lie: ``arrays[name] = [[file, offset, length, crc32c|None], ...]`` for a
chunk stored in a data file, or ``[[node file, None, None, None]]`` for one
inline in a B+tree node. So a damaged file is mapped to the arrays it holds,
and (where the chunks' own CRC-32C were recorded) to the very array whose
bytes changed. ``name`` is Orbax's ``param_name``, the tree path with dots
(``opt_state.0.mu.params.decoder.norm.scale``).

**Per file, and per chunk where it is cheap.** A local (or mounted) checkpoint
is read once: each file's CRC-32C and each chunk's come from the same bytes.
On ``gs://`` no byte is read: Cloud Storage computes every object's CRC-32C
when it is written and lists it with the object (``crc32c`` in the JSON API's
object resource), so the record is one listing plus the B+tree nodes, whatever
the checkpoint's size (a Llama 3 70B stage's 840 GB of parameters and Adam
state would be a long read per save); the verifier then names the damaged
object and the arrays it holds, not the chunk.

**When.** A step is recorded once it is committed (``commit_success.txt`` in
it: :func:`multislice.storage.committed_steps`, Orbax's own rule), by a thread
of the stage's leader process only (:class:`DigestRecorder`), never inside an
uncommitted (temporary) step directory, so it never races Orbax's writes; the
file is written whole (a rename locally, one upload on Cloud Storage) and only
if the step is still there. Orbax never writes into a committed step, and a
step deleted later (``max_to_keep``; the elastic controller's
``discard_unlogged_checkpoints``) takes its digests with it.

**Which checkpoints have records.** Once it has recorded a step, the recorder
writes :data:`LEDGER_FILE` in the checkpoint directory itself (beside the step
directories; Orbax lists only directories named by a step): a checkpoint
directory written by this project's trainer says so there, so a step of it
without its record is one whose record was deleted (or never written), which
the verifier fails, rather than a checkpoint from elsewhere, which it can
only say it could not check.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from typing import Any, cast

from multislice import storage

#: The digest record in each committed step directory.
DIGEST_FILE = "multislice_digests.json"
#: The ledger in the checkpoint directory (beside the steps): its steps are recorded by this project's trainer.
LEDGER_FILE = "multislice_digests_ledger.json"
#: Who writes the records, as the ledger names it.
WRITER = "multislice-pipelines"
#: Orbax's step metadata, written at each commit (with the commit time): identifies the commit a record is of.
CHECKPOINT_METADATA = "_CHECKPOINT_METADATA"
#: Version of the record's layout.
FORMAT = 1
#: Seconds between the recorder's looks at the checkpoint directory (a listing; a step is read once).
POLL_SECONDS = 5.0
#: Bytes read at a time when a file's CRC-32C is computed.
READ_BYTES = 8 * 1024**2


def _is_remote(location: Any) -> bool:
    return "://" in str(location)


#: The item directory of a checkpoint step: ``items`` (MaxText's standard Orbax checkpointer), or ``default``
#: (MaxText with emergency checkpoints: the persistent tier is an Orbax ``CheckpointManager`` with one unnamed item,
#: ``orbax/checkpoint/checkpoint_manager.py`` ``DEFAULT_ITEM_NAME = 'default'``; the emergency manager restores from
#: ``<step>/default``, ``orbax/checkpoint/experimental/emergency/checkpoint_manager.py``, ``_restore_from_persistent``).
ITEM_DIRS: tuple[str, ...] = ("items", "default")


def item_dir(step_dir: Any) -> Any:
    """The item directory of checkpoint step ``step_dir`` (an ``etils.epath.Path`` or ``pathlib.Path``): the first of
    :data:`ITEM_DIRS` that exists, else ``<step_dir>/items`` (whose absence the caller reports)."""
    for name in ITEM_DIRS:
        if (step_dir / name).is_dir():
            return step_dir / name
    return step_dir / ITEM_DIRS[0]


def _path(location: Any) -> Any:
    from etils import epath

    return epath.Path(location)


def _ignored(name: str) -> bool:
    """The record itself and a scratch copy of it being written."""
    return name == DIGEST_FILE or name.startswith(f".{DIGEST_FILE}")


def list_files(step_dir: Any) -> dict[str, Any]:
    """Every file under ``step_dir`` but the record: ``relative path -> path``, sorted."""
    found: dict[str, Any] = {}

    def walk(directory: Any, prefix: str) -> None:
        for entry in directory.iterdir():
            relative = f"{prefix}{entry.name}"
            if entry.is_dir():
                walk(entry, f"{relative}/")
            elif not _ignored(entry.name):
                found[relative] = entry

    walk(_path(step_dir), "")
    return dict(sorted(found.items()))


def _object_digests(step_dir: Any) -> dict[str, tuple[int, str]]:
    """``relative path -> (size, crc32c)`` of every object under a ``gs://`` step directory, from one listing."""
    import gcsfs

    root = str(step_dir).rstrip("/")
    fs = gcsfs.GCSFileSystem()
    fs.invalidate_cache(root)  # gcsfs caches listings; this one must be of now
    found = cast(dict[str, dict[str, Any]], fs.find(root, detail=True))  # detail=True: name -> info
    bare = root.removeprefix("gs://")
    digests = {}
    for name, info in found.items():
        relative = name.removeprefix("gs://").removeprefix(bare).lstrip("/")
        if relative and info.get("type") != "directory" and not _ignored(relative.rsplit("/", 1)[-1]):
            digests[relative] = (int(info["size"]), str(info["crc32c"]))
    return digests


def file_digest(path: Any, ranges: Sequence[tuple[int, int]] = ()) -> tuple[int, str, dict[tuple[int, int], str]]:
    """Read a file once: ``(size in bytes, CRC-32C, {(offset, length): CRC-32C of those bytes})``.

    ``ranges`` are byte ranges (an OCDBT chunk's offset and length) whose own CRC-32C is wanted; a range
    beyond the end of the file gets none.
    """
    import google_crc32c

    whole = google_crc32c.Checksum()
    pending = sorted(set(ranges))
    partial: dict[tuple[int, int], Any] = {}
    done: dict[tuple[int, int], str] = {}
    position = 0
    with _path(path).open("rb") as stream:
        while True:
            block = stream.read(READ_BYTES)
            if not block:
                break
            whole.update(block)
            end = position + len(block)
            for offset, length in pending:
                if offset >= end:
                    break
                low, high = max(offset, position), min(offset + length, end)
                if low < high:
                    partial.setdefault((offset, length), google_crc32c.Checksum()).update(
                        block[low - position : high - position]
                    )
                    if high == offset + length:
                        done[(offset, length)] = base64.b64encode(partial[(offset, length)].digest()).decode()
            pending = [r for r in pending if r not in done]
            position = end
    return position, base64.b64encode(whole.digest()).decode(), done


def _kvstore_url(directory: Any) -> str:
    text = str(directory).rstrip("/") + "/"
    return text if _is_remote(text) else f"file://{os.path.abspath(text)}"


def _reference(location: str) -> tuple[str, int, int]:
    """``(file relative to the database directory, offset, length)`` of an OCDBT location.

    Form (``tensorstore.ocdbt.dump``): ``<kind>:<base path>:<relative path>:<offset>:<length>``,
    e.g. ``value:ocdbt.process_0/:d/39d7...:182056:182085``.
    """
    _kind, base, relative, offset, length = location.split(":")
    return f"{base}{relative}", int(offset), int(length)


def ocdbt_chunks(items_dir: Any) -> dict[str, list[list[Any]]]:
    """Where every key of an item's OCDBT database is stored, grouped by array.

    Walks the B+tree of ``items_dir/manifest.ocdbt`` (``tensorstore.ocdbt.dump``: the manifest, then each node).

    Returns:
        ``array name -> [[file, offset, length], ...]`` with ``file`` relative to ``items_dir``; a key stored
        inline in a B+tree node is ``[node file, None, None]``. The array name is the key up to its first ``/``
        (Orbax's ``param_name``; the rest is Zarr's ``zarr.json`` or chunk key).

    Raises:
        Exception: TensorStore's error when the manifest or a node cannot be read.
    """
    import tensorstore as ts

    base = ts.KvStore.open(_kvstore_url(items_dir)).result()
    manifest = ts.ocdbt.dump(base).result()
    versions = manifest.get("versions") or []
    chunks: dict[str, list[list[Any]]] = {}
    root = (versions[-1].get("root") or {}).get("location") if versions else None
    pending = [root] if root else []
    while pending:
        location = pending.pop()
        node_file = _reference(location)[0]
        node = ts.ocdbt.dump(base, location).result()
        for entry in node.get("entries", []):
            key = entry.get("key", b"")
            name = bytes(key).decode(errors="replace").split("/", 1)[0]
            if "location" in entry:  # an interior node's child
                pending.append(entry["location"])
            elif "indirect_value" in entry:
                chunks.setdefault(name, []).append(list(_reference(entry["indirect_value"])))
            elif [node_file, None, None] not in chunks.setdefault(name, []):
                chunks[name].append([node_file, None, None])
    return {name: sorted(found, key=lambda c: (c[0], c[1] or 0)) for name, found in sorted(chunks.items())}


def record(step_dir: Any) -> dict[str, Any]:
    """The digest record of a committed step directory (see the module's docstring); reads no byte on ``gs://``.

    Raises:
        Exception: a file vanished or could not be read (e.g. the step was deleted meanwhile).
    """
    step_dir = _path(step_dir)
    try:
        chunks = ocdbt_chunks(item_dir(step_dir))
        chunks_error = ""
    except Exception as error:  # noqa: BLE001 - the file digests still protect the step
        chunks, chunks_error = {}, summarize_error(error)
    arrays = {name: [[f"items/{f}", o, n, None] for f, o, n in found] for name, found in chunks.items()}
    files: dict[str, dict[str, Any]] = {}
    if _is_remote(step_dir):
        for relative, (size, digest) in _object_digests(step_dir).items():
            files[relative] = {"bytes": size, "crc32c": digest}
    else:
        wanted: dict[str, list[tuple[int, int]]] = {}
        for found in arrays.values():
            for file, offset, length, _ in found:
                if offset is not None:
                    wanted.setdefault(file, []).append((offset, length))
        for relative, path in list_files(step_dir).items():
            size, digest, parts = file_digest(path, wanted.get(relative, []))
            files[relative] = {"bytes": size, "crc32c": digest}
            for found in arrays.values():
                for chunk in found:
                    if chunk[0] == relative and chunk[1] is not None:
                        chunk[3] = parts.get((chunk[1], chunk[2]))
    result = {
        "format": FORMAT, "algorithm": "crc32c", "step": int(step_dir.name), "recorded_at": time.time(),
        "chunk_digests": not _is_remote(step_dir), "files": files, "arrays": arrays,
    }  # fmt: skip
    if chunks_error:
        result["arrays_error"] = chunks_error
    return result


def write_record(step_dir: Any) -> bool:
    """Record a committed step's digests in ``step_dir/DIGEST_FILE``; False when the step is gone or uncommitted.

    Never creates the step directory: a step deleted while it was read stays deleted.
    """
    step_dir = _path(step_dir)
    if not (step_dir / storage.COMMIT_FILE).exists():
        return False
    text = json.dumps(record(step_dir), indent=None, separators=(",", ":"))
    if not (step_dir / storage.COMMIT_FILE).exists():
        return False
    target = step_dir / DIGEST_FILE
    if _is_remote(step_dir):
        target.write_text(text, encoding="utf-8")
        return True
    scratch = step_dir / f".{DIGEST_FILE}.{os.getpid()}-{uuid.uuid4().hex[:8]}"
    try:
        scratch.write_text(text, encoding="utf-8")
        os.replace(scratch, target)
    except FileNotFoundError:
        return False
    finally:
        if scratch.exists():
            scratch.unlink()
    return True


def write_ledger(checkpoint_dir: Any) -> bool:
    """Write :data:`LEDGER_FILE` in ``checkpoint_dir`` unless it is there; True when it is there afterwards.

    JSON: ``format``, ``writer`` (:data:`WRITER`), ``digest_file`` (:data:`DIGEST_FILE`) and ``written_at`` (Unix
    seconds). Written whole (a rename locally, one upload on Cloud Storage); never creates ``checkpoint_dir``.

    Raises:
        OSError: it could not be written (the caller, the recorder, logs it).
    """
    directory = _path(checkpoint_dir)
    target = directory / LEDGER_FILE
    if target.exists():
        return True
    if not directory.is_dir():
        return False
    text = json.dumps(
        {"format": FORMAT, "writer": WRITER, "digest_file": DIGEST_FILE, "written_at": time.time()},
        separators=(",", ":"),
    )
    storage.write_text(target, text)  # one upload on Cloud Storage, else a rename (the directory exists)
    return True


def read_ledger(checkpoint_dir: Any) -> tuple[dict[str, Any] | None, str]:
    """``(ledger, "")`` of a checkpoint directory, ``(None, "absent")`` without one, or ``(None, why it is unusable)``.

    A ledger that is there but unreadable still says the directory was written with digests: the caller treats
    anything but ``"absent"`` as a ledger present.
    """
    return _read_json(
        _path(checkpoint_dir) / LEDGER_FILE,
        lambda data: data.get("writer") == WRITER,
        f"not a {WRITER} digest ledger",
    )


def is_current(step_dir: Any) -> bool:
    """Whether the step has a record and it is of this commit (its ``_CHECKPOINT_METADATA`` unchanged).

    A record left by a deleted step (a step discarded after an elastic resize and saved again) would
    describe other files: Orbax writes ``_CHECKPOINT_METADATA`` at each commit, with its commit time in it.
    """
    found, _ = read_record(step_dir)
    if found is None:
        return False
    expected = found["files"].get(CHECKPOINT_METADATA)
    try:
        size, digest, _ = file_digest(_path(step_dir) / CHECKPOINT_METADATA)
    except FileNotFoundError:
        return False
    return expected == {"bytes": size, "crc32c": digest}


#: What a TensorStore status code means for a checkpoint file (``absl::StatusCode``, as TensorStore's OCDBT and
#: file drivers use them: a value range past a file's end is OUT_OF_RANGE, an absent file NOT_FOUND, bytes that
#: do not decode DATA_LOSS or INVALID_ARGUMENT).
TENSORSTORE_MEANING = {
    "OUT_OF_RANGE": "a file is shorter than the OCDBT manifest says: truncated",
    "NOT_FOUND": "a file the OCDBT manifest refers to is missing",
    "DATA_LOSS": "stored bytes do not decode: damaged or garbage",
    "FAILED_PRECONDITION": "stored bytes do not decode: damaged or garbage",
}


def _short(text: str, limit: int) -> str:
    """``text`` without TensorStore's source locations, spec dumps and object reprs, cut at a word."""
    import re

    text = " ".join(text.split())
    text = re.sub(r" ?See full TensorStore details: .*$", "", text)
    text = re.sub(r" ?<bound method .*$", "", text)
    text = re.sub(r" ?\[(source locations|tensorstore_spec)='.*?'\]", "", text)
    text = re.sub(r" ?\[tensorstore_spec='.*$", "", text)
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0].rstrip(",;:") + " ..."
    return text


def summarize_error(error: BaseException, limit: int = 400) -> str:
    """An exception as one line: its message and, for Orbax's wrapper of a TensorStore error, the cause.

    Orbax raises ``Exception("Encountered error while reading array index ... See full TensorStore details:
    <bound method ...>")`` from TensorStore's ``ValueError("OUT_OF_RANGE: Error reading ...")``: the repr goes,
    the cause's text is kept (without its source locations), and its status code is said in words
    (:data:`TENSORSTORE_MEANING`). Nothing is cut inside a word.
    """
    import re

    chain, seen = [], set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        chain.append(current)
        current = current.__cause__ or current.__context__

    def meaning(message: str) -> str:
        code = re.match(r"([A-Z_]+): ", message)
        if not code or code.group(1) not in TENSORSTORE_MEANING:
            return ""
        if "has size of 0 bytes" in message:  # what an absent data file reads as through OCDBT
            return " (a file the OCDBT manifest refers to is missing or empty)"
        return f" ({TENSORSTORE_MEANING[code.group(1)]})"

    own = _short(str(error), limit)
    text = f"{type(error).__name__}: {own}"
    for cause in chain[1:]:
        message = _short(str(cause), limit)
        if re.match(r"([A-Z_]+): ", message):
            return f"{text}: {message}{meaning(message)}"
    return text + meaning(own)


def read_record(step_dir: Any) -> tuple[dict[str, Any] | None, str]:
    """``(record, "")``, ``(None, "absent")`` when the step has none, or ``(None, why it is unusable)``."""
    return _read_json(
        _path(step_dir) / DIGEST_FILE,
        lambda data: data.get("format") == FORMAT and isinstance(data.get("files"), dict),
        f"not a format-{FORMAT} digest record",
    )


def _read_json(target: Any, valid: Callable[[dict[str, Any]], bool], invalid: str) -> tuple[dict[str, Any] | None, str]:
    """``(object, "")`` of a JSON file whose object ``valid`` accepts, ``(None, "absent")`` when there is no file, or
    ``(None, "<file> unreadable: <why>")`` (``invalid`` when ``valid`` refuses it)."""
    try:
        text = target.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None, "absent"
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or not valid(data):
            raise ValueError(invalid)
    except ValueError as error:
        return None, f"{target} unreadable: {summarize_error(error)}"
    return data, ""


def _arrays_in(record_: dict[str, Any], relative: str) -> list[str]:
    return sorted(name for name, found in record_.get("arrays", {}).items() if any(c[0] == relative for c in found))


def _damaged_arrays(record_: dict[str, Any], relative: str, path: Any) -> list[str]:
    """Arrays whose recorded chunk CRC-32C in file ``relative`` differs now (chunk digests are local only)."""
    ranges = {
        (c[1], c[2]): (name, c[3])
        for name, found in record_.get("arrays", {}).items()
        for c in found
        if c[0] == relative and c[1] is not None and c[3] is not None
    }
    if not ranges:
        return []
    _, _, parts = file_digest(path, list(ranges))
    return sorted({name for key, (name, digest) in ranges.items() if parts.get(key) != digest})


def _named(names: list[str], limit: int = 4) -> str:
    dotted = [n.replace(".", "/") for n in names]
    return ", ".join(dotted[:limit]) + (f" and {len(dotted) - limit} more" if len(dotted) > limit else "")


#: What a file of an Orbax PyTree checkpoint is, for the verifier's messages (by name).
ROLES = {
    "manifest.ocdbt": "the OCDBT manifest: the root of the item's array database",
    "_METADATA": "the tree metadata",
    "_sharding": "the arrays' sharding",
    "_CHECKPOINT_METADATA": "Orbax's step metadata",
    "commit_success.txt": "Orbax's commit marker",
}


def _role(relative: str, record_: dict[str, Any]) -> str:
    name = relative.rsplit("/", 1)[-1]
    if relative.startswith("items/ocdbt.process_") and relative.endswith("/manifest.ocdbt"):
        return f"process {relative.split('/')[1].removeprefix('ocdbt.process_')}'s OCDBT manifest"
    if name in ROLES:
        return ROLES[name]
    if relative.startswith("items/array_metadatas/"):
        return "array metadata"
    arrays = _arrays_in(record_, relative)
    if arrays:
        return f"OCDBT data file holding {len(arrays)} array{'s' if len(arrays) > 1 else ''}: {_named(arrays)}"
    return "OCDBT data file (B+tree nodes)" if "/d/" in f"/{relative}" else "file"


#: Files Orbax writes as JSON: one that no longer parses is reported as garbage rather than as changed.
JSON_FILES = ("_METADATA", "_sharding", "_CHECKPOINT_METADATA")


def _garbage(relative: str, step_dir: Any) -> bool:
    """Whether a JSON file of Orbax's (:data:`JSON_FILES`, ``array_metadatas/*``) no longer parses."""
    name = relative.rsplit("/", 1)[-1]
    if name not in JSON_FILES and not relative.startswith("items/array_metadatas/"):
        return False
    try:
        json.loads((step_dir / relative).read_bytes())
    except ValueError:  # UnicodeDecodeError is one
        return True
    return False


def check(step_dir: Any, record_: dict[str, Any]) -> tuple[list[str], dict[str, Any]]:
    """Compare a step directory with its digest record.

    Returns:
        ``(problems, evidence)``: one line per missing, truncated (or grown), changed or unrecorded-and-extra file,
        each with its path relative to ``step_dir``, what it is, and for a changed data file the arrays it holds
        and (with chunk digests) the arrays whose bytes changed; ``evidence`` has the counts and names.
    """
    step_dir = _path(step_dir)
    recorded: dict[str, dict[str, Any]] = record_["files"]
    if _is_remote(step_dir):
        now = _object_digests(step_dir)
        current = {relative: (size, digest) for relative, (size, digest) in now.items()}
    else:
        current = {}
        for relative, path in list_files(step_dir).items():
            if relative in recorded:
                size, digest, _ = file_digest(path)
                current[relative] = (size, digest)
            else:
                current[relative] = (path.stat().length, None)
    problems: list[str] = []
    damaged: set[str] = set()
    missing, truncated, changed = [], [], []
    for relative, expected in recorded.items():
        role = _role(relative, record_)
        if relative not in current:
            missing.append(relative)
            damaged.update(_arrays_in(record_, relative))
            problems.append(f"missing: {relative} ({role}; {expected['bytes']:,} bytes recorded)")
            continue
        size, digest = current[relative]
        if (size, digest) != (expected["bytes"], expected["crc32c"]) and _garbage(relative, step_dir):
            changed.append(relative)
            problems.append(
                f"garbage: {relative} ({role}) is not JSON ({size:,} bytes, {expected['bytes']:,} recorded)"
            )
        elif size != expected["bytes"]:
            truncated.append(relative)
            damaged.update(_arrays_in(record_, relative))
            what = "truncated" if size < expected["bytes"] else "grown"
            problems.append(f"{what}: {relative} ({role}) is {size:,} bytes, {expected['bytes']:,} recorded")
        elif digest != expected["crc32c"]:
            changed.append(relative)
            exact = [] if _is_remote(step_dir) else _damaged_arrays(record_, relative, step_dir / relative)
            damaged.update(exact or _arrays_in(record_, relative))
            where = f"; the changed bytes are in {_named(exact)}" if exact else ""
            problems.append(
                f"content differs: {relative} ({role}): CRC-32C {digest}, {expected['crc32c']} recorded{where}"
            )
    if str(record_.get("step")) != step_dir.name:
        problems.insert(0, f"the digest record is of step {record_.get('step')}, in directory {step_dir.name}")
    extra = sorted(set(current) - set(recorded))
    evidence = {
        "files": len(recorded), "missing": missing, "size_differs": truncated, "content_differs": changed,
        "unrecorded": extra, "damaged_arrays": sorted(n.replace(".", "/") for n in damaged),
    }  # fmt: skip
    return problems, evidence


def reference_problems(step_dir: Any) -> tuple[list[str], int]:
    """What the OCDBT manifest refers to that is not there, for a step without digests: ``(problems, files)``.

    Every data file ``items/manifest.ocdbt``'s B+tree refers to must exist and reach the end of the furthest
    chunk stored in it; a problem names the file, missing or truncated, and the arrays it holds. Reads the
    manifest and its nodes and one ``stat`` per file, no array bytes. ``files`` is the count of files referred to.
    """
    step_dir = _path(step_dir)
    items = item_dir(step_dir)
    if not (items / "manifest.ocdbt").exists():
        return ["missing: items/manifest.ocdbt (the OCDBT manifest: the root of the item's array database)"], 0
    try:
        chunks = ocdbt_chunks(items)
    except Exception as error:  # noqa: BLE001 - an unreadable manifest or node is the finding
        return [f"the OCDBT manifest or a B+tree node cannot be read: {summarize_error(error)}"], 0
    ends: dict[str, int] = {}
    holders: dict[str, set[str]] = {}
    for name, found in chunks.items():
        for file, offset, length in found:
            ends[file] = max(ends.get(file, 0), (offset or 0) + (length or 0))
            holders.setdefault(file, set()).add(name)
    problems = []
    for file, end in sorted(ends.items()):
        held = f"holds {_named(sorted(holders[file]))}"
        try:
            size = (items / file).stat().length
        except FileNotFoundError:
            problems.append(f"missing: items/{file} (referred to by the OCDBT manifest; {held})")
            continue
        if size < end:
            problems.append(f"truncated: items/{file} is {size:,} bytes, the OCDBT manifest refers to {end:,} ({held})")
    return problems, len(ends)


class DigestRecorder:
    """Records each committed step's digests under a stage's checkpoint directory, in a background thread, and once
    a step has its record, the directory's :data:`LEDGER_FILE`.

    Only the stage's leader process runs one (the others would record the same files). ``start()`` then, when
    training is over (or failed), ``stop()``: it records what committed since the last look, so the final
    checkpoint has its digests before the process exits. A step that already has a record is left alone (a
    restarted JobSet's leader finds its predecessors' steps recorded); a step that cannot be read (deleted
    meanwhile) is skipped and reported on the leader's log.
    """

    def __init__(self, checkpoint_dir: str, poll_seconds: float = POLL_SECONDS, log: Any = print):
        self.checkpoint_dir = checkpoint_dir
        self.poll_seconds = poll_seconds
        self.log = log
        self.recorded: list[int] = []
        self._current: set[int] = set()  # steps whose record is known to be theirs
        self._ledger = False  # LEDGER_FILE known to be in the checkpoint directory
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="multislice-digests", daemon=True)

    def start(self) -> DigestRecorder:
        self._thread.start()
        return self

    def stop(self) -> list[int]:
        """Stop the thread, record what is left; returns the steps recorded by this recorder, ascending."""
        self._stop.set()
        self._thread.join()
        self.record_pending()
        return sorted(self.recorded)

    def _run(self) -> None:
        while not self._stop.wait(self.poll_seconds):
            self.record_pending()

    def record_pending(self) -> None:
        """Record every committed step without a record (errors are logged, never raised)."""
        try:
            steps = storage.committed_steps(self.checkpoint_dir)
        except Exception as error:  # noqa: BLE001 - a listing error must not stop training
            self.log(f"multislice digests: cannot list {self.checkpoint_dir}: {summarize_error(error)}")
            return
        for step in steps:
            if step in self._current:
                continue
            step_dir = _path(storage.join(self.checkpoint_dir, str(step)))
            try:
                if is_current(step_dir):
                    self._current.add(step)
                    continue
                started = time.monotonic()
                if write_record(step_dir):
                    self._current.add(step)
                    self.recorded.append(step)
                    self.log(
                        f"multislice digests: step {step} recorded in {time.monotonic() - started:.2f} s "
                        f"({step_dir / DIGEST_FILE})"
                    )
            except Exception as error:  # noqa: BLE001 - a step deleted meanwhile; training goes on
                self.log(f"multislice digests: step {step} not recorded: {summarize_error(error)}")
        if self._current and not self._ledger:
            try:
                self._ledger = write_ledger(self.checkpoint_dir)
            except Exception as error:  # noqa: BLE001 - training goes on; the next look tries again
                self.log(f"multislice digests: ledger not written in {self.checkpoint_dir}: {summarize_error(error)}")


def checkpoint_dir_of(maxtext_args: list[str]) -> str | None:
    """The checkpoint directory MaxText writes for these arguments, or None when checkpointing is off.

    ``<base_output_directory>/<run_name>/checkpoints`` (``maxtext/configs/pyconfig.py``: ``checkpoint_dir``);
    ``enable_checkpointing`` defaults to true in ``base.yml``.
    """
    args = dict(a.split("=", 1) for a in maxtext_args if "=" in a)
    if args.get("enable_checkpointing", "true").lower() in ("false", "0") or "base_output_directory" not in args:
        return None
    if "run_name" not in args:
        return None
    return "/".join([args["base_output_directory"].rstrip("/"), args["run_name"], "checkpoints"])


@contextlib.contextmanager
def recording(maxtext_args: list[str], leader: bool) -> Iterator[DigestRecorder | None]:
    """Record checkpoint digests while the body (MaxText's training) runs, on the leader process only.

    Yields the recorder, or None on another process or with checkpointing off. On leaving (training over, failed,
    or ``SystemExit`` from absl's ``app.run``) the steps committed since the last look are recorded too.
    """
    directory = checkpoint_dir_of(maxtext_args) if leader else None
    if directory is None:
        yield None
        return
    recorder = DigestRecorder(directory, log=lambda line: print(line, flush=True)).start()
    try:
        yield recorder
    finally:
        recorder.stop()
