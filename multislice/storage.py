"""Run storage: one path type for local directories and ``gs://`` alike.

Every file a run leaves (step reports, UI pages, metrics, manifests, the
preflight cache) and every read of what it left (a committed checkpoint
step, ``multislice.delivery.results.read_run``) goes through
``etils.epath.Path``, the path library MaxText and Orbax use for the same
directories: a local path is a ``pathlib`` path, a ``gs://`` URL goes
through gcsfs (fsspec), which honours ``STORAGE_EMULATOR_HOST`` (the tests
point it at a loopback emulator). Only :func:`write_text` branches on where a
path is (a local file is written whole by a rename; an object upload is whole).

Source of the committed-checkpoint rule: Orbax
``orbax/checkpoint/_src/path/temporary_paths.py`` (``is_path_finalized``): a
step directory is final once ``commit_success.txt`` is in it (Orbax's commit
file, written last).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Any

from etils import epath

#: The file Orbax writes into a checkpoint step directory once the step is committed.
COMMIT_FILE = "commit_success.txt"


def path(location: str | epath.PathLike) -> epath.Path:
    """An ``epath.Path`` for a local path or a ``gs://`` URL (``gs://b/x`` keeps its two slashes)."""
    return epath.Path(location)


def join(base: str, *parts: str) -> str:
    """``base/part/...`` as text, for local paths and URLs alike (no normalisation of ``gs://``).

    A URL keeps its ``scheme://``: trailing slashes are stripped from what follows it only, so ``gs://`` joined
    with ``run`` is ``gs:///run`` (a URL without a bucket, which Cloud Storage clients refuse), never the local
    path ``gs:/run``.
    """
    scheme, sep, rest = str(base).partition("://")
    head = scheme + sep + rest.rstrip("/") if sep else scheme.rstrip("/")
    return "/".join([head, *parts])


def is_remote(location: str | epath.PathLike) -> bool:
    """True for a URL (``gs://...``): a path this machine's other processes cannot open as a file."""
    return "://" in str(location)


def read_text(location: str | epath.PathLike) -> str | None:
    """The text of a file, or None when it does not exist."""
    try:
        return path(location).read_text(encoding="utf-8")
    except FileNotFoundError:
        return None


def write_text(location: str | epath.PathLike, text: str) -> epath.Path:
    """Write ``text`` (UTF-8), creating parent directories; returns the path.

    Readers never see a partial file: a local file is written beside its
    target and renamed over it (``os.replace`` is atomic on POSIX), and a
    Cloud Storage object appears whole when its upload finishes. Runs that
    share a directory (the preflight verdict cache) can write at once.
    """
    target = path(location)
    target.parent.mkdir(parents=True, exist_ok=True)
    if is_remote(target):
        target.write_text(text, encoding="utf-8")
        return target
    scratch = target.with_name(f".{target.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}.tmp")
    try:
        scratch.write_text(text, encoding="utf-8")
        os.replace(scratch, target)
    finally:
        if scratch.exists():
            scratch.unlink()
    return target


def read_json(location: str | epath.PathLike) -> Any | None:
    """Parsed JSON of a file, or None when it does not exist."""
    text = read_text(location)
    return None if text is None else json.loads(text)


def write_json(location: str | epath.PathLike, data: Any) -> epath.Path:
    """Write ``data`` as indented JSON (``default=str`` for dates and paths); returns the path."""
    return write_text(location, json.dumps(data, indent=1, default=str))


def committed_steps(checkpoint_dir: str | epath.PathLike) -> list[int]:
    """Checkpoint steps Orbax committed under ``checkpoint_dir``, ascending; [] when there is none.

    A committed step is a directory named by its step number that holds
    :data:`COMMIT_FILE`.
    """
    root = path(checkpoint_dir)
    try:
        entries = list(root.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    return sorted(int(p.name) for p in entries if p.name.isdigit() and (p / COMMIT_FILE).exists())


def latest_committed_step(checkpoint_dir: str | epath.PathLike) -> int | None:
    """Newest committed checkpoint step under ``checkpoint_dir``, or None."""
    steps = committed_steps(checkpoint_dir)
    return steps[-1] if steps else None
