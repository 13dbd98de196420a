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
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from multislice import maxtext
from multislice.config import hub, values


def _value_check(problem: str | None, value: Any) -> Any:
    if problem:
        raise ValueError(problem)
    return value


if TYPE_CHECKING:
    from multislice.config.models import RunSpec

#: Prefix of a path inside the installed maxtext package (e.g. its tokenizers); resolved where MaxText is.
MAXTEXT_PREFIX = "maxtext:"
#: Prefix of a glob inside the trainer environment's site-packages (the local corpus); resolved there.
SITE_PACKAGES_PREFIX = "site-packages:"
#: Prefix of a path inside this package (:mod:`multislice`, in both images); resolved where it is installed.
PACKAGE_PREFIX = "multislice:"
#: The default tokenizer: Llama 3's, shipped in the maxtext package (nothing is downloaded at run time).
#: The most shard workers a ``text`` stage may ask for (``data.workers``): an Indexed Job's completions above 10^5
#: need ``parallelism`` at most 10^4 (batch/v1 Job validation); far beyond what a corpus' file count splits into.
MAX_DATA_WORKERS = 10_000
DEFAULT_TOKENIZER = MAXTEXT_PREFIX + "assets/tokenizers/tokenizer_llama3.tiktoken"
#: The same tokenizer in Hugging Face format, shipped in this package, for MaxText's ``hf`` pipeline, which loads
#: its tokenizer with ``transformers.AutoTokenizer`` only (:mod:`multislice.trainer.hf_tokenizer`).
HF_LLAMA3_TOKENIZER = PACKAGE_PREFIX + "data/tokenizers/llama3-hf"
#: Llama 3's vocabulary: 128,000 BPE ranks and the 256 special tokens MaxText's ``TikTokenTokenizer`` adds.
LLAMA3_VOCAB_SIZE = 128256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    @field_validator("*")
    @classmethod
    def _visible(cls, value: Any) -> Any:
        """Every name and path of a data spec (a string, or strings in a tuple) holds no control or invisible format
        character (:func:`.values.control_problem`: a newline, U+202E...), which no file, column or Hub name has."""
        texts = [value] if isinstance(value, str) else [v for v in value if isinstance(v, str)] if isinstance(
            value, tuple) else []  # fmt: skip
        for text in texts:
            if problem := values.control_problem(text):
                raise ValueError(problem)
        return value


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
        if self.path == HF_LLAMA3_TOKENIZER:
            return LLAMA3_VOCAB_SIZE
        if self.path.startswith("gs://") or not os.path.exists(resolve_path(self.path)):
            return None
        try:
            return tokenizer_file_vocab(self.type, resolve_path(self.path))
        except (OSError, ValueError):
            return None  # unreadable: tokenizer_issue says so, naming the field

    def for_hf_pipeline(self) -> TokenizerSpec:
        """The tokenizer MaxText's ``hf`` pipeline is given: this one, or, for the default tiktoken file, its
        Hugging Face form shipped in this package (:data:`HF_LLAMA3_TOKENIZER`). Other tiktoken and sentencepiece
        files are refused at plan (:func:`static_data_issues`)."""
        if self.type == "tiktoken" and self.path == DEFAULT_TOKENIZER:
            return self.model_copy(update={"type": "huggingface", "path": HF_LLAMA3_TOKENIZER})
        return self

    def maxtext_args(self, site_packages: str | None = None) -> dict[str, Any]:
        """MaxText keys: ``tokenizer_type``, ``tokenizer_path`` (resolved under ``site_packages``), ``add_bos``, ..."""
        return {
            "tokenizer_type": self.type,
            "tokenizer_path": resolve_path(self.path, site_packages),
            "add_bos": self.add_bos,
            "add_eos": self.add_eos,
        }


def _varint(buffer: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if at >= len(buffer):
            raise ValueError("truncated protobuf varint")
        byte = buffer[at]
        value |= (byte & 0x7F) << shift
        at += 1
        if not byte & 0x80:
            return value, at
        shift += 7
        if shift > 63:
            raise ValueError("protobuf varint longer than 10 bytes")


def sentencepiece_pieces(model: bytes) -> int:
    """How many pieces a sentencepiece ``.model`` holds: the count of ``ModelProto.pieces`` (field 1, repeated
    message; ``sentencepiece_model.proto``), read from the protobuf wire format without the sentencepiece package
    (the pipeline image has none). That is the vocabulary MaxText's ``SentencePieceTokenizer`` has.

    Raises:
        ValueError: the bytes are not a protobuf message (a truncated field, an unknown wire type) or hold no piece.
    """
    at = pieces = 0
    while at < len(model):
        key, at = _varint(model, at)
        field, wire = key >> 3, key & 7
        if wire == 0:
            _, at = _varint(model, at)
        elif wire == 1:
            at += 8
        elif wire == 2:
            length, at = _varint(model, at)
            at += length
            pieces += field == 1
        elif wire == 5:
            at += 4
        else:
            raise ValueError(f"wire type {wire} at byte {at}: not a sentencepiece model")
        if at > len(model) or field == 0:
            raise ValueError("truncated or malformed protobuf: not a sentencepiece model")
    if not pieces:
        raise ValueError("no pieces: not a sentencepiece model")
    return pieces


def tokenizer_file_vocab(kind: str, path: str) -> int:
    """The vocabulary size of a local tokenizer file, as MaxText's tokenizer of that ``kind`` sees it.

    ``tiktoken``: one rank a line plus the 256 special tokens ``TikTokenTokenizer`` adds
    (``maxtext/input_pipeline/tokenizer.py``); ``sentencepiece``: the model's pieces (:func:`sentencepiece_pieces`);
    ``huggingface``: ``tokenizer.json`` in the directory (or the file itself), the highest id of its model's
    vocabulary and added tokens, plus one.

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not a tokenizer of that kind.
    """
    if kind == "tiktoken":
        with open(path, "rb") as handle:
            lines = [line.split() for line in handle if line.strip()]
        if not lines or any(len(line) != 2 or not line[1].isdigit() for line in lines[:1000]):
            raise ValueError("not a tiktoken file (each line: a base64 token and its rank)")
        return len(lines) + maxtext.TIKTOKEN_SPECIAL_TOKENS
    if kind == "sentencepiece":
        with open(path, "rb") as handle:
            return sentencepiece_pieces(handle.read())
    folder = Path(path)
    file = folder / "tokenizer.json" if folder.is_dir() else folder
    try:
        found = json.loads(file.read_text(encoding="utf-8"))
        vocab = found["model"]["vocab"]
        ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
        ids += [int(token["id"]) for token in found.get("added_tokens") or []]
    except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as error:
        raise ValueError(f"no readable tokenizer.json ({type(error).__name__})") from None
    if not ids:
        raise ValueError("tokenizer.json has an empty vocabulary")
    return max(ids) + 1


class SyntheticData(_Strict):
    """MaxText's synthetic batches (random tokens): no files, no tokenizer."""

    kind: Literal["synthetic"] = "synthetic"


class TextData(_Strict):
    """Raw text that ``prepare_data`` tokenizes into ArrayRecord shards before preflight.

    ``files``: globs, each a local path, ``gs://`` or ``site-packages:<glob>`` (inside the trainer
    environment's site-packages). ``format``: ``text`` (a file is one document), ``jsonl`` (one JSON object a
    line, its ``text_field``) or ``parquet`` (column ``text_field``). Documents whose SHA-256 falls in the
    first ``eval_fraction`` of the hash space form the eval split.

    Records keep document boundaries: each document (with BOS/EOS as the tokenizer says) is cut alone into
    records of at most ``max_target_length`` tokens. ``packing`` is MaxText's own key: true, its grain pipeline
    packs the records into rows first-fit (``grain_packing_type: first_fit``) with a segment id per record and
    positions restarting at each, so a document never attends to another; false, one record a row, padded.
    Elastic stages always read unpacked (MaxText's elastic iterator requires ``packing: false``,
    ``configs/types.py``): the prepare report gives the padding that costs. ``concatenate``: instead concatenate
    the documents and cut them into full ``max_target_length`` records (no padding on any stage, but documents
    attend to the ones before them in a row: no segment ids), for elastic stages on short documents.
    """

    kind: Literal["text"] = "text"
    files: tuple[str, ...] = Field(min_length=1)
    exclude: tuple[str, ...] = Field(default=(), description="fnmatch patterns of file paths to leave out.")
    format: Literal["text", "jsonl", "parquet"] = "text"
    text_field: str = Field(default="text", min_length=1)
    packing: bool = True
    concatenate: bool = False
    eval_fraction: float = Field(default=0.05, gt=0, lt=1)
    shard_sequences: int = Field(default=4096, gt=0, description="Sequences per ArrayRecord shard.")
    cache_dir: str | None = Field(
        default=None, description="Where prepared shards live; default <output_dir>/datasets."
    )
    workers: int = Field(
        default=1,
        ge=1,
        le=MAX_DATA_WORKERS,
        description="Shard workers: the source files are split into this many contiguous ranges of about equal "
        "bytes (fewer when there are fewer files), each tokenized by one worker: one completion index of an "
        "Indexed Job on GKE, one trainer-environment process locally. Not part of the recipe.",
    )
    parallelism: int | None = Field(
        default=None,
        ge=1,
        description="How many shard workers run at once (the Indexed Job's parallelism; processes locally); "
        "default: all of them. At most workers.",
    )

    @field_validator("parallelism")
    @classmethod
    def _parallelism(cls, value: int | None, info: ValidationInfo) -> int | None:
        workers = info.data.get("workers")
        if value is not None and workers is not None and value > workers:
            raise ValueError(f"parallelism {value} is more than workers {workers}: set parallelism <= workers")
        return value


class _HubToken(_Strict):
    """Where the trainer pods get a Hugging Face token for a private or gated dataset (``$HF_TOKEN``, which
    ``huggingface_hub`` reads when MaxText's ``hf_access_token`` is unset: ``datasets.load_dataset`` and
    ``HfFileSystem`` both fall back to it). Never the token itself, never a MaxText argument (MaxText's
    ``hf_access_token`` would put it in the JobSet's args and the compiled pipeline)."""

    hf_token_kubernetes_secret: str = Field(
        default="",
        description="GKE: a Kubernetes Secret in the run's namespace whose key 'token' holds the Hugging Face token; "
        "the trainer pods get it as $HF_TOKEN by reference (secretKeyRef). '' for none.",
    )
    hf_token_secret: str = Field(
        default="",
        description="GKE: a Secret Manager secret version (projects/<p>/secrets/<s>/versions/<v>) with the token, read "
        "by each trainer pod at start with the trainer's Google service account "
        "(roles/secretmanager.secretAccessor). '' for none. Locally the token is this machine's $HF_TOKEN.",
    )
    sequences: int | None = Field(
        default=None,
        gt=0,
        description="How many training sequences (of max_target_length tokens, after packing) the data holds, for "
        "the plan's check that steps x global batch does not run past it (MaxText's num_epoch: 1 stops there); "
        "null: not checked (MaxText's streamed and file pipelines cannot be counted before training).",
    )

    @field_validator("hf_token_kubernetes_secret")
    @classmethod
    def _kubernetes_secret(cls, value: str) -> str:
        problem = values.kubernetes_secret_problem(value)
        if problem:
            raise ValueError(problem)
        return value

    @field_validator("hf_token_secret")
    @classmethod
    def _secret_version(cls, value: str) -> str:
        problem = values.secret_version_problem(value, value.startswith("hf_"), "a token", "none")
        if problem:
            raise ValueError(problem)
        return value


class GrainData(_HubToken):
    """Files a user already has, read by MaxText's grain pipeline (``dataset_type=grain``).

    ``train_files`` and ``eval_files`` are globs (local, ``gs://`` or ``hf://``: MaxText lists ``hf://`` with
    ``huggingface_hub.HfFileSystem``), MaxText's ``grain_train_files`` and ``grain_eval_files``; for ArrayRecord a
    weighted mixture in MaxText's syntax, ``glob,weight;glob,weight`` (``grain_data_processing.py`` ``get_datasets``:
    only its ArrayRecord branch splits on ``;``). ``pretokenized``: the ``column`` holds token ids
    (``tokenize_train_data=false``).
    """

    kind: Literal["grain"] = "grain"
    file_type: Literal["arrayrecord", "parquet", "tfrecord"] = "arrayrecord"
    train_files: str = Field(min_length=1)
    eval_files: str | None = None
    column: str = "text"
    pretokenized: bool = False

    @field_validator("train_files", "eval_files")
    @classmethod
    def _mixture(cls, value: str | None) -> str | None:
        if value is not None:
            mixture_parts(value)  # raises ValueError naming the part
        return value


def mixture_parts(files: str) -> list[tuple[str, float | None]]:
    """``(glob, weight)`` of each part of MaxText's mixture syntax ``glob,weight;glob,weight``; one part with
    weight None when ``files`` is a plain glob.

    Raises:
        ValueError: a part without exactly one ``,weight``, a weight that is not a positive number, an empty glob.
    """
    if ";" not in files:
        if not files.strip():
            raise ValueError("an empty glob; give a path or glob")
        return [(files, None)]
    parts: list[tuple[str, float | None]] = []
    for part in files.split(";"):
        pieces = part.split(",")
        if len(pieces) != 2 or not pieces[0].strip():
            raise ValueError(
                f"mixture part {part!r} is not glob,weight; MaxText splits a mixture as "
                "'glob,weight;glob,weight' (a glob may hold no ',' or ';')"
            )
        try:
            weight = float(pieces[1])
        except ValueError:
            raise ValueError(f"mixture part {part!r}: weight {pieces[1]!r} is not a number") from None
        if not weight > 0 or weight == float("inf"):
            raise ValueError(f"mixture part {part!r}: weight {pieces[1]!r} must be a positive finite number")
        parts.append((pieces[0], weight))
    return parts


class HFData(_HubToken):
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

    @field_validator("path")
    @classmethod
    def _hub_name(cls, value: str) -> str:
        """A local directory (``/...``, ``./...``, ``../...``), else a Hub name, checked with huggingface_hub's
        repository-id rules (:func:`.values.hub_repo_id_problem`), as ``datasets.load_dataset`` resolves it when the
        stage starts."""
        if value.startswith(("/", ".")):
            return value
        return _value_check(values.hub_repo_id_problem(value), value)


class TFDSData(_Strict):
    """A TFDS dataset as prepared on disk
    (``dataset_path``/``name``/``version``/``<name>-<split>.<format>-NNNNN-of-NNNNN``), read by MaxText's
    **grain** pipeline, not its tfds one.

    MaxText 0.2.5's ``dataset_type=tfds`` needs ``tensorflow`` and ``tensorflow_datasets``, which the trainer image
    does not install (a stage on it would fail when training starts); MaxText itself moves TFDS data onto grain:
    with ``grain_file_type=tfrecord`` it builds the glob ``<dataset_path>/<name/version>/*-<split>.tfrecord-*``
    from ``dataset_path``, ``dataset_name`` and ``train_split`` (``grain_data_processing.py``
    ``construct_tfds_tfrecord_path``) and parses each record as a ``tf.train.Example`` with its own protos, no
    TensorFlow. The plan gives MaxText that glob (``array_record`` files likewise, for datasets TFDS prepared with
    ``file_format=array_record``); ``column`` is the text feature.
    """

    kind: Literal["tfds"] = "tfds"
    dataset_path: str = Field(min_length=1)
    dataset_name: str = Field(min_length=1, description="name:version, e.g. c4/en:3.1.0")
    eval_dataset_name: str | None = None
    train_split: str = Field(default="train", min_length=1)
    eval_split: str | None = None
    file_format: Literal["tfrecord", "array_record"] = Field(
        default="tfrecord", description="How TFDS wrote the dataset (its file_format): tfrecord or array_record."
    )
    column: str = Field(default="text", min_length=1, description="The feature holding the text.")
    sequences: int | None = Field(
        default=None, gt=0, description="Training sequences the data holds, for the check that the data lasts."
    )

    @field_validator("dataset_name", "eval_dataset_name")
    @classmethod
    def _versioned(cls, value: str | None) -> str | None:
        if value is not None and ":" not in value:
            raise ValueError(f"{value!r} has no version; TFDS names a dataset as name:version, e.g. c4/en:3.1.0")
        return value

    def files(self, split: str, dataset_name: str | None = None) -> str:
        """The glob of ``split``'s files, as MaxText's ``construct_tfds_tfrecord_path`` builds it (for
        ``array_record``, the same with that extension)."""
        name = (dataset_name or self.dataset_name).strip().strip("/").replace(":", "/")
        return f"{self.dataset_path.strip().rstrip('/')}/{name}/*-{split}.{self.file_format}-*"

    def grain_file_type(self) -> str:
        """MaxText's ``grain_file_type`` for the files: ``tfrecord`` or ``arrayrecord``."""
        return "tfrecord" if self.file_format == "tfrecord" else "arrayrecord"


DataSpec = Annotated[SyntheticData | TextData | GrainData | HFData | TFDSData, Field(discriminator="kind")]


def resolve_path(path: str, site_packages: str | None = None) -> str:
    """``path`` with a ``maxtext:`` or ``site-packages:`` prefix made a path under ``site_packages``.

    ``site_packages`` defaults to this interpreter's (``sysconfig`` purelib): right in the trainer
    environment; the pipeline environment passes the trainer environment's (local backend) or keeps
    the prefix (a pod resolves it).
    A ``multislice:`` path is made a path in this package, wherever it is installed.
    """
    if path.startswith(PACKAGE_PREFIX):
        return str(Path(__file__).resolve().parents[1] / path.removeprefix(PACKAGE_PREFIX))
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
        # packing is MaxText's, applied when it reads the records: the same records serve both; the shard
        # workers' count and parallelism change how the records are made, not which
        "data": data.model_dump(exclude={"cache_dir", "packing", "workers", "parallelism"}),
        "tokenizer": tokenizer.model_dump(),
        "max_target_length": max_target_length,
        "format_version": 2,  # 2: one record per document (piece); 1 concatenated the documents
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


#: The scheme of a Hugging Face Hub path in a grain glob (MaxText lists it with ``huggingface_hub.HfFileSystem``).
HF_PREFIX = "hf://"


def _hf_glob_issue(field: str, pattern: str) -> tuple[str, str] | None:
    """Whether an ``hf://`` glob has the shape ``HfFileSystem`` lists (``hf://datasets/OWNER/NAME[@REVISION]/GLOB``)
    and matches files of the dataset, listed through the Hub's API (:mod:`multislice.config.hub`; nothing is
    downloaded), each a Parquet file by its name (``.parquet``): MaxText reads ``hf://`` files as Parquet only
    (``make_parquet_iter_dataset``), and the bytes are not read here. MaxText lists the glob again when the stage
    starts (``find_data_files``), with the pods' ``$HF_TOKEN``.
    """
    try:
        hub.HubGlob.parse(pattern)
    except ValueError:
        return field, (
            f"{pattern!r} is not a Hugging Face Hub dataset path; write hf://datasets/OWNER/NAME/GLOB "
            "(or hf://datasets/OWNER/NAME@REVISION/GLOB), e.g. hf://datasets/allenai/c4/en/c4-train.*.json.gz"
        )
    try:
        found = hub.list_files(pattern)
    except hub.HubListingError as error:
        return field, f"{pattern}: {error}"
    others = [name for name in found if not name.endswith(".parquet")]
    if others:
        return field, (
            f"{pattern} matches {len(others)} file(s) that are not Parquet ({', '.join(others[:3])}"
            f"{', ...' if len(others) > 3 else ''}): MaxText reads hf:// files as Parquet only "
            "(input_pipeline_utils.py make_parquet_iter_dataset); narrow the glob to the dataset's *.parquet files, "
            "or read JSON or text datasets with data kind hf"
        )
    if found:
        return None
    return field, (
        f"{pattern} matches no file of the dataset (listed through the Hub's API); check the glob against the "
        "dataset's Files tab (`*` stays within a directory, `**` crosses them)"
    )


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


#: The first 64 bytes of every Riegeli/records file, which ArrayRecord files are (array_record writes its records
#: as Riegeli chunks): the file signature chunk, fixed by the format (google/riegeli
#: ``doc/riegeli_records_file_format.md``, "File signature"); array_record 0.8's ``ArrayRecordWriter`` writes it too.
RIEGELI_SIGNATURE = bytes.fromhex(
    "83af70d10d884a3f 0000000000000000 4000000000000000 91bac23c9287e1a9"
    "0000000000000000 e19f13c0e9b1c372 7300000000000000 0000000000000000".replace(" ", "")
)


def _arrayrecord_issue(field: str, files: list[str], fix: str) -> tuple[str, str] | None:
    """Whether the first files are ArrayRecord files: each must begin with :data:`RIEGELI_SIGNATURE`.

    Read here, in the plan step (the pipeline image has no array_record; the 64 bytes need none), so that a file
    that is not ArrayRecord (text under an ``.arrayrecord`` name, a file cut short) is refused before anything is
    created; array_record's own reader does not refuse such a file when it opens it (it reports 0 records), and
    MaxText's grain pipeline would fail only when the stage reads it. ``fix``: how to name the files' own format.
    """
    for name in files[:16]:
        try:
            with _open_binary(name) as handle:
                head = handle.read(len(RIEGELI_SIGNATURE))
        except Exception as error:  # noqa: BLE001 - any failure of the storage client (OSError, a bad answer) is this
            return field, f"{name} cannot be read ({type(error).__name__}: {error}); give readable ArrayRecord files"
        if head != RIEGELI_SIGNATURE:
            return field, (
                f"{name} is not an ArrayRecord file (it does not begin with the Riegeli/records file signature); "
                f"replace it, or {fix}"
            )
    return None


def _open_binary(name: str):
    if name.startswith("gs://"):
        from etils import epath  # its import (0.1 s) only where a data file is on Cloud Storage

        return epath.Path(name).open("rb")
    return open(name, "rb")


def tokenizer_issue(field: str, stage: Any, site_packages: str | None) -> tuple[str, str] | None:
    """Whether the stage's tokenizer can be read as its ``type`` says, and its vocabulary matches the model's.

    Read here (the plan step): a local file or directory, or a ``gs://`` one; a ``maxtext:`` path when this
    environment has the maxtext package (``site_packages``), and the package's own. A sentencepiece ``.model``'s
    pieces are counted from its protobuf, a Hugging Face ``tokenizer.json``'s ids read, a tiktoken file's ranks
    counted (:func:`tokenizer_file_vocab`), so the check needs neither sentencepiece nor transformers.
    """
    tokenizer = stage.tokenizer.for_hf_pipeline() if isinstance(stage.data, HFData) else stage.tokenizer
    path = tokenizer.path
    if path.startswith(MAXTEXT_PREFIX) and site_packages is None:
        return None  # resolved in the trainer image (its vocabulary is known: TokenizerSpec.vocab_size)
    local = resolve_path(path, site_packages)
    try:
        if local.startswith("gs://"):
            from etils import epath  # its import (0.1 s) only where a tokenizer is on Cloud Storage

            source = epath.Path(local)
            if tokenizer.type == "huggingface":
                source = source / "tokenizer.json" if not local.endswith(".json") else source
            with tempfile.TemporaryDirectory() as scratch:
                copy = Path(scratch, "tokenizer.json" if tokenizer.type == "huggingface" else "tokenizer")
                copy.write_bytes(source.read_bytes())
                vocab = tokenizer_file_vocab(tokenizer.type, str(copy))
        elif not os.path.exists(local):
            return field, (
                f"{path!r} does not exist; give a readable {tokenizer.type} tokenizer "
                + ("(a directory with tokenizer.json)" if tokenizer.type == "huggingface" else "file")
            )
        else:
            vocab = tokenizer_file_vocab(tokenizer.type, local)
    except (OSError, ValueError) as error:
        cause = " ".join(str(error).split())[:200] or type(error).__name__
        return field, (
            f"{path!r} cannot be read as a {tokenizer.type} tokenizer ({cause}); check tokenizer.type and the path"
        )
    model_vocab = stage.model.vocab_size or maxtext.MODEL_DIMS.get(stage.model.name or "", {}).get("vocab_size")
    if model_vocab and vocab != model_vocab:
        return field.rsplit(".tokenizer.path", 1)[0] + ".model.vocab_size", (
            f"the model's vocab_size is {model_vocab} but tokenizer {path} has {vocab} tokens; set model.vocab_size: "
            f"{vocab} (or give the model's own tokenizer)"
        )
    return None


def stage_data_issues(where: str, stage: Any, site_packages: str | None) -> list[tuple[str, str]]:
    """A stage's data checks that read files: paths, globs, splits, Parquet files. ``(field, message)`` pairs."""
    data, issues = stage.data, []
    if not isinstance(data, SyntheticData):
        issue = tokenizer_issue(f"{where}.tokenizer.path", stage, site_packages)
        issues += [issue] if issue else []
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
            files = getattr(data, name)
            if not files:
                continue
            parts = mixture_parts(files)
            if len(parts) > 1 and data.file_type != "arrayrecord":
                issues.append((f"{where}.data.{name}", f"a weighted mixture of {data.file_type} files: MaxText 0.2.5 "
                               "mixes ArrayRecord files only (grain_data_processing.py get_datasets); give one glob, "
                               "or convert the sources to ArrayRecord"))  # fmt: skip
                continue
            for pattern, _ in parts:
                if pattern.startswith(HF_PREFIX):
                    issue = _hf_glob_issue(f"{where}.data.{name}", pattern)
                    issues += [issue] if issue else []
                    continue
                issue = _glob_issue(f"{where}.data.{name}", pattern, site_packages)
                if issue:
                    issues.append(issue)
                elif data.file_type == "parquet":
                    issue = _parquet_issue(f"{where}.data.{name}", expand_files((pattern,)), data.column)
                    issues += [issue] if issue else []
                elif data.file_type == "arrayrecord":
                    fix = "set data.file_type to the files' format (parquet, tfrecord), or use data kind text for text"
                    issue = _arrayrecord_issue(f"{where}.data.{name}", expand_files((pattern,)), fix)
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
    elif isinstance(data, TFDSData):
        for split_field, name_field in (("train_split", "dataset_name"), ("eval_split", "eval_dataset_name")):
            split = getattr(data, split_field)
            if not split:
                continue
            pattern = data.files(split, getattr(data, name_field))
            if _glob_issue(split_field, pattern, site_packages):
                issues.append((f"{where}.data.{split_field}", f"no {data.file_format} files of split {split!r}: "
                               f"{pattern!r} matches none (the TFDS layout MaxText reads); check dataset_path, "
                               "dataset_name, the split and file_format"))  # fmt: skip
            elif data.file_format == "array_record":
                found = expand_files((pattern,), (), site_packages)
                fix = "set data.file_format to the format TFDS wrote the dataset in (tfrecord)"
                issue = _arrayrecord_issue(f"{where}.data.{split_field}", found, fix)
                issues += [issue] if issue else []
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


def data_issues(
    spec: RunSpec, site_packages: str | None = None, hub_tokens: Mapping[str, str] | None = None
) -> list[tuple[str, str]]:
    """Every stage's data checks that read files or buckets (the plan step runs them before provision).

    A ``gs://`` path that cannot be read (no credentials, no network, no such bucket) is one issue naming
    the field; the storage client's own log of the failed request is not printed (:func:`quiet_storage_loggers`).
    ``hub_tokens``: stage name -> the Hugging Face token its ``hf://`` globs are listed with (the one its training
    pods get: :func:`multislice.steps.plan.stage_hub_tokens`); a stage not named lists with ``$HF_TOKEN``.
    """
    issues: list[tuple[str, str]] = []
    with quiet_storage_loggers():
        for i, stage in enumerate(spec.stages):
            with hub.listing_with((hub_tokens or {}).get(stage.name, "")):
                issues += stage_data_issues(f"stages[{i}] ({stage.name})", stage, site_packages)
    return issues
