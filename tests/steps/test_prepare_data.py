"""Data specs, tokenizer and prepare_data: each maps onto MaxText's input pipelines; bad specs fail in the plan step."""

from __future__ import annotations

import copy
import json

import pytest

from multislice import config, metrics
from multislice.backends.base import DataWorkersFailed
from multislice.config.data import TextData, TokenizerSpec, recipe_key
from multislice.delivery import artifacts
from multislice.errors import InputError
from multislice.plan import make_plan
from multislice.reports import TrainReport
from multislice.steps import plan as plan_step
from multislice.steps import prepare_data
from tests.conftest import run_in_trainer


def profile_with(tmp_path, data, **stage):
    """The local profile, output in ``tmp_path``, both stages on ``data`` (and ``stage``'s keys)."""
    profile = copy.deepcopy(config.read_profile("local"))
    profile["output_dir"] = str(tmp_path / "out")
    for entry in profile["stages"]:
        entry["data"] = data
        entry.update(stage)
    return profile


def args_of(profile, index=0):
    return dict(a.split("=", 1) for a in make_plan(config.load_spec(profile)).stages[index].maxtext_args)


def refused(profile):
    with pytest.raises(config.ConfigError) as caught:
        plan_step.run(profile, {})
    return str(caught.value)


@pytest.fixture
def corpus(tmp_path):
    folder = tmp_path / "corpus"
    folder.mkdir()
    for i in range(40):
        (folder / f"doc{i:02d}.txt").write_text(
            f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 30
        )
    return folder


def test_the_local_profile_trains_on_text_prepared_with_the_llama3_tokenizer():
    spec = config.load_profile("local")
    for stage in spec.stages:
        assert stage.data.kind == "text" and stage.tokenizer.path.endswith("tokenizer_llama3.tiktoken")
        assert stage.model.vocab_size == stage.tokenizer.vocab_size() == 128256
        assert stage.eval_interval > 0
    args = dict(a.split("=", 1) for a in make_plan(spec).stages[0].maxtext_args)
    assert (args["dataset_type"], args["grain_file_type"], args["tokenize_train_data"]) == (
        "grain",
        "arrayrecord",
        "false",
    )
    assert args["grain_train_files"].endswith("/train-*.array_record")
    assert args["grain_eval_files"].endswith("/eval-*.array_record")
    assert (args["tokenizer_type"], args["tokenizer_path"]) == (
        "tiktoken",
        "maxtext:assets/tokenizers/tokenizer_llama3.tiktoken",  # resolved by the worker, in the pod
    )
    assert args["eval_interval"] == "5"


def test_each_data_kind_maps_onto_maxtexts_own_arguments(tmp_path):
    assert args_of(profile_with(tmp_path, {"kind": "synthetic"}, eval_interval=-1))["dataset_type"] == "synthetic"
    grain = args_of(
        profile_with(
            tmp_path,
            {
                "kind": "grain",
                "file_type": "parquet",
                "train_files": "gs://b/train-*.parquet",
                "eval_files": "gs://b/e*",
            },
        )
    )
    assert (grain["dataset_type"], grain["grain_file_type"], grain["grain_train_files"]) == (
        "grain", "parquet", "gs://b/train-*.parquet"
    )  # fmt: skip
    assert (grain["grain_eval_files"], grain["tokenize_train_data"], grain["train_data_columns"]) == (
        "gs://b/e*", "true", "[text]"
    )  # fmt: skip
    hf = args_of(
        profile_with(tmp_path, {"kind": "hf", "path": "allenai/c4", "data_dir": "en", "eval_split": "validation"})
    )
    assert (hf["dataset_type"], hf["hf_path"], hf["hf_data_dir"], hf["hf_eval_split"]) == (
        "hf", "allenai/c4", "en", "validation"
    )  # fmt: skip
    # MaxText's hf pipeline loads tokenizers with AutoTokenizer only: the default tiktoken file's HF form, shipped
    assert (hf["tokenizer_type"], hf["tokenizer_path"]) == ("huggingface", "multislice:data/tokenizers/llama3-hf")
    assert "hf_access_token" not in hf
    tfds = args_of(
        profile_with(
            tmp_path,
            {"kind": "tfds", "dataset_path": "gs://b/tfds", "dataset_name": "c4/en:3.1.0", "eval_split": "validation"},
        )
    )
    # on grain over TFRecord, as MaxText's construct_tfds_tfrecord_path builds the glob: no TensorFlow needed
    assert (tfds["dataset_type"], tfds["grain_file_type"]) == ("grain", "tfrecord")
    assert tfds["train_data_columns"] == "[text]"
    assert (tfds["grain_train_files"], tfds["grain_eval_files"]) == (
        "gs://b/tfds/c4/en/3.1.0/*-train.tfrecord-*", "gs://b/tfds/c4/en/3.1.0/*-validation.tfrecord-*"
    )  # fmt: skip
    assert "dataset_name" not in tfds and tfds["tokenize_train_data"] == "true"
    mixture = args_of(
        profile_with(
            tmp_path,
            {"kind": "grain", "train_files": "gs://b/web-*.array_record,0.7;gs://b/code-*,0.3"},
            eval_interval=-1,
        )
    )
    assert mixture["grain_train_files"] == "gs://b/web-*.array_record,0.7;gs://b/code-*,0.3"  # MaxText's own syntax


def test_vocab_size_must_match_the_tokenizer(tmp_path):
    profile = profile_with(tmp_path, {"kind": "text", "files": [str(tmp_path / "*.txt")]})
    profile["stages"][0]["model"]["vocab_size"] = 32000
    with pytest.raises(
        config.ConfigError, match=r"stages\[0\] \(tiny-8b-recipe\): model\.vocab_size: .* 32000 .* 128256 tokens"
    ):
        config.load_spec(profile)


def test_eval_interval_needs_an_eval_split(tmp_path):
    with pytest.raises(config.ConfigError, match="eval_interval is 5 but the stage's data has no eval split"):
        config.load_spec(profile_with(tmp_path, {"kind": "synthetic"}))


@pytest.mark.parametrize(
    ("data", "field", "says"),
    [
        ({"kind": "text", "files": ["/nonexistent/corpus.txt"]}, "data.files[0]", "matches no file"),
        ({"kind": "text", "files": ["{tmp}/empty/*.jsonl"], "format": "jsonl"}, "data.files[0]", "matches no file"),
        ({"kind": "grain", "train_files": "{tmp}/empty/*.array_record"}, "data.train_files", "matches no file"),
        (
            {"kind": "grain", "file_type": "parquet", "train_files": "{tmp}/bad.parquet"},
            "data.train_files",
            "is not a readable Parquet file",
        ),
        (
            {"kind": "text", "format": "parquet", "files": ["{tmp}/cut.parquet"]},
            "data.files",
            "is not a readable Parquet file",
        ),
        ({"kind": "hf", "path": "{tmp}/hf", "eval_split": "validation"}, "data.eval_split", "split 'validation'"),
        ({"kind": "hf", "path": "{tmp}/missing-dir"}, "data.path", "is not a directory"),
        (
            {"kind": "tfds", "dataset_path": "{tmp}/tfds", "dataset_name": "c4/en:3.1.0", "eval_split": "validation"},
            "data.eval_split",
            "no tfrecord files of split 'validation'",
        ),
    ],
    ids=[
        "missing-path",
        "empty-glob",
        "grain-empty-glob",
        "unreadable-parquet",
        "parquet-cut-short",
        "hf-split",
        "hf-path",
        "tfds-split",
    ],  # fmt: skip
)
def test_bad_data_specs_fail_in_the_plan_step_naming_the_field(tmp_path, data, field, says):
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad.parquet").write_bytes(b"this is not parquet")
    (tmp_path / "cut.parquet").write_bytes(b"PAR1" + b"\0" * 64)  # begun but never finished (no footer)
    (tmp_path / "hf" / "data").mkdir(parents=True)
    (tmp_path / "hf" / "data" / "train-00000-of-00001.parquet").write_bytes(b"")
    (tmp_path / "tfds" / "c4" / "en" / "3.1.0").mkdir(parents=True)
    (tmp_path / "tfds" / "c4" / "en" / "3.1.0" / "c4-train.tfrecord-00000-of-00001").write_bytes(b"")
    data = json.loads(json.dumps(data).replace("{tmp}", str(tmp_path)))
    message = refused(profile_with(tmp_path, data, eval_interval=-1))
    assert f"stages[0] (tiny-8b-recipe).{field}: " in message and says in message
    assert "nothing was created or started" in message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.json"))  # no report: nothing ran


def test_prepare_data_tokenizes_once_and_reuses_the_shards(tmp_path, corpus, capsys, trainer_python):
    data = {"kind": "text", "files": [str(corpus / "*.txt")], "eval_fraction": 0.2}
    profile = profile_with(tmp_path, data, steps=4, checkpoint_period=4)  # 4 x 16 sequences: within the data
    plan = plan_step.run(profile, {})
    first = prepare_data.run(plan, plan.stage("tiny-8b-recipe"))
    manifest = first.manifest
    assert not first.reused and first.uri == plan.stages[0].data_dir
    assert len(manifest["sources"]) == 40 and all(len(s["sha256"]) == 64 for s in manifest["sources"])
    assert manifest["tokenizer"]["vocab_size"] == 128256 and manifest["shard_count"] == len(manifest["shards"])
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    assert train["documents"] + held["documents"] == 40 and held["documents"] > 0
    assert manifest["token_count"] == train["tokens"] + held["tokens"]
    # one record per document piece: a document never shares a record; MaxText packs them (first_fit)
    assert train["sequences"] >= train["documents"] and train["sequences"] * 128 >= train["tokens"]
    assert train["rows_packed_at_least"] == -(-train["tokens"] // 128) and train["rows_unpacked"] == train["sequences"]
    assert train["padding_tokens_unpacked"] == train["sequences"] * 128 - train["tokens"]
    # the same inputs and tokenizer: the second stage (same recipe) reuses the shards, and says so
    second = prepare_data.run(plan, plan.stage("tiny-70b-recipe"))
    assert second.reused and second.manifest["fingerprint"] == manifest["fingerprint"]
    assert f"reusing {manifest['shard_count']} shards" in capsys.readouterr().out
    # MaxText's own grain parser reads the records as pre-tokenized sequences
    script = (
        "import sys, grain.python as grain\n"
        "from maxtext.input_pipeline.input_pipeline_utils import ParseFeatures\n"
        "source = grain.ArrayRecordDataSource(sys.argv[1:])\n"
        "row = ParseFeatures(['text'], False).map(source[0])['text']\n"
        "print(len(source), row.dtype, len(row), row[0])\n"
    )
    shards = [f"{first.uri}/{name}" for name in manifest["splits"]["train"]["shards"]]
    done = run_in_trainer(trainer_python, script, *shards)
    assert done.returncode == 0, done.stderr[-2000:]
    length, dtype, first_length, bos = done.stdout.split()
    assert (length, dtype, bos) == (str(train["sequences"]), "int32", "128000")  # begins with Llama 3's BOS
    # the data must last: 20 steps x 16 sequences run past the rows MaxText packs the records into (at least
    # ceil(tokens / 128)), refused with both figures
    rows = train["rows_packed_at_least"]
    longer = plan_step.run(profile_with(tmp_path, data, steps=20, checkpoint_period=10), {})
    with pytest.raises(InputError) as caught:
        prepare_data.run(longer, longer.stage("tiny-8b-recipe"))
    said = str(caught.value) + " " + caught.value.fix
    assert f"20 steps x 16 sequences per step = 320 sequences, but the data holds {rows}" in said
    assert f"Lower steps to at most {rows // 16}" in said and "num_epoch" in said
    # a changed source file: tokenized again
    (corpus / "doc00.txt").write_text("Something else entirely. " * 50)
    third = prepare_data.run(plan, plan.stage("tiny-8b-recipe"))
    assert not third.reused and third.manifest["fingerprint"] != manifest["fingerprint"]


def test_prepare_data_tokenizes_with_maxtexts_sentencepiece_tokenizer(tmp_path, corpus, trainer_python):
    # MaxText's SentencePieceTokenizer has no n_words: its vocabulary is its processor's piece count
    data = {"kind": "text", "files": [str(corpus / "*.txt")], "eval_fraction": 0.2}
    sentencepiece = {"type": "sentencepiece", "path": "maxtext:assets/tokenizers/tokenizer.llama2"}
    profile = profile_with(tmp_path, data, tokenizer=sentencepiece, steps=4, checkpoint_period=4)
    for entry in profile["stages"]:
        entry["model"]["vocab_size"] = 32000  # Llama 2's, as the tokenizer's
        entry.pop("export", None)  # the exporter reads a sentencepiece file named .model only
    plan = plan_step.run(profile, {})
    manifest = prepare_data.run(plan, plan.stage("tiny-8b-recipe")).manifest
    assert manifest["tokenizer"]["type"] == "sentencepiece" and manifest["tokenizer"]["vocab_size"] == 32000
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    assert train["documents"] + held["documents"] == 40 and train["tokens"] > 0


def test_prepare_data_reads_json_lines_and_parquet_without_packing(tmp_path, trainer_python):
    rows = [{"text": f"Row {i}: " + "word " * (20 + 40 * (i % 3))} for i in range(60)]
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    write = "import sys, json, pyarrow as pa, pyarrow.parquet as pq\n" + (
        "pq.write_table(pa.table({'text': [json.loads(l)['text'] for l in open(sys.argv[1])]}), sys.argv[2])"
    )  # pyarrow is the trainer environment's
    done = run_in_trainer(trainer_python, write, str(tmp_path / "a.jsonl"), str(tmp_path / "b.parquet"))
    assert done.returncode == 0, done.stderr[-2000:]
    manifests = {}
    for fmt, name in (("jsonl", "a.jsonl"), ("parquet", "b.parquet")):
        data = {"kind": "text", "files": [str(tmp_path / name)], "format": fmt, "packing": False, "eval_fraction": 0.3}
        plan = plan_step.run(profile_with(tmp_path, data, steps=2, checkpoint_period=2), {})
        manifests[fmt] = prepare_data.run(plan, plan.stage("tiny-8b-recipe")).manifest
    for manifest in manifests.values():
        splits = manifest["splits"]
        assert splits["train"]["documents"] + splits["eval"]["documents"] == 60
        # every document (at most ~105 tokens with BOS and EOS) is a record of its own
        assert splits["train"]["sequences"] + splits["eval"]["sequences"] == 60
        assert 0 < splits["train"]["padding_fraction_unpacked"] < 1
    assert manifests["jsonl"]["token_count"] == manifests["parquet"]["token_count"]


def test_the_shards_directory_is_named_by_the_recipe():
    data = TextData(files=("a/*.txt",))
    key = recipe_key(data, TokenizerSpec(), 128)
    assert key == recipe_key(TextData(files=("a/*.txt",), cache_dir="/elsewhere"), TokenizerSpec(), 128)
    assert (
        key
        != recipe_key(data, TokenizerSpec(), 256)
        != recipe_key(TextData(files=("a/*.txt",), concatenate=True), TokenizerSpec(), 128)
    )
    # MaxText's packing is applied as it reads the records: the same records serve a packed and an unpacked stage
    assert key == recipe_key(TextData(files=("a/*.txt",), packing=False), TokenizerSpec(), 128)


def test_eval_lines_become_records_the_report_and_the_plot_read():
    line = "Completed eval after train step 5, loss=7.123, perplexity=1239.400, total_weights=2048.0, avg_z_loss=0.000"
    assert metrics.parse_eval_line(line) == {
        "eval_after_step": 5,
        "eval/avg_loss": 7.123,
        "eval/avg_perplexity": 1239.4,
    }
    records = [
        metrics.parse_step_line(
            f"completed step: {s}, seconds: 1.0, TFLOP/s/device: 1.0, Tokens/s/device: 2.0, loss: {9 - s / 10}"
        )
        for s in range(12)
    ] + [
        metrics.parse_eval_line(line.replace("step 5", f"step {s}").replace("7.123", str(10 - s / 5)))
        for s in (0, 5, 10)
    ]
    assert metrics.summarize(records).steps_recorded == 12  # eval records have no step: the train summary ignores them
    summary = metrics.summarize_eval(records)
    assert summary == {"first_eval_loss": 10.0, "final_eval_loss": 8.0, "final_eval_perplexity": 1239.4, "evals": 3}
    figure = artifacts.training_figure(records, "t")
    loss_axes = figure.axes[0]
    assert [list(line.get_ydata()) for line in loss_axes.lines][1] == [10.0, 9.0, 8.0]  # eval beside train
    report = TrainReport(jobset="j", steps_trained=12, first_loss=9, final_loss=7.9, **summary, restarts=0,
                         tokens_per_second_per_device=2.0)  # fmt: skip
    assert "Eval loss **10.000 -> 8.000**" in artifacts.train_markdown("s", report)
    assert "final eval loss" in artifacts.train_columns(report).values()


def test_the_worker_resolves_maxtext_package_paths_in_the_pod(trainer_python):
    """The JobSet worker and the Ray driver's workers build MaxText's argv in one place, tokenizer path resolved."""
    script = (
        "import os\n"
        "from multislice.trainer.worker import maxtext_argv\n"
        "base, argv = maxtext_argv(['tokenizer_path=maxtext:assets/tokenizers/tokenizer_llama3.tiktoken'])\n"
        "value = argv[-1].split('=')[1]\n"
        "print(value.endswith('maxtext/assets/tokenizers/tokenizer_llama3.tiktoken'), os.path.isfile(value),\n"
        "      argv[1] == str(base) and base.is_file())\n"
    )
    done = run_in_trainer(trainer_python, script)
    assert done.returncode == 0 and done.stdout.split() == ["True", "True", "True"], done.stderr[-2000:]


@pytest.mark.parametrize(
    ("extra", "field", "says"),
    [
        ({"workers": 0}, "data.text.workers", "greater than or equal to 1"),
        ({"workers": 100_001}, "data.text.workers", "less than or equal to 10000"),
        ({"workers": 2, "parallelism": 3}, "data.text.parallelism", "parallelism 3 is more than workers 2"),
        ({"parallelism": 0}, "data.text.parallelism", "greater than or equal to 1"),
        ({"workers": "two"}, "data.text.workers", "valid integer"),
    ],
    ids=["no-worker", "too-many", "parallelism-above-workers", "no-parallelism", "not-a-number"],
)
def test_bad_shard_worker_fields_are_refused_at_plan_naming_the_field(tmp_path, corpus, extra, field, says):
    data = {"kind": "text", "files": [str(corpus / "*.txt")], **extra}
    message = refused(profile_with(tmp_path, data, eval_interval=-1))
    assert field in message and says in message, message
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("*.json"))


READ_RECORDS = (
    "import sys, grain.python as grain\n"
    "from maxtext.input_pipeline.input_pipeline_utils import ParseFeatures\n"
    "source = grain.ArrayRecordDataSource(sys.argv[1:])\n"
    "parse = ParseFeatures(['text'], False)\n"
    "print(repr([parse.map(source[i])['text'].tolist() for i in range(len(source))]))\n"
)


def test_two_shard_workers_write_what_one_process_writes(tmp_path, corpus, trainer_python, capsys):
    """The local backend runs the workers as processes; unpacked, the records are the same in the same order."""
    records, manifests = {}, {}
    for workers in (1, 2):
        data = {"kind": "text", "files": [str(corpus / "*.txt")], "eval_fraction": 0.2, "packing": False,
                "workers": workers, "cache_dir": str(tmp_path / f"cache-{workers}")}  # fmt: skip
        plan = plan_step.run(profile_with(tmp_path, data, steps=2, checkpoint_period=2), {})
        report = prepare_data.run(plan, plan.stage("tiny-8b-recipe"))
        manifest = manifests[workers] = report.manifest
        assert manifest["workers"] == workers and [e["exit_code"] for e in manifest["worker_exits"]] == [0] * workers
        assert all(e["max_rss_bytes"] > 50 * 2**20 for e in manifest["worker_exits"])  # an interpreter and tiktoken
        shards = [f"{report.uri}/{name}" for name in manifest["splits"]["train"]["shards"]]
        done = run_in_trainer(trainer_python, READ_RECORDS, *shards)
        assert done.returncode == 0, done.stderr[-2000:]
        records[workers] = done.stdout
        assert not list((tmp_path / f"cache-{workers}").glob("*.parts-*"))  # the parts were removed
    assert "on 2 shard workers" in capsys.readouterr().out
    assert records[1] == records[2] and records[1].count("[128000") == manifests[1]["splits"]["train"]["documents"]
    assert manifests[2]["splits"]["train"]["shards"] == ["train-00000.array_record", "train-00001.array_record"]
    for key in ("token_count", "fingerprint", "unigram_entropy_nats", "splits"):
        if key == "splits":
            for split in ("train", "eval"):
                one, two = manifests[1][key][split], manifests[2][key][split]
                assert (one["documents"], one["sequences"], one["tokens"]) == (
                    two["documents"], two["sequences"], two["tokens"]
                )  # fmt: skip
        else:
            assert manifests[1][key] == manifests[2][key], key


def test_a_failed_shard_worker_stops_the_step_with_its_last_lines(tmp_path, trainer_python):
    rows = [json.dumps({"text": f"row {i} " * 30}) for i in range(20)]
    (tmp_path / "a.jsonl").write_text("\n".join(rows) + "\n")
    (tmp_path / "b.jsonl").write_text("\n".join(rows[:5]) + "\n{not json\n")
    data = {"kind": "text", "files": [str(tmp_path / "*.jsonl")], "format": "jsonl", "workers": 2, "eval_fraction": 0.3}
    plan = plan_step.run(profile_with(tmp_path, data, steps=2, checkpoint_period=2), {})
    with pytest.raises(DataWorkersFailed) as caught:
        prepare_data.run(plan, plan.stage("tiny-8b-recipe"))
    said = str(caught.value)
    assert "shard worker 1 exited with status 1" in said and "shard worker 1 failed:" in said
    datasets = tmp_path / "out" / "datasets"
    assert not datasets.exists() or not list(datasets.glob("*/manifest.json"))  # nothing assembled
