"""Preflight: reading XLA's verdicts, the verdict cache, stage reports and costs, and one real AOT compile."""

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from multislice import config, preflight, tpu
from multislice.backends.local.aot import AotSession
from multislice.plan import make_plan
from multislice.steps import preflight as step
from multislice.trainer import aot
from tests.conftest import ROOT
from tests.golden import no_cloud_env

DATA = ROOT / "tests" / "data"
GIB = 2**30


def recorded_oom_messages() -> dict[str, str]:
    return json.loads((DATA / "oom_messages.json").read_text())["messages"]


@pytest.mark.parametrize(
    ("name", "required", "available"),
    [
        ("v6e-16 x 2, llama3-70b, per_device_batch_size 2 (the seed command)", "49.82", "31.24"),
        (
            "v6e-16 x 2, llama3-70b, per_device_batch_size 2 (the seed command, with the v6e libtpu flags)",
            "50.33",
            "31.24",
        ),
        ("v5e-16, llama3-70b, per_device_batch_size 4", "98.74", "15.75"),
        ("v5p-16, llama3-70b, per_device_batch_size 4", "172.38", "95.73"),
        ("v4-16, llama3-70b, per_device_batch_size 4", "172.07", "30.75"),
    ],
)
def test_out_of_hbm_messages_are_read_in_gib(name, required, available):
    oom = aot.parse_oom(recorded_oom_messages()[name])
    assert oom["required_bytes"] == round(float(required) * GIB)
    assert oom["available_bytes"] == round(float(available) * GIB)
    assert oom["what"] == "HLO temporaries"
    assert "CompileTimeHbmOom" in oom["message"]


def test_older_oom_wording_and_non_oom_errors():
    older = "RESOURCE_EXHAUSTED: Ran out of memory in memory space hbm. Used 49.80G of 31.25G hbm. Exceeded by 18.55G"
    oom = aot.parse_oom(older)
    assert (oom["required_bytes"], oom["available_bytes"]) == (round(49.80 * GIB), round(31.25 * GIB))
    assert aot.parse_oom("INVALID_ARGUMENT: ici_fsdp_parallelism must divide the devices") is None
    assert aot.size_to_bytes("512M") == 512 * 2**20 and aot.size_to_bytes("0B") == 0
    with pytest.raises(ValueError, match="not an XLA size"):
        aot.size_to_bytes("lots")


def test_usable_hbm_in_the_catalog_is_what_the_compiler_reported():
    for name, message in recorded_oom_messages().items():
        tpu_type = name.split(",")[0].split(" ")[0]
        shape = tpu.parse_tpu_type(tpu_type)
        assert shape.usable_hbm_bytes_per_chip == aot.parse_oom(message)["available_bytes"], name


def test_memory_stats_total_counts_code_and_subtracts_aliased_outputs():
    # The 8B stage of gke-v6e-16x2-seed as XLA reported it here (CompiledMemoryStats, bytes per chip).
    stats = SimpleNamespace(
        argument_size_in_bytes=6024617984, output_size_in_bytes=6023313152, alias_size_in_bytes=6023307264,
        temp_size_in_bytes=17945329664, generated_code_size_in_bytes=94042624, host_argument_size_in_bytes=0,
        host_output_size_in_bytes=0, host_alias_size_in_bytes=0, host_temp_size_in_bytes=0,
        host_generated_code_size_in_bytes=0,
    )  # fmt: skip
    memory = aot.memory_from_stats(stats)
    assert memory["total"] == 6024617984 + 6023313152 + 17945329664 + 94042624 - 6023307264
    assert round(memory["total"] / GIB, 2) == 22.41


SEED_ARGS = [
    "run_name=a", "base_output_directory=gs://bucket/runs/a", "model_name=llama3-70b", "steps=200",
    "per_device_batch_size=2", "max_target_length=4096", "checkpoint_period=50", "jax_cache_dir=gs://bucket/a/jax",
    "ici_tensor_parallelism=4", "ici_fsdp_parallelism=4", "dcn_fsdp_parallelism=2",
]  # fmt: skip
VERSIONS = {"maxtext": "0.2.5", "libtpu": "0.0.52", "jax": "0.12.0.1"}


def test_cache_key_ignores_names_paths_and_step_counts_but_not_what_shapes_the_program():
    key = aot.cache_key("v6e-16", 2, SEED_ARGS, VERSIONS)
    renamed = [a.replace("=a", "=b").replace("steps=200", "steps=5000") for a in SEED_ARGS]
    assert aot.cache_key("v6e-16", 2, renamed, VERSIONS) == key
    assert aot.cache_key("v6e-16", 2, list(reversed(SEED_ARGS)), VERSIONS) == key
    assert aot.cache_key("v6e-16", 4, SEED_ARGS, VERSIONS) != key
    assert aot.cache_key("v6e-32", 2, SEED_ARGS, VERSIONS) != key
    assert aot.cache_key("v6e-16", 2, [*SEED_ARGS, "per_device_batch_size=1"], VERSIONS) != key
    assert aot.cache_key("v6e-16", 2, SEED_ARGS, {**VERSIONS, "libtpu": "0.0.53"}) != key
    compile_args = aot.compile_args(SEED_ARGS, "v6e-16", 2, "/tmp/scratch")
    assert "base_output_directory=/tmp/scratch" in compile_args and "compile_topology_num_slices=2" in compile_args
    assert not any("gs://" in a for a in compile_args)  # nothing of the run's bucket is touched by a compile


def test_a_cached_verdict_is_answered_without_compiling(tmp_path):
    request = {"name": "seed", "compile_topology": "v6e-16", "num_slices": 2, "maxtext_args": SEED_ARGS}
    found = aot.versions()
    stored = {"verdict": "does_not_fit", "oom": {"required_bytes": 1, "available_bytes": 2}, "compile_seconds": 13.6}
    aot.cache_write(str(tmp_path), aot.cache_key("v6e-16", 2, SEED_ARGS, found), stored)
    # This environment has no MaxText: answering by compiling would fail, so the answer is the cache's.
    answered = aot.answer(request, str(tmp_path), str(tmp_path / "scratch"), found)
    assert answered["cached"] is True and answered["verdict"] == "does_not_fit" and answered["name"] == "seed"
    assert aot.cache_read(str(tmp_path), "0" * 64) is None
    assert not list(tmp_path.glob(".*.tmp"))


def gke_plan(stage_name: str):
    spec = config.load_profile("gke-v6e-16x2-seed", {"output_dir": "gs://bucket/runs"})
    return make_plan(spec.with_stages(spec.stage(stage_name)))


def test_stage_report_of_a_stage_that_does_not_fit_states_numbers_units_and_cost(gcs):
    plan = gke_plan("seed-llama3-70b")
    stage = plan.stages[0]
    message = recorded_oom_messages()["v6e-16 x 2, llama3-70b, per_device_batch_size 2 (the seed command)"]
    result = {
        "verdict": "does_not_fit", "oom": aot.parse_oom(message), "compile_seconds": 13.6, "cached": False,
        "model_tflops_per_step_per_device": 3548.09, "tokens_per_step_per_device": 8192.0,
    }  # fmt: skip
    report = preflight.stage_report(plan, stage, result)
    assert report.verdict == "does_not_fit"
    assert report.target.model_dump() == {
        "tpu_type": "v6e-16", "compile_topology": "v6e-16", "num_slices": 2, "chips": 32
    }  # fmt: skip
    assert report.required_bytes_per_chip == round(49.82 * GIB)
    assert report.headroom_bytes_per_chip == round(31.24 * GIB) - round(49.82 * GIB)
    assert "bytes per chip" in report.units
    line = preflight.summary_line(report)
    assert "does not fit on 2 x v6e-16: needs 49.82 GiB per chip, 31.24 GiB available (over by 18.58 GiB)" in line
    # 3548.09 TFLOP per step per chip / (918 TFLOP/s x 0.4) = 9.66 s; x 200 steps x 32 chips / 3600 = 17.18 chip-hours
    cost = report.cost
    assert cost.estimated_step_seconds == pytest.approx(9.663, abs=1e-3)
    assert cost.chip_hours == pytest.approx(17.18, abs=0.01)
    assert cost.estimated_cost == pytest.approx(17.18 * 2.70, abs=0.05)
    page = step.result_page(plan, [report])
    assert "<td>seed-llama3-70b</td>" in page and "does_not_fit" in page
    assert ">49.82<" in page and ">31.24<" in page and ">-18.58<" in page  # GiB per chip
    assert gcs.names(prefix="runs/") == ["runs/llama3-multislice/reports/seed-llama3-70b/preflight.html"]


def test_skip_preflight_checks_nothing(tmp_path):
    spec = config.load_profile("local", {"output_dir": str(tmp_path), "skip_preflight": True})
    reports = step.run(make_plan(spec))
    assert {r.verdict for r in reports.values()} == {"skipped"}
    assert json.loads((tmp_path / spec.run_name / "reports" / "tiny-8b-recipe" / "preflight.json").read_text())


def test_cli_names_a_stage_that_is_not_there():
    from multislice import cli

    with pytest.raises(SystemExit):
        cli.main(["preflight"])
    assert cli.main(["preflight", "--profile", "gke-v6e-16x2-seed", "--stage", "nope"]) == 2


@pytest.mark.aot
def test_the_readme_example_compiles_here_without_credentials_and_a_rerun_is_cached(tmp_path):
    """``multislice preflight --profile gke-v6e-16x2-seed --stage seed-llama3-70b``: a real AOT compile here."""
    home, cache, report = tmp_path / "home", tmp_path / "cache", tmp_path / "report.json"
    home.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "preflight", "--profile", "gke-v6e-16x2-seed", "--stage",
         "seed-llama3-70b", "--no-alternative", "--cache-dir", str(cache), "--report", str(report)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=no_cloud_env(home), timeout=1500,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stdout, done.stdout[-3000:]
    assert "on the local backend" in done.stdout
    assert "[preflight seed-llama3-70b] does not fit on 2 x v6e-16: needs " in done.stdout
    [first] = json.loads(report.read_text())["stages"]
    assert first["verdict"] == "does_not_fit" and not first["cached"]
    # Measured here: 50.33 GiB with the v6e libtpu flags the run's pods get (49.82 GiB without; docs/preflight.md).
    assert 45 * GIB < first["required_bytes_per_chip"] < 55 * GIB
    assert first["model_tflops_per_step_per_device"] > 3000  # MaxText's count: 3548 TFLOP per chip per step
    plan = gke_plan("seed-llama3-70b")
    request = preflight.request_for(plan, plan.stages[0])
    with AotSession(str(cache), tmp_path / "work") as session:
        again = preflight.stage_report(plan, plan.stages[0], session.compile(request, timeout=60))
    assert again.cached and again.verdict == "does_not_fit"
    assert again.hbm_bytes_per_chip == plan.spec.slice_type.usable_hbm_bytes_per_chip
    assert len(list(cache.glob("*.json"))) == 1


@pytest.mark.aot
def test_preflight_step_writes_reports_and_a_rerun_takes_the_cached_verdicts(tmp_path):
    plan = make_plan(config.load_profile("local", {"output_dir": str(tmp_path), "run_name": "first"}))
    first = step.run(plan)
    assert [r.verdict for r in first.values()] == ["fits", "fits"]
    assert not any(r.cached for r in first.values())
    for stage in plan.stages:
        written = json.loads((Path(plan.run_dir) / "reports" / stage.name / "preflight.json").read_text())
        assert written["bytes_per_chip"]["total"] < written["hbm_bytes_per_chip"]
        assert written["target"] == {
            "tpu_type": "v5litepod-8",
            "compile_topology": "v5e-8",
            "num_slices": 2,
            "chips": 16,
        }
    # Another run of the same configs (another run name, same output_dir): verdicts from the shared cache.
    rerun = make_plan(config.load_profile("local", {"output_dir": str(tmp_path), "run_name": "second"}))
    again = step.run(rerun)
    assert all(r.cached for r in again.values())
    assert [r.bytes_per_chip for r in again.values()] == [r.bytes_per_chip for r in first.values()]
