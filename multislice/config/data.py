"""What a stage trains on: its data spec and its tokenizer, and how each maps onto MaxText 0.2.5's input pipelines.

A stage's ``data`` is one of (``kind`` picks it):

- ``synthetic``: MaxText's random tokens (``dataset_type=synthetic``);
- ``text``: raw text (text files, JSON Lines or Parquet; local, ``gs://`` or in the trainer
  environment's ``site-packages:``) that the ``prepare_data`` step tokenizes into ArrayRecord shards
  (:mod:`multislice.trainer.prepare_data`); the stage then reads them with MaxText's grain pipeline,
  pre-tokenized (``dataset_type=grain``, ``grain_file_type=arrayrecord``, ``tokenize_train_data=false``);
- ``grain``: ArrayRecord or Parquet files a user already has (``grain_train_files``, ``grain_eval_files``,
  ``grain_file_type``);
- ``hf``: a Hugging Face dataset (``hf_path``, ``hf_data_dir``, ``hf_train_files``, ``train_split``,
  ``hf_eval_split``), streamed as MaxText's hf pipeline always does;
- ``tfds``: a TFDS dataset (``dataset_path``, ``dataset_name``, ``eval_dataset_name``, ``train_split``,
  ``eval_split``).

Source of the keys: ``maxtext/configs/base.yml`` and ``maxtext/input_pipeline/{grain,hf,tfds}_data_processing.py``
of MaxText 0.2.5. The checks that read files or buckets (:func:`data_issues`) run in the plan step, before
preflight and provision; those that need no I/O are pydantic validators and :func:`tokenizer_vocab_issue`.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import hashlib
import importlib
import json
import logging
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from multislice import maxtext

if TYPE_CHECKING:
    from multislice.config.models import RunSpec

#: Prefix of a path inside the installed maxtext package (e.g. its tokenizers); resolved where MaxText is.
MAXTEXT_PREFIX = "maxtext:"
#: Prefix of a glob inside the trainer environment's site-packages (the local corpus); resolved there.
SITE_PACKAGES_PREFIX = "site-packages:"
#: The default tokenizer: Llama 3's, shipped in the maxtext package (nothing is downloaded at run time).
DEFAULT_TOKENIZER = MAXTEXT_PREFIX + "assets/tokenizers/tokenizer_llama3.tiktoken"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)


class TokenizerSpec(_Strict):
    """A stage's tokenizer, as MaxText's ``tokenizer_type`` and ``tokenizer_path``.

    ``path`` is a local path, a ``gs://`` path or ``maxtext:<path in the maxtext package>``
    (default: Llama 3's tiktoken file that MaxText 0.2.5 ships, vocabulary 128256).
    """

    type: Literal["tiktoken", "sentencepiece", "huggingface"] = "tiktoken"
    path: str = Field(default=DEFAULT_TOKENIZER, min_length=1)
    add_bos: bool = True
    add_eos: bool = True

    def vocab_size(self) -> int | None:
        """The tokenizer's vocabulary size, or None when it cannot be told without loading it.

        Known for the maxtext package's tokenizers (:data:`multislice.maxtext.TOKENIZER_VOCAB_SIZES`) and for a
        local tiktoken file (its ranks, one a line, plus the 256 special tokens MaxText's ``TikTokenTokenizer``
        adds, ``maxtext/input_pipeline/tokenizer.py``).
        """
        if self.path.startswith(MAXTEXT_PREFIX):
            return maxtext.TOKENIZER_VOCAB_SIZES.get(self.path.removeprefix(MAXTEXT_PREFIX))
        if self.type == "tiktoken" and not self.path.startswith("gs://") and os.path.isfile(self.path):
            with open(self.path, "rb") as handle:
                ranks = sum(1 for line in handle if line.strip())
            return ranks + maxtext.TIKTOKEN_SPECIAL_TOKENS
        return None

    def maxtext_args(self, site_packages: str | None = None) -> dict[str, Any]:
        """MaxText keys: ``tokenizer_type``, ``tokenizer_path`` (resolved under ``site_packages``), ``add_bos``, ..."""
        return {
            "tokenizer_type": self.type,
            "tokenizer_path": resolve_path(self.path, site_packages),
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
        }


class SyntheticData(_Strict):
    """MaxText's synthetic batches (random tokens): no files, no tokenizer."""

    kind: Literal["synthetic"] = "synthetic"


class TextData(_Strict):
    """Raw text that ``prepare_data`` tokenizes into ArrayRecord shards before preflight.

    ``files``: globs, each a local path, ``gs://`` or ``site-packages:<glob>`` (inside the trainer
    environment's site-packages). ``format``: ``text`` (a file is one document), ``jsonl`` (one JSON object a
    line, its ``text_field``) or ``parquet`` (column ``text_field``). Documents whose SHA-256 falls in the
    first ``eval_fraction`` of the hash space form the eval split. ``packing``: documents are concatenated
    (each with BOS/EOS as the tokenizer says) and cut into ``max_target_length`` + 1 token sequences;
    otherwise each document is cut alone and its last piece kept short.
    """

    kind: Literal["text"] = "text"
    files: tuple[str, ...] = Field(min_length=1)
    exclude: tuple[str, ...] = Field(default=(), description="fnmatch patterns of file paths to leave out.")
    format: Literal["text", "jsonl", "parquet"] = "text"
    text_field: str = Field(default="text", min_length=1)
    packing: bool = True
    eval_fraction: float = Field(default=0.05, gt=0, lt=1)
    shard_sequences: int = Field(default=4096, gt=0, description="Sequences per ArrayRecord shard.")
    cache_dir: str | None = Field(
        default=None, description="Where prepared shards live; default <output_dir>/datasets."
    )


class GrainData(_Strict):
    """Files a user already has, read by MaxText's grain pipeline (``dataset_type=grain``).

    ``train_files`` and ``eval_files`` are globs (local or ``gs://``), MaxText's ``grain_train_files`` and
    ``grain_eval_files``. ``pretokenized``: the ``column`` holds token ids (``tokenize_train_data=false``).
    """

    kind: Literal["grain"] = "grain"
    file_type: Literal["arrayrecord", "parquet"] = "arrayrecord"
    train_files: str = Field(min_length=1)
    eval_files: str | None = None
    column: str = "text"
    pretokenized: bool = False


class HFData(_Strict):
    """A Hugging Face dataset, streamed by MaxText's hf pipeline (``dataset_type=hf``).

    ``path`` is ``hf_path`` (a hub name like ``allenai/c4``, or a local directory), ``data_dir`` is
    ``hf_data_dir``, ``train_files`` ``hf_train_files``, ``train_split`` and ``eval_split`` MaxText's
    ``train_split`` and ``hf_eval_split``. MaxText 0.2.5 always streams an hf dataset (``streaming=True`` in
    ``hf_data_processing.py``), so ``streaming`` must stay true.
    """

    kind: Literal["hf"] = "hf"
    path: str = Field(min_length=1)
    data_dir: str = ""
    train_files: str = ""
    train_split: str = Field(default="train", min_length=1)
    eval_split: str | None = None
    streaming: Literal[True] = True
    column: str = "text"


class TFDSData(_Strict):
    """A TFDS dataset read by MaxText's tfds pipeline (``dataset_type=tfds``): ``dataset_path``/``dataset_name``."""

    kind: Literal["tfds"] = "tfds"
    dataset_path: str = Field(min_length=1)
    dataset_name: str = Field(min_length=1, description="name:version, e.g. c4/en:3.1.0")
    eval_dataset_name: str | None = None
    train_split: str = Field(default="train", min_length=1)
    eval_split: str | None = None

    @field_validator("dataset_name", "eval_dataset_name")
    @classmethod
    def _versioned(cls, value: str | None) -> str | None:
        if value is not None and ":" not in value:
            raise ValueError(f"{value!r} has no version; TFDS names a dataset as name:version, e.g. c4/en:3.1.0")
        return value


DataSpec = Annotated[SyntheticData | TextData | GrainData | HFData | TFDSData, Field(discriminator="kind")]


def resolve_path(path: str, site_packages: str | None = None) -> str:
    """``path`` with a ``maxtext:`` or ``site-packages:`` prefix made a path under ``site_packages``.

    ``site_packages`` defaults to this interpreter's (``sysconfig`` purelib): right in the trainer
    environment; the pipeline environment passes the trainer environment's (local backend) or keeps
    the prefix (a pod resolves it).
    """
    root = site_packages or sysconfig.get_paths()["purelib"]
    if path.startswith(MAXTEXT_PREFIX):
        return str(Path(root) / "maxtext" / path.removeprefix(MAXTEXT_PREFIX))
    if path.startswith(SITE_PACKAGES_PREFIX):
        return str(Path(root) / path.removeprefix(SITE_PACKAGES_PREFIX))
    return path


def expand_files(
    patterns: tuple[str, ...], exclude: tuple[str, ...] = (), site_packages: str | None = None
) -> list[str]:
    """Every file the globs match (local, ``gs://`` via etils epath, ``site-packages:``), sorted, minus ``exclude``."""
    found: set[str] = set()
    for pattern in patterns:
        resolved = resolve_path(pattern, site_packages)
        if resolved.startswith("gs://"):
            from etils import epath  # its import (0.1 s) only where a data glob is on Cloud Storage

            bucket, _, rest = resolved.removeprefix("gs://").partition("/")
            found.update(str(p) for p in epath.Path(f"gs://{bucket}").glob(rest))
        elif glob.has_magic(resolved):
            found.update(p for p in glob.glob(resolved, recursive=True) if os.path.isfile(p))
        elif os.path.isfile(resolved):
            found.add(resolved)
    return sorted(f for f in found if not any(fnmatch.fnmatch(f, x) for x in exclude))


def recipe_key(data: TextData, tokenizer: TokenizerSpec, max_target_length: int) -> str:
    """The prepared shards' directory name: a hash of everything that shapes them except the files' content.

    The files' content is checked against the manifest inside (:mod:`multislice.trainer.prepare_data`).
    """
    recipe = {
        "data": data.model_dump(exclude={"cache_dir"}),
        "tokenizer": tokenizer.model_dump(),
        "max_target_length": max_target_length,
        "format_version": 1,
    }
    return hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def tokenizer_vocab_issue(vocab_size: int | None, tokenizer: TokenizerSpec) -> str | None:
    """Why the model's ``vocab_size`` does not fit the tokenizer, or None (also when either is unknown)."""
    tokens = tokenizer.vocab_size()
    if vocab_size is None or tokens is None or vocab_size == tokens:
        return None
    return (
        f"the model's vocab_size is {vocab_size} but tokenizer {tokenizer.path} has {tokens} tokens; "
        f"set model.vocab_size: {tokens} (or give the model's own tokenizer)"
    )


def _glob_issue(field: str, pattern: str, site_packages: str | None) -> tuple[str, str] | None:
    try:
        files = expand_files((pattern,), (), site_packages)
    except Exception as error:  # noqa: BLE001 - any failure of the storage client (OSError, a bad answer) is this
        cause = " ".join(str(error).split())[:300] or type(error).__name__
        return field, f"{pattern!r} cannot be listed ({cause}); give a readable path or gs:// glob"
    if not files:
        return field, f"{pattern!r} matches no file; give an existing path or a glob that matches files"
    return None


def _parquet_issue(field: str, files: list[str], column: str) -> tuple[str, str] | None:
    """Whether the first files are Parquet holding ``column``.

    With pyarrow (the trainer image has it) the schema is read; without it (the pipeline image) a file
    must begin and end with Parquet's magic bytes ``PAR1`` (https://parquet.apache.org/docs/file-format/),
    which catches a file that is not Parquet or was cut short; the column is then checked by prepare_data.
    """
    try:  # by name: pyarrow is in the trainer image only, not in the pipeline image that type-checks this
        pq = importlib.import_module("pyarrow.parquet")
    except ImportError:
        pq = None
    for name in files[:16]:
        try:
            if pq is not None:
                names = pq.read_schema(name).names
            else:
                with _open_binary(name) as handle:
                    head = handle.read(4)
                    handle.seek(0, os.SEEK_END)
                    size = handle.tell()
                    handle.seek(max(size - 4, 0))
                    tail = handle.read(4)
                if head != b"PAR1" or tail != b"PAR1" or size < 12:
                    raise ValueError("no Parquet magic bytes PAR1 at its start and end")
                names = None
        except Exception as error:  # noqa: BLE001 - pyarrow raises many kinds for a file that is not Parquet
            return field, f"{name} is not a readable Parquet file ({type(error).__name__}: {error}); replace it"
        if names is not None and column not in names:
            return field, f"{name} has no column {column!r} (columns: {', '.join(names)}); set the column"
    return None


def _open_binary(name: str):
    if name.startswith("gs://"):
        from etils import epath  # its import (0.1 s) only where a data file is on Cloud Storage

        return epath.Path(name).open("rb")
    return open(name, "rb")


def stage_data_issues(where: str, stage: Any, site_packages: str | None) -> list[tuple[str, str]]:
    """A stage's data checks that read files: paths, globs, splits, Parquet files. ``(field, message)`` pairs."""
    data, issues = stage.data, []
    if isinstance(data, TextData):
        for i, pattern in enumerate(data.files):
            if pattern.startswith(SITE_PACKAGES_PREFIX) and site_packages is None:
                continue  # resolved in the trainer image
            issue = _glob_issue(f"{where}.data.files[{i}]", pattern, site_packages)
            issues += [issue] if issue else []
        if not issues and data.format == "parquet":
            files = expand_files(data.files, data.exclude, site_packages)
            issue = _parquet_issue(f"{where}.data.files", files, data.text_field)
            issues += [issue] if issue else []
    elif isinstance(data, GrainData):
        for name in ("train_files", "eval_files"):
            pattern = getattr(data, name)
            issue = pattern and _glob_issue(f"{where}.data.{name}", pattern, site_packages)
            if issue:
                issues.append(issue)
            elif pattern and data.file_type == "parquet":
                issue = _parquet_issue(f"{where}.data.{name}", expand_files((pattern,)), data.column)
                issues += [issue] if issue else []
    elif isinstance(data, HFData):
        local = Path(data.path)
        if data.path.startswith(("/", ".")) and not local.is_dir():
            issues.append(
                (f"{where}.data.path", f"{data.path!r} is not a directory; give a local dataset or a hub name")
            )
        elif local.is_dir():
            splits = {p.name.split("-")[0].split(".")[0] for p in (local / data.data_dir).rglob("*") if p.is_file()}
            for name in ("train_split", "eval_split"):
                split = getattr(data, name)
                if split and not any(s.startswith(split) for s in splits):
                    issues.append(
                        (f"{where}.data.{name}", f"split {split!r} has no file in {local / data.data_dir} "
                                                 f"(files start with: {', '.join(sorted(splits)) or 'none'})")
                    )  # fmt: skip
    elif isinstance(data, TFDSData) and not data.dataset_path.startswith("gs://"):
        for name, dataset in (("dataset_name", data.dataset_name), ("eval_dataset_name", data.eval_dataset_name)):
            if dataset is None:
                continue
            folder = Path(data.dataset_path, *dataset.replace(":", "/").split("/"))
            if not folder.is_dir():
                issues.append((f"{where}.data.{name}", f"no TFDS dataset at {folder}; check dataset_path and the name"))
                continue
            for split_field in ("train_split", "eval_split"):
                split = getattr(data, split_field)
                if split and not list(folder.glob(f"*-{split}.*")):
                    issues.append((f"{where}.data.{split_field}", f"{folder} has no {split!r} split files"))
    return issues


#: Loggers of the Cloud Storage client (gcsfs, behind etils epath) that print a failed request's whole
#: traceback (``logger.exception`` in ``gcsfs/retry.py``) before the error reaches the check that reports it.
QUIET_LOGGERS = ("gcsfs",)


@contextlib.contextmanager
def quiet_storage_loggers() -> Iterator[None]:
    """Silence :data:`QUIET_LOGGERS` for a check that reports the storage error itself (naming the field)."""
    found = [logging.getLogger(name) for name in QUIET_LOGGERS]
    levels = [logger.level for logger in found]
    for logger in found:
        logger.setLevel(logging.CRITICAL + 1)
    try:
        yield
    finally:
        for logger, level in zip(found, levels, strict=True):
            logger.setLevel(level)


def data_issues(spec: RunSpec, site_packages: str | None = None) -> list[tuple[str, str]]:
    """Every stage's data checks that read files or buckets (the plan step runs them before provision).

    A ``gs://`` path that cannot be read (no credentials, no network, no such bucket) is one issue naming
    the field; the storage client's own log of the failed request is not printed (:func:`quiet_storage_loggers`).
    """
    issues: list[tuple[str, str]] = []
    with quiet_storage_loggers():
        for i, stage in enumerate(spec.stages):
            issues += stage_data_issues(f"stages[{i}] ({stage.name})", stage, site_packages)
    return issues
