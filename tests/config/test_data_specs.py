"""Hostile data specs (issue 25): each refused by the plan step, before prepare_data, preflight or provision, naming
the field and the fix, with nothing written; and the specs MaxText supports that the plan used to refuse."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest

from multislice import config
from multislice.config.data import (
    HF_LLAMA3_TOKENIZER,
    RIEGELI_SIGNATURE,
    SyntheticData,
    TokenizerSpec,
    mixture_parts,
    resolve_path,
    sentencepiece_pieces,
    tokenizer_file_vocab,
)
from multislice.config.hub import ENDPOINT_ENV, TOKEN_ENV
from multislice.plan import make_plan
from multislice.steps import plan as plan_step
from tests.conftest import run_in_trainer
from tests.hf_hub import FakeHub

TOKEN = "hf_" + "aB3" * 12  # the shape of a Hugging Face user access token (not a real one)


def profile_with(tmp_path, data, *, backend_gke=False, **stage):
    """The local profile (or the GKE one), output in ``tmp_path``, every stage on ``data`` (and ``stage``'s keys)."""
    profile = copy.deepcopy(config.read_profile("gke-v6e-16x2-seed" if backend_gke else "local"))
    profile["output_dir"] = "gs://bucket/out" if backend_gke else str(tmp_path / "out")
    profile.pop("example_stages", None)
    for entry in profile["stages"]:
        entry["data"] = data
        entry["eval_interval"] = -1
        entry.pop("export", None)
        entry.update(stage)
    return profile


#: Datasets of the loopback Hub (tests/hf_hub.py) the plan lists ``hf://`` globs on.
HUB = {"allenai/c4": {"main": ["en/c4-train.00000-of-00002.parquet", "en/c4-train.00001-of-00002.parquet",
                              "en/c4-train.00000-of-01024.json.gz", "en/c4-train.00001-of-01024.json.gz"]},
       "me/private": {"main": ["data/train-0.parquet"]}}  # fmt: skip


@pytest.fixture
def files(tmp_path, monkeypatch):
    """Small local files of each kind a spec may name (empty bodies: the plan lists and reads headers only), and
    the loopback Hub as ``$HF_ENDPOINT`` (no request leaves this machine)."""
    with FakeHub(HUB, private={"me/private": "hf_token_of_me"}) as hub:
        monkeypatch.setenv(ENDPOINT_ENV, hub.endpoint)
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        yield _make_files(tmp_path)


def _make_files(tmp_path):
    (tmp_path / "empty").mkdir()
    for name in ("web-0.array_record", "code-0.array_record"):  # what the plan reads of an ArrayRecord file
        (tmp_path / name).write_bytes(RIEGELI_SIGNATURE)
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    (tmp_path / "text").mkdir()
    (tmp_path / "text" / "web-0.arrayrecord").write_text("a text file under an ArrayRecord name\n")
    (tmp_path / "json").mkdir()
    (tmp_path / "json" / "c4-train.00000-of-01024.json.gz").write_bytes(b"\x1f\x8b\x08\x00 gzip, not Parquet")
    tfds = tmp_path / "tfds" / "c4" / "en" / "3.1.0"
    tfds.mkdir(parents=True)
    (tfds / "c4-train.tfrecord-00000-of-00001").write_bytes(b"")
    text_tfds = tmp_path / "tfds-text" / "c4" / "en" / "3.1.0"
    text_tfds.mkdir(parents=True)
    (text_tfds / "c4-train.array_record-00000-of-00001").write_text("not an ArrayRecord file\n")
    (tmp_path / "garbage.tiktoken").write_text("this is not a tiktoken file\n")
    (tmp_path / "garbage.model").write_bytes(b"\xff\xff\xff\xff\x0f not a protobuf")
    (tmp_path / "hf-no-json").mkdir()
    (tmp_path / "hf-bad-json").mkdir()
    (tmp_path / "hf-bad-json" / "tokenizer.json").write_text("{not json")
    (tmp_path / "small.tiktoken").write_text("IQ== 0\nIg== 1\n")  # 2 ranks + 256 special = 258 tokens
    return tmp_path


def _tok(kind, path):
    return {"type": kind, "path": path}


# (data, extra stage keys, field named, words the message must hold)
HOSTILE = {
    # globs
    "text-missing-file": ({"kind": "text", "files": ["{t}/nope.txt"]}, {}, "data.files[0]", "matches no file"),
    "text-empty-glob": ({"kind": "text", "files": ["{t}/empty/*.txt"]}, {}, "data.files[0]", "matches no file"),
    "grain-empty-glob": ({"kind": "grain", "train_files": "{t}/empty/*.ar"}, {}, "data.train_files", "matches no"),
    "grain-eval-empty": (
        {"kind": "grain", "train_files": "{t}/web-*", "eval_files": "{t}/empty/*"}, {}, "data.eval_files", "matches no"
    ),
    "grain-bad-parquet": (
        {"kind": "grain", "file_type": "parquet", "train_files": "{t}/bad.parquet"}, {}, "data.train_files",
        "not a readable Parquet",
    ),
    "hf-glob-no-repo": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/onlyowner"}, {}, "data.train_files",
        "not a Hugging Face Hub dataset path",
    ),
    "hf-glob-models-not-datasets": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://models/a/b/*.parquet"}, {}, "data.train_files",
        "hf://datasets/OWNER/NAME/GLOB",
    ),
    "hf-glob-matches-nothing": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/allenai/c4/en/nothing-*.parquet"}, {},
        "data.train_files", "matches no file of the dataset",
    ),
    "hf-glob-unknown-dataset": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/allenai/c44/en/*.parquet"}, {},
        "data.train_files", "the Hub has no dataset allenai/c44",
    ),
    "hf-glob-unknown-revision": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/allenai/c4@v9/en/*.parquet"}, {},
        "data.train_files", "at revision v9",
    ),
    "hf-glob-private-without-token": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/me/private/data/*.parquet"}, {},
        "data.train_files", "HTTP 401",
    ),
    "hf-glob-json-as-parquet": (
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/allenai/c4/en/c4-train.*.json.gz"}, {},
        "data.train_files", "2 file(s) that are not Parquet (en/c4-train.00000-of-01024.json.gz",
    ),
    "grain-json-as-parquet": (
        {"kind": "grain", "file_type": "parquet", "train_files": "{t}/json/*.json.gz"}, {}, "data.train_files",
        "is not a readable Parquet file",
    ),
    "grain-text-as-arrayrecord": (
        {"kind": "grain", "train_files": "{t}/text/*.arrayrecord"}, {}, "data.train_files",
        "web-0.arrayrecord is not an ArrayRecord file (it does not begin with the Riegeli/records file signature)",
    ),
    "tfds-text-as-array-record": (
        {"kind": "tfds", "dataset_path": "{t}/tfds-text", "dataset_name": "c4/en:3.1.0", "file_format": "array_record"},
        {}, "data.train_split", "is not an ArrayRecord file",
    ),
    "hf-path-right-to-left-override": (
        {"kind": "hf", "path": "allenai/c4\u202e"}, {}, "data.hf.path", "U+202E (RIGHT-TO-LEFT OVERRIDE)",
    ),
    "hf-path-zero-width-space-in-data-dir": (
        {"kind": "hf", "path": "allenai/c4", "data_dir": "en\u200b"}, {}, "data.hf.data_dir", "U+200B",
    ),
    "text-glob-with-a-newline": ({"kind": "text", "files": ["{t}/a.txt\n"]}, {}, "data.text.files", "U+000A"),
    "hf-path-not-a-hub-name": (
        {"kind": "hf", "path": "allenai/c4/en"}, {}, "data.hf.path", "is not a Hugging Face Hub repository id",
    ),
    "hf-path-double-dash": ({"kind": "hf", "path": "allenai/c4--en"}, {}, "data.hf.path", "no '--' or '..'"),
    "hf-glob-arrayrecord": (
        {"kind": "grain", "train_files": "hf://datasets/a/b/*.array_record"}, {}, "data.train_files",
        "as Parquet only",
    ),
    "hf-glob-tfrecord": (
        {"kind": "grain", "file_type": "tfrecord", "train_files": "hf://datasets/a/b/*"}, {}, "data.train_files",
        "as Parquet only",
    ),
    # mixtures
    "mixture-no-weight": (
        {"kind": "grain", "train_files": "{t}/web-*;{t}/code-*"}, {}, "data.grain.train_files", "glob,weight"
    ),
    "mixture-two-commas": (
        {"kind": "grain", "train_files": "{t}/web-*,0.5,1;{t}/code-*,0.5"}, {}, "data.grain.train_files", "glob,weight"
    ),
    "mixture-weight-word": (
        {"kind": "grain", "train_files": "{t}/web-*,half;{t}/code-*,0.5"}, {}, "data.grain.train_files",
        "is not a number",
    ),
    "mixture-zero-weight": (
        {"kind": "grain", "train_files": "{t}/web-*,0;{t}/code-*,1"}, {}, "data.grain.train_files", "positive finite"
    ),
    "mixture-negative-weight": (
        {"kind": "grain", "train_files": "{t}/web-*,-1;{t}/code-*,1"}, {}, "data.grain.train_files", "positive finite"
    ),
    "mixture-inf-weight": (
        {"kind": "grain", "train_files": "{t}/web-*,inf;{t}/code-*,1"}, {}, "data.grain.train_files", "positive finite"
    ),
    "mixture-empty-glob": (
        {"kind": "grain", "train_files": ",1;{t}/code-*,1"}, {}, "data.grain.train_files", "glob,weight"
    ),
    "mixture-part-missing": (
        {"kind": "grain", "train_files": "{t}/web-*,0.7;{t}/empty/*,0.3"}, {}, "data.train_files", "matches no file"
    ),
    "mixture-of-parquet": (
        {"kind": "grain", "file_type": "parquet", "train_files": "{t}/a*,1;{t}/b*,1"}, {}, "data.train_files",
        "mixes ArrayRecord files only",
    ),
    # tokens where they would be written in plain text
    "token-key-in-overrides": (
        {"kind": "synthetic"}, {"maxtext_overrides": {"hf_access_token": TOKEN}}, "maxtext_overrides.hf_access_token",
        "Kubernetes Secret",
    ),
    "token-value-in-other-key": (
        {"kind": "synthetic"}, {"maxtext_overrides": {"run_description": f"x {TOKEN}"}},
        "maxtext_overrides.run_description", "credential",
    ),
    "token-in-a-list": (
        {"kind": "synthetic"}, {"maxtext_overrides": {"tags": ["a", TOKEN]}}, "maxtext_overrides.tags", "credential"
    ),
    "token-as-secret-version": (
        {"kind": "hf", "path": "a/b", "hf_token_secret": TOKEN}, {}, "data.hf.hf_token_secret",
        "a token (a secret: store it in Secret Manager)",
    ),
    "token-as-kubernetes-secret": (
        {"kind": "hf", "path": "a/b", "hf_token_kubernetes_secret": TOKEN}, {}, "data.hf.hf_token_kubernetes_secret",
        "never the token",
    ),
    "kubernetes-secret-on-local": (
        {"kind": "hf", "path": "a/b", "hf_token_kubernetes_secret": "hf-token"}, {}, "data.hf_token_kubernetes_secret",
        "export HF_TOKEN",
    ),
    "both-secrets": (
        {"kind": "hf", "path": "a/b", "hf_token_kubernetes_secret": "hf-token",
         "hf_token_secret": "projects/p/secrets/s/versions/1"}, {}, "data.hf_token_secret", "keep one",
    ),  # fmt: skip
    "secret-manager-with-ray": (
        {"kind": "hf", "path": "a/b", "hf_token_secret": "projects/p/secrets/s/versions/latest"}, {"launcher": "ray"},
        "data.hf_token_secret", "hf_token_kubernetes_secret",
    ),
    # data too short for the steps
    "declared-too-few": (
        {"kind": "grain", "train_files": "{t}/web-*", "sequences": 100}, {}, "steps",
        "20 steps x 16 sequences per step = 320 sequences, but the data holds 100",
    ),
    "declared-too-few-epochs": (
        {"kind": "grain", "train_files": "{t}/web-*", "sequences": 100}, {"maxtext_overrides": {"num_epoch": 2}},
        "steps", "x num_epoch 2",
    ),
    "declared-hf-too-few": ({"kind": "hf", "path": "a/b", "sequences": 10}, {}, "steps", "Lower steps to at most 0"),
    "declared-tfds-too-few": (
        {"kind": "tfds", "dataset_path": "{t}/tfds", "dataset_name": "c4/en:3.1.0", "sequences": 300}, {}, "steps",
        "maxtext_overrides.num_epoch: 2",
    ),
    "declared-zero": ({"kind": "hf", "path": "a/b", "sequences": 0}, {}, "data.hf.sequences", "greater than 0"),
    # unreadable or mismatched tokenizers
    "tiktoken-garbage": (
        {"kind": "grain", "train_files": "{t}/web-*"}, {"tokenizer": _tok("tiktoken", "{t}/garbage.tiktoken")},
        "tokenizer.path", "cannot be read as a tiktoken tokenizer",
    ),
    "sentencepiece-garbage": (
        {"kind": "grain", "train_files": "{t}/web-*"}, {"tokenizer": _tok("sentencepiece", "{t}/garbage.model")},
        "tokenizer.path", "cannot be read as a sentencepiece tokenizer",
    ),
    "hf-tokenizer-no-json": (
        {"kind": "grain", "train_files": "{t}/web-*"}, {"tokenizer": _tok("huggingface", "{t}/hf-no-json")},
        "tokenizer.path", "cannot be read as a huggingface tokenizer",
    ),
    "hf-tokenizer-bad-json": (
        {"kind": "grain", "train_files": "{t}/web-*"}, {"tokenizer": _tok("huggingface", "{t}/hf-bad-json")},
        "tokenizer.path", "no readable tokenizer.json",
    ),
    "tokenizer-missing": (
        {"kind": "grain", "train_files": "{t}/web-*"}, {"tokenizer": _tok("sentencepiece", "{t}/nope.model")},
        "tokenizer.path", "does not exist",
    ),
    "sentencepiece-vocab-mismatch": (
        {"kind": "grain", "train_files": "{t}/web-*"},
        {"tokenizer": _tok("sentencepiece", "maxtext:assets/tokenizers/tokenizer.llama2")}, "model.vocab_size",
        "has 32000 tokens",
    ),
    "hf-data-sentencepiece": (
        {"kind": "hf", "path": "a/b"},
        {"tokenizer": _tok("sentencepiece", "maxtext:assets/tokenizers/tokenizer.llama2")},
        "tokenizer", "AutoTokenizer",
    ),
    "hf-data-other-tiktoken": (
        {"kind": "hf", "path": "a/b"}, {"tokenizer": _tok("tiktoken", "{t}/small.tiktoken")}, "tokenizer",
        "AutoTokenizer",
    ),
    # TFDS on grain
    "tfds-no-split-files": (
        {"kind": "tfds", "dataset_path": "{t}/tfds", "dataset_name": "c4/en:3.1.0", "train_split": "validation"}, {},
        "data.train_split", "no tfrecord files of split 'validation'",
    ),
    "tfds-other-file-format": (
        {"kind": "tfds", "dataset_path": "{t}/tfds", "dataset_name": "c4/en:3.1.0", "file_format": "array_record"}, {},
        "data.train_split", "no array_record files",
    ),
    "tfds-no-version": (
        {"kind": "tfds", "dataset_path": "{t}/tfds", "dataset_name": "c4/en"}, {}, "data.tfds.dataset_name",
        "has no version",
    ),
    # elastic stages: grain's elastic iterator (their data position across resizes) reads one ArrayRecord glob only
    "elastic-on-tfrecord": (
        {"kind": "tfds", "dataset_path": "{t}/tfds", "dataset_name": "c4/en:3.1.0"}, {"elastic": {"min_slices": 1}},
        "data", "ArrayRecord files only, not tfds (grain over TFRecord)",
    ),
    "elastic-on-a-mixture": (
        {"kind": "grain", "train_files": "{t}/web-*,0.7;{t}/code-*,0.3"}, {"elastic": {"min_slices": 1}}, "data",
        "does not allow on a mixture",
    ),
}  # fmt: skip


def _filled(value, tmp):
    return json.loads(json.dumps(value).replace("{t}", str(tmp)))


def test_there_are_at_least_thirty_hostile_data_specs():
    assert len(HOSTILE) >= 30


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_a_hostile_data_spec_is_refused_by_the_plan_naming_the_field(files, case):
    data, stage, field, says = _filled(HOSTILE[case], files)
    with pytest.raises(config.ConfigError) as caught:
        plan_step.run(profile_with(files, data, **stage), {})
    message = str(caught.value)
    assert f".{field}" in message or f"{field}:" in message, message
    assert says in message, message
    assert "nothing was created or started" in message and TOKEN not in message  # the token is never echoed
    out = files / "out"
    assert not out.exists() or not any(out.rglob("*")), "the plan wrote something before refusing"


def test_a_hugging_face_token_never_reaches_the_rendered_jobset_or_the_plan(tmp_path):
    from multislice.render import jobset

    profile = profile_with(tmp_path, {"kind": "hf", "path": "allenai/c4", "hf_token_kubernetes_secret": "hf-token"},
                           backend_gke=True)  # fmt: skip
    plan = make_plan(config.load_spec(profile))
    stage = plan.stages[0]
    rendered = jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id="run-1")
    container = rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    token_env = [e for e in container["env"] if e["name"] == "HF_TOKEN"]
    assert token_env == [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}}]
    assert not any("hf_access_token" in a for a in container["args"])
    # Secret Manager: the pod reads the version at start and execs the worker with $HF_TOKEN set
    profile["stages"][0]["data"] = {"kind": "hf", "path": "allenai/c4",
                                    "hf_token_secret": "projects/p/secrets/hf/versions/latest"}  # fmt: skip
    plan = make_plan(config.load_spec(profile))
    rendered = jobset.render_jobset(plan, plan.stages[0], hardware="tpu", pipeline_run_id="run-1")
    container = rendered["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == [
        "python", "-m", "multislice.trainer.hub_token", "--secret-version", "projects/p/secrets/hf/versions/latest",
        "--", "python", "-m", "multislice.trainer.worker",
    ]  # fmt: skip


def test_what_maxtext_supports_is_accepted(files):
    """A weighted ArrayRecord mixture, an hf:// Parquet glob, TFDS data in its prepared layout, and hf data with the
    default tokenizer: each planned, mapped onto MaxText's own arguments."""
    accepted = [
        {"kind": "grain", "train_files": f"{files}/web-*,0.7;{files}/code-*,0.3"},
        {"kind": "grain", "file_type": "parquet", "train_files": "hf://datasets/allenai/c4/en/c4-train.*.parquet"},
        {"kind": "tfds", "dataset_path": f"{files}/tfds", "dataset_name": "c4/en:3.1.0"},
        {"kind": "hf", "path": "allenai/c4", "sequences": 320},  # exactly enough for 20 steps x 16
    ]
    for data in accepted:
        plan = plan_step.run(profile_with(files, data), {})
        assert plan.stages[0].maxtext_args
        for child in (files / "out").iterdir():  # each plan writes its run directory: start the next afresh
            shutil.rmtree(child)


def test_mixture_parts_follow_maxtexts_split():
    assert mixture_parts("gs://b/a*,0.3;gs://b/b*,0.7") == [("gs://b/a*", 0.3), ("gs://b/b*", 0.7)]
    assert mixture_parts("gs://b/a*") == [("gs://b/a*", None)]


def test_tokenizer_vocabularies_are_read_without_the_tokenizer_libraries(files):
    shipped = resolve_path(HF_LLAMA3_TOKENIZER)
    assert Path(shipped, "tokenizer.json").is_file()
    assert tokenizer_file_vocab("huggingface", shipped) == 128256 == TokenizerSpec().vocab_size()
    assert tokenizer_file_vocab("tiktoken", str(files / "small.tiktoken")) == 258
    with pytest.raises(ValueError):
        sentencepiece_pieces(b"\x08")  # a varint field cut short
    # a minimal ModelProto: two pieces (field 1, length-delimited) and a trainer spec (field 2)
    assert sentencepiece_pieces(b"\x0a\x03\x0a\x01a" + b"\x0a\x03\x0a\x01b" + b"\x12\x00") == 2
    assert SyntheticData().kind == "synthetic"


def test_an_arrayrecord_file_array_record_writes_passes_the_plans_check(files, trainer_python):
    """The signature the plan compares is the one array_record itself writes (a file made in the trainer
    environment), and such a file is planned; the same bytes as text under an ArrayRecord name are refused."""
    written = files / "real" / "web-00000.array_record"
    written.parent.mkdir()
    script = (
        "import sys\n"
        "from array_record.python.array_record_module import ArrayRecordWriter\n"
        "writer = ArrayRecordWriter(sys.argv[1], 'group_size:1')\n"
        "writer.write(b'a record')\n"
        "writer.close()\n"
    )
    done = run_in_trainer(trainer_python, script, str(written), timeout=120)
    assert done.returncode == 0, done.stderr
    assert written.read_bytes()[: len(RIEGELI_SIGNATURE)] == RIEGELI_SIGNATURE
    plan = plan_step.run(profile_with(files, {"kind": "grain", "train_files": f"{written.parent}/*.array_record"}), {})
    assert plan.stages[0].maxtext_args


def test_hub_names_follow_huggingface_hubs_own_rules(trainer_python):
    """:func:`multislice.config.values.hub_repo_id_problem` keeps huggingface_hub's ``validate_repo_id`` rules (the
    pipeline image has no huggingface_hub): both agree on each name, checked against the library in the trainer
    environment."""
    from multislice.config.values import hub_repo_id_problem

    names = ["allenai/c4", "c4", "HuggingFaceFW/fineweb-edu", "a_b/c.d-e", "_x/y_", "a/b/c", "-a/b", "a/b-", ".a",
             "a--b", "a..b", "x.git", "x/y.git", "a" * 96, "a" * 97, "o/" + "n" * 96, "café/x", "a b", "", "a/",
             "/a", "datasets/a/b", "a:b", "a\u202e"]  # fmt: skip
    script = (
        "import json, sys\n"
        "from huggingface_hub.utils import HFValidationError, validate_repo_id\n"
        "def ok(name):\n"
        "    try:\n"
        "        validate_repo_id(name)\n"
        "    except HFValidationError:\n"
        "        return False\n"
        "    return True\n"
        "print(json.dumps([ok(n) for n in json.loads(sys.argv[1])]))\n"
    )
    done = run_in_trainer(trainer_python, script, json.dumps(names), timeout=120)
    assert done.returncode == 0, done.stderr
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    ours = [hub_repo_id_problem(name) is None for name in names]
    assert ours == theirs, [(n, o, t) for n, o, t in zip(names, ours, theirs, strict=True) if o != t]


def test_text_sources_a_gke_pod_cannot_read_are_refused_by_the_config(tmp_path):
    """A ``site-packages:`` glob (this machine's trainer environment) or a local path as a ``text`` stage's source on
    GKE: refused when the spec is loaded (render, compile, submit, the plan), naming the field and the fix, not when
    prepare_data's pods would start."""
    for pattern in ("site-packages:*.dist-info/METADATA", str(tmp_path / "*.txt")):
        profile = profile_with(tmp_path, {"kind": "text", "files": ["gs://corpus/a/*.txt", pattern]}, backend_gke=True)
        with pytest.raises(config.ConfigError) as caught:
            config.load_spec(profile)
        message = str(caught.value)
        assert ".data.files[1]" in message and "a GKE pod does not have" in message, message
        assert "copy the corpus to a gs:// bucket" in message and ".data.files[0]" not in message
    profile = profile_with(tmp_path, {"kind": "text", "files": ["gs://corpus/a/*.txt"]}, backend_gke=True)
    assert config.load_spec(profile).stages[0].data.files == ("gs://corpus/a/*.txt",)
