"""The Hugging Face exporter on small checkpoints made here (no training run): a sentencepiece stage, loaders, refusals.

The shared end-to-end run (``tests/e2e/test_lineage.py``) exports the local profile's stage 2 (scanned layers,
Llama 3 tiktoken). Here a checkpoint of the tiny preset's dims with unscanned layers and MaxText's Llama 2
sentencepiece tokenizer (32,000 tokens, the model's vocab) is written in the trainer environment
(:func:`benchmarks.export_memory.write_checkpoint`: MaxText's model initialised and saved by Orbax) and exported
once; the tests read that export.
"""

import json
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.export_memory import TINY, write_checkpoint
from multislice import storage
from multislice.backends.local.environment import trainer_process_env
from multislice.trainer import export, verify
from tests.conftest import run_in_trainer

SENTENCEPIECE = "tokenizer.llama2"  # MaxText's Llama 2 sentencepiece model (assets/tokenizers), 32,000 pieces
STRINGS = [
    "Hello world", " leading space", "naïve café 東京", "a\nb\n\nc", "  two spaces", "12345 + 678 = ?",
    "emoji 🙂 ok", "tabs\tand\r\nCRLF", "The quick brown fox.", "trailing   ", "MaxText -> Hugging Face",
]  # fmt: skip


def loader4(trainer_python):
    return trainer_python.parent.parent.parent / "loader-hf4" / "bin" / "python"


def exporter(trainer_python, checkpoints, output, args, *options, env=None):
    done = subprocess.run(
        [str(trainer_python), "-m", export.MODULE, "--checkpoint-dir", str(checkpoints), "--step", "3",
         "--output", str(output), *options, "--", *args],
        capture_output=True, text=True, env={**trainer_process_env(trainer_python.parent.parent), **(env or {})},
        timeout=900,
    )  # fmt: skip
    report = verify.parse_report(done.stdout)
    assert report is not None, done.stderr[-3000:]
    return done.returncode, report


@pytest.fixture(scope="module")
def sp_stage(trainer_python, tmp_path_factory):
    """A 2-layer unscanned checkpoint with the sentencepiece tokenizer, and its export (float32)."""
    root = tmp_path_factory.mktemp("export-sp")
    site = trainer_python.parent.parent / "lib" / "python3.12" / "site-packages" / "maxtext"
    args = [a for a in TINY if not a.startswith("vocab_size=")] + [
        "vocab_size=32000", "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=256",
        "scan_layers=false", "tokenizer_type=sentencepiece", f"tokenizer_path={site}/assets/tokenizers/{SENTENCEPIECE}",
        "add_bos=true", "add_eos=false",
    ]  # fmt: skip
    write_checkpoint(root / "checkpoints", 3, args)
    status, report = exporter(trainer_python, root / "checkpoints", root / "export", args, "--sample-fraction", "0.5")
    return SimpleNamespace(root=root, args=args, status=status, report=report, export=root / "export")


def test_a_sentencepiece_stage_exports_its_own_tokenizer_and_both_loaders_match_maxtext(sp_stage):
    assert sp_stage.status == 0, sp_stage.report
    report = sp_stage.report
    assert report["tokenizer"].startswith("sentencepiece ") and report["tokenizer"].endswith(SENTENCEPIECE)
    assert report["tokenizer_vocab_size"] == report["vocab_size"] == 32000 and report["dtype"] == "float32"
    assert report["scan_layers"] is False and report["shards"] == 2 + 2  # embedding, 2 layers, norm + head
    memory = report["memory"]  # each phase's own peak (reset_rss_peak), not the process's lifetime peak
    assert memory["peaks_per_phase"] is True and memory["conversion_peak_rss_bytes"] >= memory["largest_group_bytes"]
    check = report["logits_check"]
    assert check["sample_fraction"] == 0.5 and check["positions"] == -(-check["tokens"] // 2)
    versions = sorted(c["transformers_version"] for c in check["loaders"].values())
    assert versions[0].startswith("4.57.") and versions[1].startswith("5.")
    for loaded in check["loaders"].values():
        bound = loaded["atol"] + loaded["rtol"] * loaded["max_abs_logit"]  # the check's tolerance at its largest logit
        assert loaded["passed"] and loaded["max_abs_diff"] <= bound and loaded["ids_round_trip"]
        assert loaded["tokenizer_class"] in ("PreTrainedTokenizerFast", "TokenizersBackend")
        assert loaded["rope_theta"] == 500000.0 and loaded["max_position_embeddings"] == 8192
    settings = json.loads((sp_stage.export / "tokenizer_config.json").read_text())
    assert settings["tokenizer_class"] == "PreTrainedTokenizerFast"
    generation = json.loads((sp_stage.export / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)  # the sentencepiece model's <s>, </s>
    card = (sp_stage.export / "README.md").read_text()
    assert f"| tokenizer | sentencepiece maxtext:assets/tokenizers/{SENTENCEPIECE} |" in card
    assert "| training steps |" in card and "| source checkpoint | export-sp0/checkpoints/3 |" in card
    # nothing machine-local in what a Hub push publishes: not the run's directory, not the environment's
    assert str(sp_stage.root.parent) not in card and "site-packages" not in card


INFERENCE_TOKENIZER = """
import json, sys, tempfile
from multislice.trainer import export
config = export.stage_config(json.loads(sys.argv[1]))
tokenizer, _ = export.stage_tokenizer(config)
out = tempfile.mkdtemp()
export.write_metadata(__import__("pathlib").Path(out), export.hf_config(config, tokenizer, "float32"), tokenizer, {})
maxtext = export.maxtext_tokenizer(config)
print(json.dumps({"dir": out, "maxtext": [int(i) for i in maxtext.encode(sys.argv[2])]}))
"""

LOADED_IDS = """
import json, sys
from transformers import AutoTokenizer
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer(sys.argv[2])["input_ids"]
print(json.dumps({"ids": ids, "bos": tokenizer.bos_token_id, "eos": tokenizer.eos_token_id,
                  "max_length": tokenizer.model_max_length}))
"""


@pytest.mark.parametrize("kind", ["tiktoken", "sentencepiece", "huggingface"])
def test_the_exported_tokenizer_is_for_inference_bos_only_and_the_models_positions(kind, trainer_python):
    # A stage trained with add_eos (MaxText ends each document with EOS): the exported tokenizer must not append
    # EOS to a prompt (model.generate would condition on an ended document) in either loader, and its
    # model_max_length is the model's max_position_embeddings (8192 for Llama 3's RoPE), not 131072.
    site = trainer_python.parent.parent / "lib" / "python3.12" / "site-packages"
    path = {
        "tiktoken": site / "maxtext/assets/tokenizers/tokenizer_llama3.tiktoken",
        "sentencepiece": site / "maxtext/assets/tokenizers" / SENTENCEPIECE,
        "huggingface": Path(export.__file__).parents[1] / "data/tokenizers/llama3-hf",
    }[kind]
    vocab = "vocab_size=32000" if kind == "sentencepiece" else "vocab_size=128256"
    args = [a for a in TINY if not a.startswith("vocab_size=")] + [
        vocab, "base_num_decoder_layers=1", "base_emb_dim=64", "base_mlp_dim=256", f"tokenizer_type={kind}",
        f"tokenizer_path={path}", "add_bos=true", "add_eos=true",
    ]  # fmt: skip
    prompt = "The capital of France is"
    done = run_in_trainer(trainer_python, INFERENCE_TOKENIZER, json.dumps(args), prompt)
    assert done.returncode == 0, done.stderr[-3000:]
    made = json.loads(done.stdout.splitlines()[-1])
    trained = made["maxtext"]  # what the stage trained on: BOS, the text, EOS
    assert trained[-1] != trained[0] and len(trained) >= 3
    settings = json.loads((Path(made["dir"]) / "tokenizer_config.json").read_text())
    assert settings["model_max_length"] == 8192
    for python in (trainer_python, loader4(trainer_python)):
        done = run_in_trainer(python, LOADED_IDS, made["dir"], prompt)
        assert done.returncode == 0, done.stderr[-2000:]
        loaded = json.loads(done.stdout.splitlines()[-1])
        assert loaded["ids"] == trained[:-1], python  # BOS and the text, as MaxText encodes it, without EOS
        assert loaded["ids"][0] == loaded["bos"] and loaded["eos"] not in loaded["ids"]
        assert loaded["max_length"] == 8192


ROUND_TRIP = """
import json, sys
from transformers import AutoTokenizer
strings = json.loads(sys.argv[2])
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
print(json.dumps([tokenizer(s)["input_ids"] for s in strings]))
"""

MAXTEXT_IDS = """
import json, sys
from multislice.trainer import export, verify
config = export.stage_config(sys.argv[2:])
tokenizer = export.maxtext_tokenizer(config)
print(json.dumps([[int(i) for i in tokenizer.encode(s)] for s in json.loads(sys.argv[1])]))
"""


def test_the_exported_sentencepiece_tokenizer_encodes_as_maxtexts_in_both_loaders(sp_stage, trainer_python):
    assert sp_stage.status == 0, sp_stage.report
    done = run_in_trainer(trainer_python, MAXTEXT_IDS, json.dumps(STRINGS), *sp_stage.args)
    assert done.returncode == 0, done.stderr[-2000:]
    maxtext_ids = json.loads(done.stdout.splitlines()[-1])
    assert len(STRINGS) >= 9 and all(ids[0] == 1 for ids in maxtext_ids)  # BOS, as the stage's add_bos says
    for python in (trainer_python, loader4(trainer_python)):
        done = run_in_trainer(python, ROUND_TRIP, str(sp_stage.export), json.dumps(STRINGS))
        assert done.returncode == 0, done.stderr[-2000:]
        assert json.loads(done.stdout.splitlines()[-1]) == maxtext_ids, python


DROP_ROPE_THETA = """
import json, shutil, sys
from pathlib import Path
from multislice.trainer import export, verify
source, target = sys.argv[1], Path(sys.argv[2])
shutil.copytree(source, target)
config = json.loads((target / "config.json").read_text())
del config["rope_theta"]  # what transformers 5 alone writes: 4.x then silently takes rope_theta 10000
(target / "config.json").write_text(json.dumps(config))
ids = list(range(1, 40))
reference = export.hf_logits(str(target), ids)  # transformers 5 reads rope_parameters: the right model
out = {}
for name, python in (("5", Path(sys.executable)), ("4", export.loader4_python())):
    import numpy as np
    loaded = export.run_loader(python, str(target), ids, list(range(len(ids))), target)
    out[name] = export.compare_logits(reference, np.load(loaded["logits_file"])) | {"rope": loaded["rope_theta"]}
print(json.dumps(out))
"""


def test_the_check_fails_when_the_4x_loader_reads_another_model(sp_stage, trainer_python, tmp_path):
    # The finding: a config with only rope_parameters loads in 5.x and silently differs in 4.57.
    assert sp_stage.status == 0, sp_stage.report
    done = run_in_trainer(trainer_python, DROP_ROPE_THETA, str(sp_stage.export), str(tmp_path / "no-theta"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["5"]["passed"] and found["5"]["rope"] == 500000.0
    assert not found["4"]["passed"] and found["4"]["rope"] == 10000.0
    assert found["4"]["max_abs_diff"] > 10 * found["4"]["atol"]


def test_a_tokenizer_larger_than_the_models_vocab_is_an_error(sp_stage, trainer_python, tmp_path):
    # The Llama 3 tokenizer (128,256 tokens) on the 32,000-vocab model: never ids modulo the vocab.
    args = [a for a in sp_stage.args if not a.startswith(("tokenizer_type=", "tokenizer_path="))]
    site = trainer_python.parent.parent / "lib" / "python3.12" / "site-packages" / "maxtext"
    args += ["tokenizer_type=tiktoken", f"tokenizer_path={site}/{export.TOKENIZER_ASSET}"]
    status, report = exporter(trainer_python, sp_stage.root / "checkpoints", tmp_path / "out", args)
    assert status == 2 and report["verdict"] == "ERROR"
    assert "128256 tokens" in report["error"] and "vocab_size is 32000" in report["error"]
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_hub_upload_without_a_token_is_refused_before_exporting(sp_stage, trainer_python, tmp_path):
    env = {"HF_TOKEN": ""}
    status, report = exporter(
        trainer_python,
        sp_stage.root / "checkpoints",
        tmp_path / "out",
        sp_stage.args,
        "--hub-repo",
        "me/model",
        env=env,
    )
    assert status == 2 and "HF_TOKEN" in report["error"] and "--hub-repo me/model" in report["error"]
    assert not (tmp_path / "out").exists()


COPY_TO_GCS = """
import sys
import gcsfs
gcsfs.GCSFileSystem().put(sys.argv[1], sys.argv[2].removeprefix("gs://"), recursive=True)
"""


def test_the_exporter_reads_and_writes_cloud_storage(sp_stage, trainer_python, gcs, monkeypatch, tmp_path):
    # As on GKE (multislice/backends/gke/exporter.py): checkpoint, export and report all gs://, in the emulator.
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs.url)  # TensorStore's GCS driver, to the emulator
    monkeypatch.setenv("GCE_METADATA_ROOT", "127.0.0.1:9")  # no credentials lookup on a metadata server
    checkpoints, output = "gs://bucket/runs/r/stage-1/checkpoints", "gs://bucket/runs/r/export/stage-1"
    done = run_in_trainer(trainer_python, COPY_TO_GCS, str(sp_stage.root / "checkpoints" / "3"), f"{checkpoints}/3")
    assert done.returncode == 0, done.stderr[-3000:]
    report_uri = "gs://bucket/runs/r/export/stage-1-report.json"
    status, report = exporter(trainer_python, checkpoints, output, sp_stage.args, "--report", report_uri)
    assert status == 0, report
    assert report["export_dir"] == output and report["checkpoint_dir"] == checkpoints
    assert report["logits_check"]["passed"] and report["shards"] == sp_stage.report["shards"]
    names = gcs.names(prefix="runs/r/export/stage-1/")
    shards = [f"model-{i:05d}-of-{report['shards']:05d}.safetensors" for i in range(1, report["shards"] + 1)]
    expected = [*shards, "model.safetensors.index.json", "config.json", "tokenizer.json", "tokenizer_config.json",
                "generation_config.json", "README.md"]  # fmt: skip
    assert sorted(name.removeprefix("runs/r/export/stage-1/") for name in names) == sorted(report["files"])
    assert set(expected) <= set(report["files"])
    assert json.loads(gcs.read("runs/r/export/stage-1-report.json")) == report
    local = {name: (sp_stage.export / name).read_bytes() for name in ("config.json", "tokenizer.json")}
    assert all(gcs.read(f"runs/r/export/stage-1/{name}") == data for name, data in local.items())
    # The results API loads it as a notebook would, from the run's reports (a copy of the gs:// export).
    storage.write_json("gs://bucket/runs/r/reports/stage-1/export.json", report)
    done = run_in_trainer(trainer_python, LOAD_FROM_RUN, str(tmp_path / "copy"), str(sp_stage.export))
    assert done.returncode == 0, done.stderr[-3000:]
    kind, layers, ids, local_ids = json.loads(done.stdout.splitlines()[-1])
    assert (kind, layers) == ("LlamaForCausalLM", 2) and ids == local_ids and ids[0] == 1
    assert sorted(p.name for p in (tmp_path / "copy").iterdir()) == sorted(report["files"])


LOAD_FROM_RUN = """
import json, sys
from transformers import AutoTokenizer
from multislice.delivery import results
run = results.RunRef("r", "gs://bucket/runs", ["stage-1"])
model, tokenizer = results.load_hf_model(run, "stage-1", local_dir=sys.argv[1])
local = AutoTokenizer.from_pretrained(sys.argv[2])
print(json.dumps([type(model).__name__, model.config.num_hidden_layers, tokenizer("Hello world")["input_ids"],
                  local("Hello world")["input_ids"]]))
"""


def test_default_dtype_is_bfloat16_from_a_billion_parameters():
    def llama(layers, emb, mlp, vocab, heads=32, kv=8, head_dim=128):
        return SimpleNamespace(emb_dim=emb, num_query_heads=heads, num_kv_heads=kv, head_dim=head_dim, mlp_dim=mlp,
                               num_decoder_layers=layers, vocab_size=vocab)  # fmt: skip

    eight_b = llama(32, 4096, 14336, 128256)
    assert export.parameter_count(eight_b) == 8_030_261_248  # Llama 3 8B's published count
    assert export.default_dtype(eight_b) == "bfloat16"
    tiny = llama(4, 64, 256, 128256, heads=4, kv=2, head_dim=16)
    assert export.default_dtype(tiny) == "float32"


def test_sampled_positions_are_a_seeded_fraction():
    assert export.sample_positions(10, 1.0) == list(range(10))
    chosen = export.sample_positions(100, 0.1)
    assert len(chosen) == 10 and chosen == sorted(set(chosen)) and chosen == export.sample_positions(100, 0.1)
    assert len(export.sample_positions(3, 0.01)) == 1


def test_layer_groups_put_the_embedding_first_and_each_layer_in_its_own_shard():
    scanned = {
        "params-token_embedder-embedding": "model.embed_tokens.weight",
        "params-decoder-layers-mlp-wi_0-kernel": [f"model.layers.{i}.mlp.gate_proj.weight" for i in range(3)],
        "params-decoder-decoder_norm-scale": "model.norm.weight",
        "params-decoder-logits_dense-kernel": "lm_head.weight",
    }
    groups = export.layer_groups(scanned, 3, 2)
    assert [[name for _, _, name in g] for g in groups] == [
        ["model.embed_tokens.weight"],
        ["model.layers.0.mlp.gate_proj.weight", "model.layers.1.mlp.gate_proj.weight"],
        ["model.layers.2.mlp.gate_proj.weight"],
        ["model.norm.weight", "lm_head.weight"],
    ]
    assert groups[1][1][:2] == ("params-decoder-layers-mlp-wi_0-kernel", 1)  # layer 1's slice of the stacked array


def test_the_verifier_builds_the_model_without_torch_or_transformers(sp_stage, trainer_python):
    """The verifier's process (``python -m multislice.trainer.verify``) installs lean_imports before MaxText, so
    building the model's parameter tree imports neither (issue 28: about 10 s of its start on this machine)."""
    done = subprocess.run(
        [str(trainer_python), "-m", "multislice.trainer.verify", "--checkpoint-dir", str(sp_stage.root / "checkpoints"),
         "--expected-step", "3", "--", *sp_stage.args],
        capture_output=True, text=True, env=trainer_process_env(trainer_python.parent.parent), timeout=600,
    )  # fmt: skip
    report = verify.parse_report(done.stdout)
    assert report is not None, done.stderr[-3000:]
    checks = {c["name"]: c["passed"] for c in report["checks"]}
    assert checks["params_tree"] and checks["parameter_count"], report["checks"]  # the model was built
    assert not {"torch", "transformers"} & set(report["heavy_imports"]), report["heavy_imports"]


LOADER_LIFECYCLE = """
import json, sys
from pathlib import Path
from multislice.trainer import export
unused = export.Loader(Path(sys.executable))
unused.stop()
closed = export.Loader(Path(sys.executable))
closed.process.stdin.close()  # what a verify_export whose verdict was FAIL does on exit: no request
code = closed.process.wait(timeout=300)
output = (closed.scratch / "stdout").read_text()
closed.stop()
missing = export.Loader(Path("/nonexistent/bin/python"))
print(json.dumps({"unused": [unused.process.poll() is not None, unused.scratch.exists()], "closed": [code, output],
                  "missing": missing.result(), "missing_scratch": [missing.stop(), missing.scratch.exists()][1]}))
"""


def test_a_loader_started_ahead_ends_unused_and_a_missing_one_is_an_error(trainer_python):
    done = run_in_trainer(trainer_python, LOADER_LIFECYCLE)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["unused"] == [True, False]  # stopped: the process ended and its scratch directory is gone
    assert found["closed"] == [0, ""]  # no request on stdin: it ends at once, quietly
    assert "no loader interpreter at /nonexistent/bin/python" in found["missing"]["error"]
    assert found["missing_scratch"] is False


WARM_UP = """
import json, sys
from multislice.trainer import export
args = json.loads(sys.argv[1])
export.warm_up(args)
ahead = dict(export._AHEAD)
imported = {name: name in sys.modules for name in ("torch", "transformers", "safetensors.torch")}
setup = export._SETUP.get(tuple(args))
taken = export.start_loaders()
again = export.start_loaders()
found = {
    "imported": imported, "names": sorted(ahead), "setup": None if setup is None else setup[2],
    "taken_ahead": all(taken[n] is ahead[n] for n in ahead),
    "waiting": [l.process.poll() is None for l in ahead.values()],
    "again_new": all(again[n] is not ahead[n] for n in ahead),
}
for loader in [*taken.values(), *again.values()]:
    loader.stop()
if sys.argv[2:] == ["leave"]:  # a tool never used: its loaders are stopped at exit
    export.warm_up(args)
    found["left"] = [[l.process.pid, str(l.scratch)] for l in export._AHEAD.values()]
print(json.dumps(found))
"""


def test_a_warmed_up_export_has_its_set_up_and_waiting_loaders_and_stops_unused_ones(sp_stage, trainer_python):
    """:func:`export.warm_up` (a verifier started while the stage trains) makes the stage's config and tokenizer and
    starts both loaders; the export then takes those loaders once, and a process that never exported stops them
    at its exit (no loader outlives the tool)."""
    done = run_in_trainer(trainer_python, WARM_UP, json.dumps(sp_stage.args), "leave")
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["imported"] == {"torch": True, "transformers": True, "safetensors.torch": True}
    assert found["setup"].startswith("sentencepiece ") and found["setup"].endswith(SENTENCEPIECE)
    assert found["names"] == ["transformers4", "transformers5"]
    assert found["taken_ahead"] and found["waiting"] == [True, True]  # the export gets the waiting ones ...
    assert found["again_new"]  # ... once: a second export starts its own
    for pid, scratch in found["left"]:
        assert not Path(f"/proc/{pid}").exists() or "hf_loader" not in Path(f"/proc/{pid}/cmdline").read_text()
        assert not Path(scratch).exists()


def test_the_loaders_run_at_once_only_when_both_fit_in_half_the_available_memory(monkeypatch):
    # A loader holds one decoder layer (8 B a parameter: read in float32 and loaded), not the model.
    eight_b_layer = export.layer_parameters(
        SimpleNamespace(emb_dim=4096, num_query_heads=32, num_kv_heads=8, head_dim=128, mlp_dim=14336)
    )
    assert eight_b_layer == 218_112_000  # Llama 3 8B: (8.03e9 - 2 x 128256 x 4096 - 4096) / 32
    assert export.loader_bytes(eight_b_layer) == 8 * eight_b_layer + export.LOADER_BASELINE_BYTES
    monkeypatch.setattr(export, "available_memory_bytes", lambda: 20 * 2**30)  # this machine, about
    assert export.concurrent_check(eight_b_layer)  # 2 x 3.1 GiB: at once
    seventy_b_layer = 855_654_400  # Llama 3 70B: emb 8192, mlp 28672, 64 heads, 8 KV heads of 128
    assert not export.concurrent_check(seventy_b_layer)  # 2 x 7.9 GiB > 10 GiB
    monkeypatch.setattr(export, "available_memory_bytes", lambda: None)  # unknown: never at once
    assert not export.concurrent_check(1000)


LAYERWISE = """
import json, sys
from pathlib import Path
import numpy as np
from multislice.trainer import digests, export
checkpoints, args = Path(sys.argv[1]), sys.argv[2:]
config = export.stage_config(args)
reader = export.CheckpointReader(digests.item_dir(checkpoints / "3"))
ids, positions = list(range(3, 40)), list(range(0, 37, 2))
out = {}
for dtype in ("float32", "bfloat16"):
    whole = export.maxtext_logits(config, export.reference_params(reader, dtype, int(config.head_dim)), ids)
    layered = export.maxtext_layerwise(config, reader, dtype, ids, positions)
    out[dtype] = {"diff": float(np.abs(layered.logits - whole[positions]).max()),
                  "largest": float(np.abs(whole).max()), "states": len(layered.states)}
print(json.dumps(out))
"""


def test_maxtexts_side_one_layer_at_a_time_equals_its_whole_model_forward(sp_stage, trainer_python):
    # The check's reference (MaxText's own LlamaDecoderLayer applied layer by layer as the conversion reads the
    # checkpoint) computes the whole model's logits: float32 rounding apart, in both export dtypes.
    done = run_in_trainer(trainer_python, LAYERWISE, str(sp_stage.root / "checkpoints"), *sp_stage.args)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    for dtype, compared in found.items():
        assert compared["states"] == 2 + 1, dtype  # after the embedding and after each of the 2 layers
        assert compared["diff"] <= 1e-5 * compared["largest"], (dtype, compared)


LOADER_LAYERWISE = """
import json, shutil, sys
from pathlib import Path
import numpy as np, torch, transformers
from safetensors.torch import load_file, save_file
from transformers import LlamaForCausalLM
from multislice.trainer import hf_loader
source, scratch = sys.argv[1], Path(sys.argv[2])
ids, positions = list(range(1, 40)), list(range(0, 39, 3))
kwargs = {"dtype": torch.float32} if transformers.__version__.startswith("5") else {"torch_dtype": torch.float32}
with torch.no_grad():
    whole = LlamaForCausalLM.from_pretrained(source, **kwargs).eval()(input_ids=torch.tensor([ids])).logits[0]
whole = whole[positions].numpy()
request = {"export_dir": source, "ids": ids, "positions": positions, "out": str(scratch / "logits.npy")}
(scratch / "request.json").write_text(json.dumps(request))
hf_loader.main([str(scratch / "request.json")])
layered = np.load(scratch / "logits.npy")
hidden = np.load(scratch / "logits.hidden.npy")
# an export that lost a tensor: from_pretrained would leave it random ("missing keys"); the check must say so
broken = scratch / "broken"
shutil.copytree(source, broken)
index = json.loads((broken / "model.safetensors.index.json").read_text())
shard = broken / index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
tensors = load_file(shard)
del tensors["model.layers.1.mlp.up_proj.weight"]
save_file(tensors, shard, metadata={"format": "pt"})
del index["weight_map"]["model.layers.1.mlp.up_proj.weight"]
(broken / "model.safetensors.index.json").write_text(json.dumps(index))
config = transformers.AutoConfig.from_pretrained(broken)
print(json.dumps({"diff": float(np.abs(layered - whole).max()), "largest": float(np.abs(whole).max()),
                  "hidden": list(hidden.shape), "version": transformers.__version__,
                  "broken": hf_loader.structure(config, hf_loader._tensors(str(broken)))}))
"""


def test_each_loader_computes_the_whole_models_logits_layer_by_layer_and_sees_a_missing_tensor(
    sp_stage, trainer_python, tmp_path
):
    # The loaders never hold the model: transformers' own LlamaDecoderLayer, one at a time, from the shards. Their
    # logits are LlamaForCausalLM.from_pretrained's, in transformers 5 and 4.57; a tensor the export lacks is named.
    for python in (trainer_python, loader4(trainer_python)):
        scratch = tmp_path / python.parent.parent.name
        scratch.mkdir()
        done = run_in_trainer(python, LOADER_LAYERWISE, str(sp_stage.export), str(scratch))
        assert done.returncode == 0, done.stderr[-3000:]
        found = json.loads(done.stdout.splitlines()[-1])
        assert found["diff"] <= 1e-5 * found["largest"], found
        assert found["hidden"] == [2 + 1, 39, 64]
        assert found["broken"] == {"missing": ["model.layers.1.mlp.up_proj.weight"], "unexpected": [],
                                   "misshapen": []}  # fmt: skip


SCRAMBLE_LAYER = """
import json, shutil, sys
from pathlib import Path
import torch
from safetensors.torch import load_file, save_file
source, target = Path(sys.argv[1]), Path(sys.argv[2])
shutil.copytree(source, target)
index = json.loads((target / "model.safetensors.index.json").read_text())
name = "model.layers.1.self_attn.o_proj.weight"
shard = target / index["weight_map"][name]
tensors = load_file(shard)
tensors[name] = tensors[name].flip(0).contiguous()  # a wrong layout in layer 1 only
save_file(tensors, shard, metadata={"format": "pt"})
"""


def test_a_wrong_layer_fails_the_check_and_is_located(sp_stage, trainer_python, tmp_path):
    done = run_in_trainer(trainer_python, SCRAMBLE_LAYER, str(sp_stage.export), str(tmp_path / "scrambled"))
    assert done.returncode == 0, done.stderr[-3000:]
    check = sp_stage.report["logits_check"]
    for loaded in check["loaders"].values():  # the good export: no layer diverges, its tensors are LlamaForCausalLM's
        assert loaded["hidden"]["first_divergent_layer"] is None and loaded["hidden"]["layers"] == 2
        assert loaded["structure"] == {"missing": [], "unexpected": [], "misshapen": []}
    found = run_in_trainer(trainer_python, RECHECK, str(sp_stage.root / "checkpoints"), str(tmp_path / "scrambled"),
                           *sp_stage.args)  # fmt: skip
    assert found.returncode == 0, found.stderr[-3000:]
    result = json.loads(found.stdout.splitlines()[-1])
    assert not result["passed"]
    assert [c["hidden"]["first_divergent_layer"] for c in result["loaders"].values()] == [2, 2]  # after layer 1


RECHECK = """
import json, sys
from pathlib import Path
from types import SimpleNamespace
from multislice.trainer import digests, export
checkpoints, export_dir, args = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
config, tokenizer, _ = export.stage_setup(args)
reader = export.CheckpointReader(digests.item_dir(checkpoints / "3"))
ids = export.check_ids(tokenizer, int(config.vocab_size), 32)
reference = export.maxtext_layerwise(config, reader, "float32", ids, list(range(len(ids))))
options = SimpleNamespace(atol=export.ATOL, rtol=export.RTOL, sample_fraction=1.0)
loaders = export.start_loaders()
try:
    print(json.dumps(export.check_export(reference, export_dir, options, loaders)))
finally:
    for loader in loaders.values():
        loader.stop()
"""


PHASE_PEAKS = """
import json
from multislice.trainer import export
block = bytearray(400 * 2**20)  # a phase that touches 400 MiB, then frees it
block[:: 4096] = b"x" * len(block[:: 4096])
del block
lifetime = export.rss_peak_bytes()
reset = export.reset_rss_peak()
after = export.rss_peak_bytes()
print(json.dumps({"lifetime": lifetime, "reset": reset, "after": after, "now": export.rss_bytes()}))
"""


def test_each_export_phase_reports_its_own_peak_not_the_processs_lifetime_peak(trainer_python):
    # In a pipeline run the verifier is warmed up ahead: getrusage's ru_maxrss gave the warm-up's peak as the
    # conversion's and the check's. After reset_rss_peak the next phase's peak starts from the current RSS.
    done = run_in_trainer(trainer_python, PHASE_PEAKS)
    assert done.returncode == 0, done.stderr[-2000:]
    peaks = json.loads(done.stdout.splitlines()[-1])
    assert peaks["reset"] is True
    assert peaks["lifetime"] - peaks["after"] >= 300 * 2**20, peaks
    assert peaks["after"] >= peaks["now"] - 16 * 2**20


QUERY_AS_CONVERTED = """
import json, sys
from pathlib import Path
import numpy as np
from safetensors import safe_open
from multislice.trainer import digests, export
checkpoints, export_dir = Path(sys.argv[1]), Path(sys.argv[2])
reader = export.CheckpointReader(digests.item_dir(checkpoints / "3"))
query = reader.read("params/params/decoder/layers_0/self_attention/query/kernel").astype(np.float32)
index = json.loads((export_dir / "model.safetensors.index.json").read_text())["weight_map"]
name = "model.layers.0.self_attn.q_proj.weight"
with safe_open(str(export_dir / index[name]), "np") as shard:
    exported = shard.get_tensor(name)
emb, heads, head_dim = query.shape
expected = (query * np.float32(np.sqrt(head_dim))).reshape(emb, heads * head_dim).T
print(json.dumps({"dtype": str(exported.dtype), "diff": float(np.abs(exported - expected).max())}))
"""


def test_a_bfloat16_trained_stage_exports_its_query_unrounded_in_float32(sp_stage, trainer_python, tmp_path):
    # The seed's 70B stage trains with weight_dtype bfloat16. MaxText's conversion casts each converted tensor to
    # the stage's weight_dtype: the query, scaled by sqrt(head_dim), came out rounded to bfloat16 in a float32
    # export, and at real widths the logits missed MaxText's by 4e-3 (the check FAILed).
    # head_dim 32: sqrt(32) is no power of two (the tiny preset's sqrt(16) = 4 scales bfloat16 values exactly)
    args = [a for a in sp_stage.args if not a.startswith("head_dim=")] + ["head_dim=32", "weight_dtype=bfloat16"]
    write_checkpoint(tmp_path / "checkpoints", 3, args)
    status, report = exporter(trainer_python, tmp_path / "checkpoints", tmp_path / "export", args, "--dtype", "float32")
    assert status == 0 and report["logits_check"]["passed"], report
    done = run_in_trainer(trainer_python, QUERY_AS_CONVERTED, str(tmp_path / "checkpoints"), str(tmp_path / "export"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["dtype"] == "float32" and found["diff"] == 0.0, found


DESTACK = """
import json, sys
from pathlib import Path
import numpy as np
from multislice.trainer import digests, export
checkpoints, scratch = Path(sys.argv[1]), Path(sys.argv[2])
plain = export.CheckpointReader(digests.item_dir(checkpoints / "3"))
split = export.CheckpointReader(digests.item_dir(checkpoints / "3"), scratch)
decoded = []
original = split._destack
split._destack = lambda path, axis: (decoded.append(path), original(path, axis))[1]
stacked = {p: l for p, l in split.leaves.items() if "/decoder/layers/" in p}
same = True
for layer in range(2):
    for path, leaf in stacked.items():
        axis = 1 if len(leaf.shape) > 1 else 0
        same &= bool(np.array_equal(split.layer(path, axis, layer), plain.layer(path, axis, layer)))
total = sum(int(np.prod(l.shape)) * 4 for l in stacked.values())
print(json.dumps({"same": same, "decoded": sorted(decoded) == sorted(stacked), "bytes": [split.destacked_bytes, total],
                  "files": len(list(scratch.rglob("*.raw")))}))
"""


def test_stacked_layers_are_split_once_into_local_files_not_decoded_per_layer(trainer_python, tmp_path):
    # A scanned checkpoint's storage chunks span every layer: reading layer i decoded them all, num_layers times
    # over a conversion (80 for 70B). With a scratch directory each stacked array is decoded once, into a raw file
    # per layer, and each layer read from its file is the same array.
    args = [*TINY, "base_num_decoder_layers=2", "base_emb_dim=64", "base_mlp_dim=256", "scan_layers=true"]
    write_checkpoint(tmp_path / "checkpoints", 3, args)
    done = run_in_trainer(trainer_python, DESTACK, str(tmp_path / "checkpoints"), str(tmp_path / "layers"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["same"] and found["decoded"] and found["bytes"][0] == found["bytes"][1]
    assert found["files"] == 9 * 2  # 9 stacked arrays (attention 4, MLP 3, 2 norms), a file per layer each
