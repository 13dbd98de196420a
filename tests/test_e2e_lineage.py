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
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= set(hf["files"])
    assert f"[export {exported.name}] PASS: {hf['parameter_count']:,} parameters" in local_run.stdout


LOAD = """
import json, sys
import torch
from transformers import AutoTokenizer, LlamaForCausalLM
model = LlamaForCausalLM.from_pretrained(sys.argv[1], dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1])
ids = tokenizer("Hello, world!")["input_ids"]
with torch.no_grad():
    logits = model(input_ids=torch.tensor([[i % model.config.vocab_size for i in ids]])).logits
print(json.dumps({"ids": ids, "shape": list(logits.shape), "finite": bool(torch.isfinite(logits).all()),
                  "vocab": model.config.vocab_size, "layers": model.config.num_hidden_layers}))
"""

SCRAMBLE = """
import json, shutil, sys
import numpy as np
from etils import epath
from safetensors.numpy import load_file, save_file
from multislice.trainer import export, verify
source, target, checkpoints, step = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
maxtext_args = sys.argv[5:]
shutil.copytree(source, target)
weights = load_file(f"{target}/model.safetensors")
config = json.load(open(f"{target}/config.json"))
d = config["head_dim"]
# What MaxText's Llama 3.1 tables do to a default-RoPE model: RoPE's halves interleaved (the bug the check caught).
order = np.concatenate([np.arange(0, d, 2), np.arange(1, d, 2)])
for name in list(weights):
    if name.endswith("self_attn.q_proj.weight"):
        w = weights[name].reshape(-1, d, weights[name].shape[-1])
        weights[name] = np.ascontiguousarray(w[:, order, :].reshape(weights[name].shape))
save_file(weights, f"{target}/model.safetensors", metadata={"format": "pt"})
cfg = verify._config([*maxtext_args, "dtype=float32", "matmul_precision=highest"])
flat = export._params(epath.Path(checkpoints) / str(step) / "items")
tokenizer = export.hf_tokenizer()
ids = [i % cfg.vocab_size for i in tokenizer(export.TEXT)["input_ids"][:32]]
print(json.dumps(export.compare_logits(export.maxtext_logits(cfg, flat, ids), export.hf_logits(target, ids))))
"""


def test_the_export_loads_with_transformers_and_a_scrambled_one_fails_the_logits_check(
    local_run, trainer_python, tmp_path
):
    assert local_run.returncode == 0, local_run.stderr
    [stage] = [s for s in local_run.plan.stages if s.export]
    done = run_in_trainer(trainer_python, LOAD, stage.export_dir)
    assert done.returncode == 0, done.stderr[-3000:]
    loaded = json.loads(done.stdout.splitlines()[-1])
    report = json.load(open(f"{local_run.plan.run_dir}/reports/{stage.name}/export.json", encoding="utf-8"))
    assert loaded["finite"] and loaded["shape"][-1] == loaded["vocab"] == report["vocab_size"]
    assert loaded["ids"][0] == 128000  # <|begin_of_text|>: the Llama 3 tokenizer from the maxtext package
    assert report["verdict"] == "PASS" and report["logits_check"]["argmax_agree"] == 1.0
    args = [stage.checkpoint_dir, str(stage.final_step), *stage.maxtext_args]
    done = run_in_trainer(trainer_python, SCRAMBLE, stage.export_dir, str(tmp_path / "scrambled"), *args)
    assert done.returncode == 0, done.stderr[-3000:]
    scrambled = json.loads(done.stdout.splitlines()[-1])
    assert not scrambled["passed"] and scrambled["max_abs_diff"] > 100 * scrambled["atol"]
