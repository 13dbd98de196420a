"""After the local run (the session's ``local_run``): the Model artifacts kfp.local recorded, and the export.

The local profile exports stage 2 in Hugging Face format; the export step checked its logits against
MaxText's. Here the artifacts are read back from kfp.local's executor outputs, the export is loaded
with ``transformers`` in the trainer environment, and a scrambled copy of it fails the same check.
"""

import glob
import json
import os

import pytest

from multislice import maxtext
from multislice.delivery import lineage
from tests.conftest import run_in_trainer

pytestmark = pytest.mark.e2e


def executor_outputs(run_dir):
    """kfp.local's task directory name -> its ``executor_output.json`` (``<run_dir>/kfp/<run>/<task>/``)."""
    [pipeline_run] = glob.glob(f"{run_dir}/kfp/*/")
    found = {}
    for path in glob.glob(f"{pipeline_run}*/executor_output.json"):
        found[os.path.basename(os.path.dirname(path))] = json.load(open(path, encoding="utf-8"))
    return found


def artifact(outputs, name):
    [entry] = outputs["artifacts"][name]["artifacts"]
    return entry


def test_each_stage_checkpoint_and_the_export_are_model_artifacts(local_run):
    assert local_run.returncode == 0, local_run.stderr
    tasks = executor_outputs(local_run.plan.run_dir)
    for index, stage in enumerate(local_run.plan.stages):
        train = tasks["train" if index == 0 else f"train-{index + 1}"]
        model = artifact(train, "model")
        metadata = model["metadata"]
        assert set(lineage.CHECKPOINT_FIELDS) <= set(metadata)
        assert metadata["checkpoint_uri"] == f"{stage.checkpoint_dir}/{stage.final_step}"
        assert os.path.isdir(metadata["checkpoint_uri"])
        assert metadata["maxtext_version"] == maxtext.MAXTEXT_VERSION
        report = json.load(open(f"{local_run.plan.run_dir}/reports/{stage.name}/train.json", encoding="utf-8"))
        assert metadata["final_train_loss"] == pytest.approx(report["final_loss"])
        verified = json.load(open(f"{local_run.plan.run_dir}/reports/{stage.name}/verification.json"))
        assert metadata["parameter_count"] == verified["parameter_count"]  # the count in the checkpoint
        manifest = json.load(open(model["uri"], encoding="utf-8"))  # the artifact's file, at its URI
        assert manifest["checkpoint_uri"] == metadata["checkpoint_uri"]
    [exported] = [s for s in local_run.plan.stages if s.export]
    hf = artifact(tasks["export"], "hf_model")["metadata"]
    assert hf["export_uri"] == exported.export_dir and hf["logits_check_passed"] is True
    assert hf["logits_max_abs_diff"] <= hf["logits_atol"]
    assert hf["source_checkpoint_uri"] == f"{exported.checkpoint_dir}/{exported.final_step}"
    assert {"config.json", "generation_config.json", "README.md", "model.safetensors.index.json", "tokenizer.json",
            "tokenizer_config.json"} <= set(hf["files"])  # fmt: skip
    # one shard per layer group: the embedding, each decoder layer, the final norm and output head
    layers = json.load(open(f"{exported.export_dir}/config.json", encoding="utf-8"))["num_hidden_layers"]
    assert sum(name.endswith(".safetensors") for name in hf["files"]) == layers + 2
    assert f"[export {exported.name}] PASS: {hf['parameter_count']:,} parameters" in local_run.stdout
    # the data the stage trained on, in the checkpoint's lineage and the model card; nothing machine-local published
    run_dir = str(local_run.plan.run_dir)
    prepared = json.load(open(f"{run_dir}/reports/{exported.name}/prepare_data.json", encoding="utf-8"))
    fingerprint = prepared["manifest"]["fingerprint"]
    assert artifact(tasks[f"train-{exported.index + 1}"], "model")["metadata"]["data_fingerprint"] == fingerprint
    card = open(f"{exported.export_dir}/README.md", encoding="utf-8").read()
    assert f"| data fingerprint | {fingerprint} |" in card
    assert run_dir not in card and "site-packages" not in card
    # one trainer process verified and exported the stage: the export step took the verify step's export
    assert f"[verify_checkpoint {exported.name}] verifying, then exporting on PASS, in one trainer process" in (
        local_run.stdout
    )
    assert f"[export {exported.name}] the export the verifier's process made: verdict PASS" in local_run.stdout


LOAD = """
import json, sys
import torch, transformers
from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
kwargs = {"dtype": torch.float32} if transformers.__version__.startswith("5") else {"torch_dtype": torch.float32}
model = LlamaForCausalLM.from_pretrained(sys.argv[1], **kwargs)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("Hello, world!")["input_ids"]
with torch.no_grad():
    logits = model(input_ids=torch.tensor([ids])).logits
config = AutoConfig.from_pretrained(sys.argv[1])
print(json.dumps({"ids": ids, "shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
                  "vocab": model.config.vocab_size, "layers": model.config.num_hidden_layers,
                  "rope_theta": getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"],
                  "max_positions": config.max_position_embeddings, "version": transformers.__version__}))
"""

SCRAMBLE = """
import json, shutil, sys
import numpy as np
from etils import epath
from safetensors.numpy import load_file, save_file
from multislice.trainer import export
source, target, checkpoints, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
maxtext_args = sys.argv[5:]
shutil.copytree(source, target)
config = json.load(open(f"{target}/config.json"))
d = config["head_dim"]
# What MaxText's Llama 3.1 tables do to a default-RoPE model: RoPE's halves interleaved (the bug the check caught).
order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
for shard in sorted(set(json.load(open(f"{target}/model.safetensors.index.json"))["weight_map"].values())):
    weights = load_file(f"{target}/{shard}")
    for name in list(weights):
        if name.endswith("self_attn.q_proj.weight"):
            w = weights[name].reshape(-1, d, weights[name].shape[-1])
            weights[name] = np.ascontiguousarray(w[:, order, :].reshape(weights[name].shape))
    save_file(weights, f"{target}/{shard}", metadata={"format": "pt"})
cfg = export.stage_config(maxtext_args)
reader = export.CheckpointReader(epath.Path(checkpoints) / str(step) / "items")
flat = {path: reader.read(path) for path in reader.leaves}
tokenizer, _ = export.stage_tokenizer(cfg)
ids = export.check_ids(tokenizer, cfg.vocab_size, 32)
print(json.dumps(export.compare_logits(export.maxtext_logits(cfg, flat, ids), export.hf_logits(target, ids))))
"""


def test_the_export_loads_with_transformers_and_a_scrambled_one_fails_the_logits_check(
    local_run, trainer_python, tmp_path
):
    assert local_run.returncode == 0, local_run.stderr
    [stage] = [s for s in local_run.plan.stages if s.export]
    report = json.load(open(f"{local_run.plan.run_dir}/reports/{stage.name}/export.json", encoding="utf-8"))
    # Loaded by transformers 5 (the trainer environment) and by the pinned 4.57 one (.venvs/loader-hf4)
    for python, major in (
        (trainer_python, "5."),
        (trainer_python.parent.parent.parent / "loader-hf4/bin/python", "4.57."),
    ):
        done = run_in_trainer(python, LOAD, stage.export_dir)
        assert done.returncode == 0, done.stderr[-3000:]
        loaded = json.loads(done.stdout.splitlines()[-1])
        assert loaded["version"].startswith(major)
        assert loaded["finite"] and loaded["shape"][-1] == loaded["vocab"] == report["vocab_size"]
        assert loaded["ids"][0] == 128000  # <|begin_of_text|>: the Llama 3 tokenizer from the maxtext package
        assert loaded["rope_theta"] == 500000.0 and loaded["max_positions"] == 8192  # 4.x read rope_theta too
    assert report["verdict"] == "PASS" and report["logits_check"]["argmax_agree"] == 1.0
    # the exporter's own check ran with both loaders, each within tolerance, and the summary printed both
    loaders = report["logits_check"]["loaders"]
    assert {c["transformers_version"][:2] for c in loaders.values()} == {"5.", "4."}
    for check in loaders.values():
        bound = check["atol"] + check["rtol"] * check["max_abs_logit"]
        assert check["passed"] and check["max_abs_diff"] <= bound and check["ids_round_trip"]
    assert "by loader: 5." in local_run.stdout and ", 4.57." in local_run.stdout
    args = [stage.checkpoint_dir, str(stage.final_step), *stage.maxtext_args]
    done = run_in_trainer(trainer_python, SCRAMBLE, stage.export_dir, str(tmp_path / "scrambled"), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    scrambled = json.loads(done.stdout.splitlines()[-1])
    assert not scrambled["passed"] and scrambled["max_abs_diff"] > 100 * scrambled["atol"]
