"""libtpu / XLA flags: MaxText's recipe table, profile and stage changes, the TPU JobSet's env, preflight's compile."""

import json
import os
import sys
import textwrap

import pytest

from multislice import config, libtpu_flags, preflight
from multislice.backends.gke.aot import render_job
from multislice.backends.local.aot import AotSession
from multislice.errors import ConfigError
from multislice.plan import make_plan
from multislice.preflight import PreflightError
from multislice.render import jobset
from multislice.render.ray import render_rayjob
from multislice.trainer import aot

RECIPE_8B = {  # benchmarks/maxtext_trillium_model_configs.py llama3_8b_8192: DENSE_VMEM_LIMIT_FLAG + CF_FOR_ALL_GATHER
    "xla_tpu_scoped_vmem_limit_kib": "98304",
    "xla_tpu_enable_async_collective_fusion": "true",
    "xla_tpu_enable_async_collective_fusion_fuse_all_gather": "true",
    "xla_tpu_enable_async_collective_fusion_multiple_steps": "true",
    "xla_tpu_overlap_compute_collective_tc": "true",
    "xla_enable_async_all_gather": "true",
}
#: What v6e pods get of it: libtpu 0.0.52 refuses continuation fusion on v6e (libtpu_flags.REFUSED).
V6E_8B = {k: v for k, v in RECIPE_8B.items() if "async_collective_fusion" not in k}


def gke_spec(**overrides):
    return config.load_profile("gke-v6e-16x2-seed", {"output_dir": "gs://bucket/runs", **overrides})


def env_of(container) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def trainer_container(obj):
    return obj["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]


def test_the_v6e_recipes_give_8b_and_70b_their_flags_in_the_tpu_jobset():
    plan = make_plan(gke_spec())
    eight, seventy = plan.stages
    assert eight.libtpu_flags == V6E_8B
    value = env_of(trainer_container(jobset.render_jobset(plan, eight, hardware="tpu", pipeline_run_id="r")))
    assert value == {"LIBTPU_INIT_ARGS": " ".join(f"--{k}={v}" for k, v in V6E_8B.items()), "PYTHONUNBUFFERED": "1"}
    # llama3_70b_8192: the 8B groups + HOST_OFFLOAD_FLAGS, then --xla_tpu_scheduler_percent_shared_memory_limit=90,
    # which replaces HOST_OFFLOAD_FLAGS' 100 (a later flag wins in absl; one occurrence is rendered).
    args = env_of(trainer_container(jobset.render_jobset(plan, seventy, hardware="tpu", pipeline_run_id="r")))
    args = args["LIBTPU_INIT_ARGS"].split(" ")
    assert args[: len(V6E_8B)] == [f"--{k}={v}" for k, v in V6E_8B.items()]
    assert "--xla_tpu_host_transfer_overlap_limit=24" in args and "--xla_latency_hiding_scheduler_rerun=2" in args
    assert [a for a in args if "percent_shared_memory_limit" in a] == [
        "--xla_tpu_scheduler_percent_shared_memory_limit=90"
    ]
    assert len(args) == len(set(args)) == 17 - 3  # less the 3 refused continuation-fusion flags


def test_cpu_jobsets_and_generations_without_a_recipe_get_no_flags():
    plan = make_plan(gke_spec())
    cpu = trainer_container(jobset.render_jobset(plan, plan.stages[0], hardware="cpu", pipeline_run_id="r"))
    assert "LIBTPU_INIT_ARGS" not in env_of(cpu)
    local = make_plan(config.load_profile("local-synthetic", {}))  # v5litepod-8: MaxText has no v5e recipe here
    assert all(stage.libtpu_flags == {} for stage in local.stages)
    tpu = trainer_container(jobset.render_jobset(local, local.stages[0], hardware="tpu", pipeline_run_id="r"))
    assert "LIBTPU_INIT_ARGS" not in env_of(tpu)
    assert preflight.request_for(local, local.stages[0])["libtpu_flags"] == {}


def test_v5p_gets_the_dense_v5p_recipe_and_any_other_v6e_model_the_shared_groups():
    plan = make_plan(
        gke_spec(tpu_type="v5p-32", **{"stages.0.libtpu_flags.recipe": None, "stages.1.libtpu_flags.recipe": None})
    )  # 16 chips, as v6e-16
    v5p = {  # less continuation fusion, which libtpu 0.0.52 refuses on v5p as on v6e
        "xla_tpu_enable_data_parallel_all_reduce_opt": "true",
        "xla_tpu_data_parallel_opt_different_sized_ops": "true",
        **{k: v for k, v in V6E_8B.items() if k != "xla_tpu_scoped_vmem_limit_kib"},
    }
    assert plan.stages[0].libtpu_flags == v5p
    # The 70B stage keeps its AdamW moments in host memory: v5p's recipes offload nothing, so the stage gets
    # MaxText's HOST_OFFLOAD_FLAGS before the row's.
    assert plan.stages[1].libtpu_flags == {**libtpu_flags.GROUPS["HOST_OFFLOAD_FLAGS"], **v5p}
    assert libtpu_flags.recipe_for("v6e", None).flags() == RECIPE_8B  # a custom model on v6e
    assert libtpu_flags.recipe_for("v5litepod", None) is None  # a custom model on v5e: no recipe
    assert libtpu_flags.recipe_for("v6e", "llama3.1-70b").flags()["xla_tpu_assign_all_reduce_scatter_layout"] == "true"


def test_a_pinned_recipe_of_another_generation_is_refused_naming_the_field():
    with pytest.raises(ConfigError, match=r"stages\[0\] \(llama3-8b\)\.libtpu_flags\.recipe: llama3_8b_8192 is "
                                          r"MaxText's recipe for v6e, and this run's tpu_type is v5p"):  # fmt: skip
        gke_spec(tpu_type="v5p-32")
    with pytest.raises(ConfigError, match="recipe: 'llama9' is not a recipe of the table"):
        gke_spec(**{"stages.0.libtpu_flags.recipe": "llama9"})


def test_the_production_stages_get_the_measured_v6e_rows():
    plan = make_plan(config.load_profile("gke-v6e-16x2", {"output_dir": "gs://bucket/runs"}))
    eight, seventy = plan.stages
    measured_8b = libtpu_flags.NAMED["llama3_1_8b_8192_no_collective_matmul"].flags()
    measured_70b = libtpu_flags.NAMED["llama3_1_70b_8192_bs2_bfloat16_no_collective_matmul"].flags()
    assert eight.libtpu_flags == {k: v for k, v in measured_8b.items() if k not in libtpu_flags.REFUSED["v6e"]}
    assert seventy.libtpu_flags == {k: v for k, v in measured_70b.items() if k not in libtpu_flags.REFUSED["v6e"]}
    for flags in (eight.libtpu_flags, seventy.libtpu_flags):  # what the measured runs added to the seed's rows
        assert flags["xla_tpu_assign_all_reduce_scatter_layout"] == "true"
        assert flags["xla_tpu_enable_data_parallel_all_reduce_opt"] == "true"
        assert flags["xla_jf_spmd_threshold_for_windowed_einsum_mib"] == "1000000"  # no collective matmul
    assert eight.libtpu_flags["xla_tpu_enable_sparse_core_collective_offload_all_reduce"] == "true"
    assert "xla_tpu_enable_sparse_core_collective_offload_all_reduce" not in seventy.libtpu_flags


def test_flags_libtpu_refuses_on_v6e_are_left_out_but_a_profile_may_set_them():
    assert set(libtpu_flags.REFUSED["v6e"]) == set(RECIPE_8B) - set(V6E_8B)
    assert libtpu_flags.table_flags("v6e", "llama3-8b", "llama3_8b_8192") == V6E_8B
    assert set(libtpu_flags.REFUSED["v5p"]) == set(libtpu_flags.REFUSED["v6e"])
    assert "xla_tpu_enable_async_collective_fusion" not in libtpu_flags.table_flags("v5p", "llama3-8b")
    assert libtpu_flags.table_flags("v5litepod", "llama3-8b")["xla_tpu_enable_async_collective_fusion"] == "true"
    plan = make_plan(gke_spec(**{"libtpu_flags.add.xla_tpu_enable_async_collective_fusion": "true"}))
    assert plan.stages[0].libtpu_flags["xla_tpu_enable_async_collective_fusion"] == "true"
    data = gke_spec().model_dump(mode="json")
    data["libtpu_flags"] = {"remove": ["xla_tpu_enable_async_collective_fusion"]}  # not in the v6e table
    with pytest.raises(ConfigError, match="libtpu_flags.remove: xla_tpu_enable_async_collective_fusion is not"):
        config.load_spec(data)


def test_every_table_row_names_its_maxtext_source_and_valid_flags():
    for (generation, _model), recipe in libtpu_flags.RECIPES.items():
        assert recipe.source.startswith("AI-Hypercomputer/maxtext@") and recipe.recipe
        assert ("trillium" in recipe.source) == (generation == "v6e")
        for name, value in recipe.flags().items():
            assert libtpu_flags.name_problem(name) is None and libtpu_flags.value_problem(value) is None
    assert "llama3_70b_8192" in libtpu_flags.table_markdown()


def test_a_profile_adds_and_removes_flags_and_a_stage_changes_them_after_it():
    spec = gke_spec()
    data = spec.model_dump(mode="json")
    data["libtpu_flags"] = {"add": {"xla_tpu_scoped_vmem_limit_kib": 81920, "xla_new_flag": True},
                            "remove": ["xla_enable_async_all_gather"]}  # fmt: skip
    data["stages"][1]["libtpu_flags"]["remove"] = ["xla_new_flag", "xla_tpu_host_transfer_overlap_limit"]
    plan = make_plan(config.load_spec(data))
    eight, seventy = plan.stages
    assert eight.libtpu_flags["xla_tpu_scoped_vmem_limit_kib"] == "81920"
    assert eight.libtpu_flags["xla_new_flag"] == "true" and "xla_enable_async_all_gather" not in eight.libtpu_flags
    assert "xla_new_flag" not in seventy.libtpu_flags
    assert "xla_tpu_host_transfer_overlap_limit" not in seventy.libtpu_flags
    assert seventy.libtpu_flags["xla_tpu_scoped_vmem_limit_kib"] == "81920"
    value = env_of(trainer_container(jobset.render_jobset(plan, eight, hardware="tpu", pipeline_run_id="r")))
    assert "--xla_new_flag=true" in value["LIBTPU_INIT_ARGS"].split(" ")


@pytest.mark.parametrize(
    ("flags", "where", "says"),
    [
        ({"add": {"--xla_tpu_x": 1}}, "libtpu_flags.add", "without the leading '--'"),
        ({"add": {"xla tpu": 1}}, "libtpu_flags.add", "not a libtpu flag name"),
        ({"add": {"xla_tpu_x": "a b"}}, "libtpu_flags.add", "without spaces"),
        ({"add": {"xla_tpu_x": ""}}, "libtpu_flags.add", "non-empty"),
        ({"add": {"xla_a": 1}, "remove": ["xla_a"]}, "libtpu_flags", "both in add and in remove"),
        ({"remove": ["xla_not_in_the_table"]}, "libtpu_flags.remove", "not a flag of any stage's recipe on v6e"),
        ({"keep": ["x"]}, "libtpu_flags.keep", "unknown field"),
    ],
)
def test_bad_flag_changes_are_refused_naming_the_field(flags, where, says):
    data = gke_spec().model_dump(mode="json")
    data["libtpu_flags"] = flags
    with pytest.raises(ConfigError) as raised:
        config.load_spec(data)
    assert where in str(raised.value) and says in str(raised.value)


def test_a_stage_removing_a_flag_it_does_not_have_is_refused_naming_the_stage():
    data = gke_spec().model_dump(mode="json")
    data["stages"][0]["libtpu_flags"]["remove"] = ["xla_tpu_host_transfer_overlap_limit"]  # a 70B-only flag here
    with pytest.raises(ConfigError, match=r"stages\[0\] \(llama3-8b\)\.libtpu_flags\.remove: "
                                          r"xla_tpu_host_transfer_overlap_limit is not among"):  # fmt: skip
        config.load_spec(data)


def test_preflight_compiles_with_the_run_flags_on_gke_and_the_cache_key_holds_them():
    plan = make_plan(gke_spec())
    stage = plan.stages[1]
    request = preflight.request_for(plan, stage)
    assert request["libtpu_flags"] == stage.libtpu_flags
    job = render_job(plan, request, None, "r")
    container = job["spec"]["template"]["spec"]["containers"][0]
    pods = env_of(trainer_container(jobset.render_jobset(plan, stage, hardware="tpu", pipeline_run_id="r")))
    assert env_of(container)["LIBTPU_INIT_ARGS"] == pods["LIBTPU_INIT_ARGS"]
    assert json.loads(container["command"][container["command"].index("--request-json") + 1]) == request
    found = {"maxtext": "0.2.5", "libtpu": "0.0.52", "jax": "0.12.0.1"}
    args = request["maxtext_args"]
    bare = aot.cache_key("v6e-16", 2, args, found)
    assert aot.cache_key("v6e-16", 2, args, found, {}) == bare  # no flags: the key of before
    keyed = aot.cache_key("v6e-16", 2, args, found, stage.libtpu_flags)
    assert keyed != bare and aot.cache_key("v6e-16", 2, args, found, {**stage.libtpu_flags, "xla_x": "1"}) != keyed


def test_the_ray_tpu_workers_get_the_flags_too():
    spec = gke_spec(launcher="ray")
    plan = make_plan(spec)
    worker_group = render_rayjob(plan, plan.stages[0], pipeline_run_id="r")["spec"]["rayClusterSpec"]
    worker = worker_group["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    assert env_of(worker)["LIBTPU_INIT_ARGS"] == libtpu_flags.init_args(V6E_8B)


def test_a_compile_process_refuses_a_request_with_other_flags(monkeypatch):
    monkeypatch.setattr(aot, "_prepared", {"xla_a": "1"})
    assert aot.flags_mismatch({"xla_a": "1"}) is None
    result = aot.compile_one({"name": "s", "compile_topology": "v6e-16", "num_slices": 1, "maxtext_args": [],
                              "libtpu_flags": {"xla_a": "2"}}, "/tmp/none")  # fmt: skip
    assert result["verdict"] == "error" and "--xla_a=1" in result["error"] and "--xla_a=2" in result["error"]


FAKE_COMPILER = textwrap.dedent(
    """\
    #!{python}
    # Stands in for the trainer environment's python: answers each request with the process's
    # LIBTPU_INIT_ARGS and pid, as multislice.trainer.aot's results file would hold them.
    import json, os, sys
    results = sys.argv[sys.argv.index("--results") + 1]
    for line in sys.stdin:
        request = json.loads(line)
        if "xla_unknown" in os.environ.get("LIBTPU_INIT_ARGS", ""):
            print("ERROR: Unknown command line flag 'xla_unknown'", flush=True)
            sys.exit(1)
        with open(results, "a") as out:
            out.write(json.dumps({{"name": request["name"], "verdict": "fits", "pid": os.getpid(),
                                  "env": os.environ.get("LIBTPU_INIT_ARGS")}}) + "\\n")
    """
)


@pytest.fixture
def fake_trainer_env(tmp_path):
    env = tmp_path / "env"
    (env / "bin").mkdir(parents=True)
    python = env / "bin" / "python"
    python.write_text(FAKE_COMPILER.format(python=sys.executable))
    python.chmod(0o755)
    return env


def test_the_local_compile_process_runs_with_each_request_flags_and_restarts_when_they_change(
    tmp_path, fake_trainer_env
):
    plan = make_plan(gke_spec())
    eight, seventy = (preflight.request_for(plan, stage) for stage in plan.stages)
    with AotSession(None, tmp_path / "work", env_dir=fake_trainer_env) as session:
        first = session.compile(eight, timeout=60)
        again = session.compile({**eight, "name": "again"}, timeout=60)
        other = session.compile(seventy, timeout=60)
    assert first["env"] == libtpu_flags.init_args(plan.stages[0].libtpu_flags)
    assert again["pid"] == first["pid"]  # same flags: the same process
    assert other["env"] == libtpu_flags.init_args(plan.stages[1].libtpu_flags) and other["pid"] != first["pid"]


def test_an_unknown_flag_that_ends_the_compile_process_fails_preflight_with_the_fix(tmp_path, fake_trainer_env):
    plan = make_plan(gke_spec())
    request = {**preflight.request_for(plan, plan.stages[0]), "libtpu_flags": {"xla_unknown": "true"}}
    with AotSession(None, tmp_path / "work", env_dir=fake_trainer_env) as session:
        with pytest.raises(PreflightError) as raised:
            session.compile(request, timeout=60)
    assert "exited with status 1" in raised.value.message
    assert "--xla_unknown" in raised.value.fix and "libtpu_flags" in raised.value.fix


@pytest.mark.aot
def test_libtpu_refuses_an_unknown_flag_in_a_real_aot_compile(tmp_path):
    """A 2-layer model for 2 x v5e-8 with one made-up flag: libtpu ends the compile (about a minute here)."""
    plan = make_plan(config.load_profile("local-synthetic", {"output_dir": str(tmp_path / "out")}))
    request = {**preflight.request_for(plan, plan.stages[0]), "libtpu_flags": {"xla_no_such_flag_here": "true"}}
    assert os.environ.get("LIBTPU_INIT_ARGS") is None
    with AotSession(None, tmp_path / "work") as session:
        with pytest.raises(PreflightError) as raised:
            session.compile(request, timeout=600)
    assert "Unknown command line flag 'xla_no_such_flag_here'" in raised.value.message
    assert "--xla_no_such_flag_here" in raised.value.fix


#: One tiny compile per generation of the table: (tpu_type, the row pinned). Each row is the generation's widest:
#: v6e's measured 8B row holds every flag of its 70B row (and of the seed rows, less the refused); v5p's row is
#: compiled with the optimizer in host memory, so with the HOST_OFFLOAD_FLAGS an offloading v5p stage gets; v5e's
#: 8B row holds its 70B row's.
GENERATION_ROWS = [
    ("v6e-4", "llama3_1_8b_8192_no_collective_matmul"),
    ("v5p-8", "llama2_70b_v5p_128"),
    ("v5litepod-4", "llama3_1_8b_8192_v5e_256"),
]


def tiny_request(tpu_type: str, recipe: str, output_dir) -> dict:
    """The local-synthetic 2-layer stage on one slice of ``tpu_type`` with recipe ``recipe``'s flags pinned."""
    data = {**config.read_profile("local-synthetic"), "tpu_type": tpu_type, "num_slices": 1, "output_dir": output_dir}
    stage = {**data["stages"][0], "ici": {"fsdp": -1}, "dcn": {"data": -1}, "libtpu_flags": {"recipe": recipe},
             "maxtext_overrides": {"optimizer_memory_host_offload": True}}  # fmt: skip
    plan = make_plan(config.load_spec({**data, "stages": [stage]}))
    return preflight.request_for(plan, plan.stages[0])


def test_each_generation_row_is_what_its_stages_get():
    for tpu_type, recipe in GENERATION_ROWS:
        flags = tiny_request(tpu_type, recipe, "out")["libtpu_flags"]
        generation = libtpu_flags.NAMED[recipe].generation
        assert flags == libtpu_flags.table_flags(generation, None, recipe, host_offload=True)
        assert set(libtpu_flags.GROUPS["HOST_OFFLOAD_FLAGS"]) <= set(flags)
        assert not set(libtpu_flags.REFUSED.get(generation, {})) & set(flags)
    # The production v6e stages get the measured rows by default; every other v6e row's flags are among the 8B's.
    v6e = set(libtpu_flags.table_flags("v6e", "llama3-8b"))
    assert all(set(libtpu_flags.table_flags("v6e", None, r.recipe)) <= v6e
               for r in libtpu_flags.NAMED.values() if r.generation == "v6e")  # fmt: skip


@pytest.mark.aot
@pytest.mark.parametrize(("tpu_type", "recipe"), GENERATION_ROWS)
def test_each_generations_flags_compile_with_the_installed_libtpu(tpu_type, recipe, tmp_path):
    """A 2-layer model for one slice of each generation, AOT-compiled with that generation's table flags.

    libtpu reads ``LIBTPU_INIT_ARGS`` when it initialises: a flag it does not know ends the compile process, one it
    refuses for the platform ends the compile with an error; either fails this test, naming the flag
    (libtpu_flags.REFUSED records those the table leaves out).
    """
    request = tiny_request(tpu_type, recipe, str(tmp_path / "out"))
    with AotSession(None, tmp_path / "work") as session:
        result = session.compile(request, timeout=600)
    assert result["verdict"] == "fits", result.get("error")
    assert result["libtpu_init_args"].startswith(libtpu_flags.init_args(request["libtpu_flags"]))
