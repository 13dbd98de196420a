"""An export that could not run is refused at plan, naming the field and the fix, before anything is created; what
an export needs (dtype, memory, scratch) is known from the config; the Hub token reaches the exporter only by
reference."""

from __future__ import annotations

import copy
import subprocess
import sys

import pytest

from multislice import config, exporting
from multislice.backends.gke import exporter
from multislice.plan import make_plan
from multislice.steps import plan as plan_step
from multislice.trainer import export, hub_token
from tests.fakes import FakeServer

EXPORTING = 1  # the local profile's stage with export: huggingface (tiny-70b-recipe)
WHERE = "stages[1] (tiny-70b-recipe)"


def local_profile(tmp_path, **stage):
    """The local profile, output in ``tmp_path/out``, its exporting stage updated with ``stage``."""
    profile = copy.deepcopy(config.read_profile("local"))
    profile["output_dir"] = str(tmp_path / "out")
    profile["stages"][EXPORTING].update(stage)
    return profile


def files_under(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*")) if path.exists() else []


def refused_at_plan(profile, tmp_path) -> str:
    """The plan step's refusal (a ConfigError) of ``profile``; asserts it created nothing under ``tmp_path``."""
    before = files_under(tmp_path)
    with pytest.raises(config.ConfigError) as caught:
        plan_step.run(profile, {})
    assert files_under(tmp_path) == before, "the refused plan created files"
    return str(caught.value)


@pytest.mark.parametrize(
    "model, named",
    [
        ({"preset": "llama3-tiny", "num_decoder_layers": 4, "logits_via_embedding": True}, "logits_via_embedding"),
        ({"preset": "llama3-tiny", "num_decoder_layers": 4, "mlp_activations": ["gelu"]}, "mlp_activations"),
        ({"preset": "llama3-tiny", "num_decoder_layers": 4, "decoder_block": "mistral"}, "decoder_block mistral"),
    ],
)
def test_a_model_the_exporter_cannot_export_is_refused_at_plan(tmp_path, model, named):
    message = refused_at_plan(local_profile(tmp_path, model=model), tmp_path)
    assert f"{WHERE}.export" in message and named in message
    assert "Llama 2/3 decoder block" in message and "unset export" in message


def test_a_named_model_of_another_family_and_a_rope_override_are_refused():
    profile = copy.deepcopy(config.read_profile("gke-v6e-16x2-seed"))
    profile["stages"][0]["model"] = {"name": "llama3.1-8b"}
    profile["stages"][1]["maxtext_overrides"] = {"rope_type": "yarn", "optimizer_memory_host_offload": True}
    with pytest.raises(config.ConfigError) as caught:
        config.load_spec(profile)
    message = str(caught.value)
    assert "stages[0] (llama3-8b).export" in message and "model.name llama3.1-8b" in message
    assert "stages[1] (llama3-70b).export" in message and "maxtext_overrides.rope_type yarn" in message


@pytest.mark.parametrize(
    "tokenizer, named",
    [
        ({"type": "huggingface", "path": "meta-llama/Meta-Llama-3-8B"}, "names a Hugging Face Hub tokenizer"),
        ({"type": "sentencepiece", "path": "/models/tokenizer.vocab"}, "is not a sentencepiece .model file"),
    ],
)
def test_a_tokenizer_that_cannot_be_exported_is_refused_at_plan(tmp_path, tokenizer, named):
    profile = local_profile(tmp_path, tokenizer=tokenizer, data={"kind": "synthetic"}, eval_interval=-1)
    message = refused_at_plan(profile, tmp_path)
    assert f"{WHERE}.tokenizer" in message and named in message and "unset export" in message


def test_a_local_hugging_face_tokenizer_directory_without_tokenizer_json_is_refused_at_plan(tmp_path):
    folder = tmp_path / "tok"
    folder.mkdir()
    (folder / "vocab.txt").write_text("a\n")
    profile = local_profile(
        tmp_path, tokenizer={"type": "huggingface", "path": str(folder)}, data={"kind": "synthetic"}, eval_interval=-1
    )
    message = refused_at_plan(profile, tmp_path)
    assert f"{WHERE}.tokenizer" in message and "has no tokenizer.json" in message


def test_an_export_directory_that_cannot_be_created_is_refused_at_plan(tmp_path):
    out = tmp_path / "out" / "local-demo"
    out.mkdir(parents=True)
    (out / "tiny-70b-recipe").write_text("a file where the stage's directory goes")
    message = refused_at_plan(local_profile(tmp_path), tmp_path)
    assert "output_dir" in message and f"{out / 'tiny-70b-recipe'} is a file" in message
    assert "choose an output_dir this user can write" in message


def test_a_hub_repository_without_a_token_here_is_refused_at_plan(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    profile = local_profile(tmp_path, export_hub_repo="my-org/tiny")
    message = refused_at_plan(profile, tmp_path)
    assert f"{WHERE}.export_hub_repo" in message and "export HF_TOKEN" in message and "hub_token_secret" in message
    monkeypatch.setenv("HF_TOKEN", "hf_test")
    assert exporting.hub_token_locally()
    assert not config.export_environment_issues(config.load_spec(profile), {"tiny-70b-recipe": str(tmp_path / "e")})


def test_a_hub_repository_on_gke_needs_a_named_token_and_never_takes_the_token_itself():
    profile = copy.deepcopy(config.read_profile("gke-v6e-16x2-seed"))
    profile["stages"][0]["export_hub_repo"] = "my-org/llama3-8b"
    with pytest.raises(config.ConfigError) as caught:
        config.load_spec(profile)
    message = str(caught.value)
    assert "stages[0] (llama3-8b).export_hub_repo" in message
    assert "exporter.hub_token_kubernetes_secret" in message and "exporter.hub_token_secret" in message
    with pytest.raises(config.ConfigError) as caught:
        config.load_spec(profile, {"exporter.hub_token_secret": "hf_abcdefsecret"})
    assert "store it in Secret Manager" in str(caught.value) and "hf_abcdefsecret" not in str(caught.value)
    with pytest.raises(config.ConfigError, match="not a Hugging Face Hub repository id"):
        config.load_spec(profile, {"stages.0.export_hub_repo": "no-owner"})
    spec = config.load_spec(profile, {"exporter.hub_token_kubernetes_secret": "hf-token"})
    assert make_plan(spec).stages[0].export_hub_repo == "my-org/llama3-8b"


def test_export_options_without_an_export_are_refused():
    profile = copy.deepcopy(config.read_profile("local"))
    profile["stages"][0]["export_dtype"] = "bfloat16"
    with pytest.raises(config.ConfigError, match=r"stages\[0\] \(tiny-8b-recipe\)\.export_dtype: .*set export"):
        config.load_spec(profile)


def test_export_dtype_defaults_to_bfloat16_from_a_billion_parameters():
    gke = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    assert [s.export_dtype for s in gke.stages] == ["bfloat16", "bfloat16"]
    local = make_plan(config.load_profile("local"))
    assert local.stages[EXPORTING].export_dtype == "float32"  # 16.7M parameters
    forced = make_plan(config.load_profile("gke-v6e-16x2-seed", {"stages.0.export_dtype": "float32"}))
    assert forced.stages[0].export_dtype == "float32"


def test_export_memory_scratch_and_time_follow_the_arithmetic_in_the_docs():
    """docs/delivery.md and multislice/exporting.py: memory is the largest phase of one layer group (12 B a
    parameter of the embedding, 14 of a decoder layer) plus one storage chunk of a stacked weight, + 4 GiB;
    scratch: the split layers beside the embedding's shard, or the export; time from the parameters."""
    spec = config.load_profile("gke-v6e-16x2-seed")
    plan = make_plan(spec)
    eight, seventy = (exporter._sizing(plan, stage) for stage in plan.stages)
    assert eight.parameters == 8_030_261_248 and seventy.parameters == 70_553_706_496
    assert [exporter.weight_shards(stage) for stage in plan.stages] == [16, 32]  # fsdp 4 x tensor 4 (x DCN fsdp 2)
    # 70B: max(12 x 128256 x 8192, 14 x 855,654,400) + 2 x 4 B x 80 x 8192 x 28672 / 32 + 4 GiB
    assert seventy.memory_bytes == 12 * 128256 * 8192 + 2 * 4 * 80 * 8192 * 28672 // 32 + 4 * 2**30
    assert (seventy.quantity(seventy.memory_bytes), seventy.quantity(seventy.scratch_bytes)) == ("21Gi", "284Gi")
    assert (eight.quantity(eight.memory_bytes), eight.quantity(eight.scratch_bytes)) == ("11Gi", "31Gi")
    assert round(eight.seconds) == 649 and round(seventy.seconds) == 5701
    resources = exporter.resources(plan, plan.stages[1])
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "21Gi"  # was 793Gi (an M3 node)
    production = make_plan(config.load_profile("gke-v6e-16x2"))  # its 70B trains in bfloat16: half the chunk
    assert exporter.resources(production, production.stages[1])["requests"]["memory"] == "18Gi"


def test_the_exporter_command_carries_dtype_hub_repo_and_report_but_never_a_token():
    argv = export.command("gs://b/c", 9, "gs://b/e", ["model_name=llama3-8b"], dtype="bfloat16",
                          hub_repo="o/n", report="gs://b/r.json")  # fmt: skip
    assert argv == ["python", "-m", export.MODULE, "--checkpoint-dir", "gs://b/c", "--step", "9", "--output",
                    "gs://b/e", "--dtype", "bfloat16", "--hub-repo", "o/n", "--report", "gs://b/r.json", "--",
                    "model_name=llama3-8b"]  # fmt: skip
    card = {"run": "r1", "stage": "s", "data_fingerprint": None, "steps": 20, "train_loss": 6.5, "eval_loss": None}
    argv = export.command("c", 19, "e", ["k=v"], card=card)
    assert argv[argv.index("--run-name") :] == ["--run-name", "r1", "--stage", "s", "--steps", "20", "--train-loss",
                                                  "6.5", "--", "k=v"]  # fmt: skip


SECRET = "projects/team-project/secrets/hf-token/versions/latest"
DRIVER = """
import sys
from google.auth.credentials import AnonymousCredentials
from multislice.trainer import hub_token
hub_token.SECRET_MANAGER_ENDPOINT = sys.argv[1]
sys.exit(hub_token.main(sys.argv[2:], credentials=AnonymousCredentials()))
"""
#: Exits 0 when $HF_TOKEN is the secret's payload (spelled backwards here, so no argument holds the token).
CHECK = "import os, sys; sys.exit(0 if os.environ.get('HF_TOKEN') == 't3rc3s_fh'[::-1] else 3)"


def test_the_hub_token_wrapper_reads_secret_manager_and_runs_the_exporter_with_the_token_in_its_environment():
    with FakeServer() as server:
        server.state.secrets[SECRET] = b"hf_s3cr3t\n"
        argv = hub_token.command(SECRET, [sys.executable, "-c", CHECK], python=sys.executable)
        done = subprocess.run(
            [sys.executable, "-c", DRIVER, server.url, *argv[3:]], capture_output=True, text=True, timeout=120
        )
        assert done.returncode == 0, done.stderr  # the command ran (exec), HF_TOKEN set from the secret
        assert "hf_s3cr3t" not in done.stdout + done.stderr and "hf_s3cr3t" not in " ".join(argv)
        missing = SECRET.replace("hf-token", "absent")
        failed = subprocess.run(
            [sys.executable, "-c", DRIVER, server.url, "--secret-version", missing, "--", sys.executable, "-c", CHECK],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert failed.returncode == 2
        assert f"Secret Manager answered HTTP 404 for {missing}" in failed.stderr and "secretAccessor" in failed.stderr


def test_each_export_format_a_stage_can_name_is_one_registered_exporter_format():
    # The seam (multislice.trainer.export.ExportFormat): a format is one class in FORMATS, under the name the stage's
    # `export` takes; the reading and MaxText's side of the check are shared.
    import typing

    from multislice.config.models import Stage

    named = {a for a in typing.get_args(typing.get_args(Stage.model_fields["export"].annotation)[0]) if a}
    assert named == set(export.FORMATS) == {"huggingface"}
    assert all(isinstance(form, export.ExportFormat) and form.name == name for name, form in export.FORMATS.items())
    assert export.parser().parse_args(["--checkpoint-dir", "c", "--step", "1", "--output", "o"]).format == "huggingface"
    assert "--format" not in export.command("c", 1, "o", ["k=v"])  # the default is left out
    assert export.command("c", 1, "o", ["k=v"], export_format="gguf")[9:11] == ["--format", "gguf"]
