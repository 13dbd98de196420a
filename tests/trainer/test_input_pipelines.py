"""Every data kind the plan accepts reaches a first batch through MaxText's own input pipeline (issue 25).

The stage's MaxText arguments are the ones the plan renders (:func:`multislice.plan.make_plan`); one trainer
process (:mod:`tests.trainer.first_batch`) builds MaxText 0.2.5's config from them and calls its
``create_data_iterator`` for one batch per kind: synthetic, ``text`` (shards prepare_data wrote), user ArrayRecord,
a weighted ArrayRecord mixture, Parquet, ``hf`` on a local Parquet dataset with the default tokenizer (its Hugging
Face form shipped in the package, the Hub unreachable: ``HF_HUB_OFFLINE``), and ``tfds`` mapped onto grain over
TFRecord. Nothing is downloaded.

``text`` keeps document boundaries (issue 25): prepare_data writes one record per document, MaxText packs them
first-fit, so a row holds several documents, each its own segment, positions restarting at its start. On an
elastic stage MaxText reads the same records through grain's elastic iterator, unpacked (one document a row,
padded), and its position saved after a step restores into a fresh iterator whatever per-process files lie beside
it (:mod:`multislice.trainer.elastic_data`).
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

from multislice import config
from multislice.backends.local import trainer_process_env
from multislice.plan import make_plan
from multislice.steps import prepare_data


def _args(tmp_path: Path, data: dict, elastic: bool = False) -> list[str]:
    profile = copy.deepcopy(config.read_profile("local"))
    profile.update(output_dir=str(tmp_path / "out"), num_slices=1)
    stage = profile["stages"][0]
    profile["stages"] = [stage]
    stage.update(data=data, eval_interval=-1, steps=4, checkpoint_period=4)
    if elastic:
        stage["elastic"] = {"min_slices": 1}
    stage["dcn"] = {axis: 1 for axis in stage.get("dcn", {})}
    stage.pop("export", None)
    plan = make_plan(config.load_spec(profile))
    if data["kind"] == "text":
        prepare_data.run(plan, plan.stages[0])
    return list(plan.stages[0].maxtext_args)


def test_every_data_kind_reaches_a_first_batch_through_maxtexts_pipeline(tmp_path, trainer_python):
    files = tmp_path / "files"
    corpus = tmp_path / "corpus"
    files.mkdir()
    corpus.mkdir()
    for i in range(240):  # 15 to 65 tokens: a 128-token row holds several
        (corpus / f"doc{i}.txt").write_text(
            f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * (1 + i % 6)
        )
    text = {"kind": "text", "files": [str(corpus / "*.txt")], "eval_fraction": 0.1}
    kinds = {
        "synthetic": {"kind": "synthetic"},
        "text": text,
        "grain-arrayrecord": {"kind": "grain", "train_files": f"{files}/web-*.array_record"},
        "grain-mixture": {
            "kind": "grain",
            "train_files": f"{files}/web-*.array_record,0.7;{files}/code-*.array_record,0.3",
        },  # fmt: skip
        "grain-parquet": {"kind": "grain", "file_type": "parquet", "train_files": f"{files}/rows.parquet"},
        "hf-default-tokenizer": {"kind": "hf", "path": str(files / "hub-dataset")},
        "tfds-on-grain": {"kind": "tfds", "dataset_path": str(files / "tfds"), "dataset_name": "c4/en:3.1.0"},
    }
    cases = {name: _args(tmp_path / name, data) for name, data in kinds.items()}
    cases["text-elastic"] = _args(tmp_path / "text-elastic", text, elastic=True)
    assert "packing=true" in cases["text"] and "grain_packing_type=first_fit" in cases["text"]
    assert {"grain_use_elastic_iterator=true", "packing=false"} <= set(cases["text-elastic"])
    assert any(a == "tokenizer_type=huggingface" for a in cases["hf-default-tokenizer"])
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    script = Path(__file__).with_name("first_batch.py")
    env = trainer_process_env(trainer_python.parent.parent)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[2])  # this checkout's multislice (a worktree's too)
    done = subprocess.run(
        [str(trainer_python), str(script), str(tmp_path / "cases.json"), str(files)],
        capture_output=True, text=True, env=env, timeout=900,
    )  # fmt: skip
    found = {
        (row := json.loads(line.removeprefix("CASE ")))["case"]: row
        for line in done.stdout.splitlines()
        if line.startswith("CASE ")
    }
    assert set(found) == set(cases), done.stderr[-3000:]
    errors = {name: f"{row['error']}\n{row.get('trace')}" for name, row in found.items() if "error" in row}
    assert not errors, "\n".join(f"{name}: {error}" for name, error in errors.items())
    for name, row in found.items():
        assert row["shape"] == [8, 128], (name, row)  # 1 sequence x 8 devices, max_target_length 128
        if name not in ("synthetic", "text-elastic"):  # Llama 3 tokens: documents begin with BOS; packed: rows full
            assert row["bos"] >= 1 and row["max"] < 128256 and row["nonpad"] > 4 * 128, (name, row)
    # text: several documents a row, each its own segment; positions restart at 0 exactly where one begins, and
    # every BOS begins one (a document never continues into another's attention)
    packed = found["text"]
    # first-fit over 8 bins: most rows hold several documents (a row closes with one when none of the next fits)
    assert sum(packed["segments_per_row"]) >= 12 and max(packed["segments_per_row"]) >= 3, packed
    assert packed["positions_restart_at_segment_starts"] and packed["bos_only_at_segment_starts"], packed
    assert packed["bos"] >= 2 * 8 and packed["iterator"] != "_ElasticMapDatasetIterator", packed
    # the elastic stage: grain's elastic iterator, one document a row, padded
    elastic = found["text-elastic"]
    assert elastic["iterator"] == "_ElasticMapDatasetIterator", elastic
    assert elastic["segments_per_row"] == [1] * 8 and elastic["bos"] == 8 and elastic["real"] < 8 * 128, elastic
    assert elastic["positions_restart_at_segment_starts"], elastic
    # its position after 4 batches of 8 records, saved once for all processes, continues in a fresh iterator
    restore = elastic["restore"]
    assert restore["installed"] and restore["state"] == {"global_next_index": 32}, restore
    assert "process_0.json" in restore["files"] and restore["next_batch_continues"], restore
    # MaxText 0.2.5's eval iterator is left unbatched with the elastic iterator on; built as without it, it batches
    assert elastic["eval_shape_unpatched"] != [8, 128] and elastic["eval_shape"] == [8, 128], elastic
