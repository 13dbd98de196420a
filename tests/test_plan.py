"""Plan: names, directories, resolved parallelism and MaxText arguments."""

from multislice import config, plan
from multislice.render.jobset import worker_command


def local_plan(**overrides):
    return plan.make_plan(config.load_profile("local", {"output_dir": "/data/out", **overrides}))


def test_resolve_degrees_fills_the_minus_one_axis():
    resolved = plan.resolve_degrees({"fsdp": -1, "tensor": 4}, 16)
    assert resolved["fsdp"] == 4 and resolved["tensor"] == 4 and resolved["data"] == 1
    assert set(resolved) == set(plan.maxtext.PARALLELISM_AXES)


def test_layout_of_a_run():
    p = local_plan(run_name="demo")
    first = p.stages[0]
    assert p.run_dir == "/data/out/demo"
    assert first.stage_dir == "/data/out/demo/tiny-8b-recipe"
    assert first.checkpoint_dir == "/data/out/demo/tiny-8b-recipe/checkpoints"
    assert first.jobset == "demo-tiny-8b-recipe"
    assert first.final_step == first.steps - 1
    assert p.total_chips == 16


def test_stage_parallelism_resolved_against_the_slice():
    p = local_plan()
    eight, seventy = p.stages
    assert (eight.ici["fsdp"], eight.ici["tensor"], eight.dcn["data"]) == (4, 2, 2)
    assert (seventy.ici["fsdp"], seventy.ici["tensor"], seventy.dcn["fsdp"], seventy.dcn["data"]) == (4, 2, 2, 1)


def test_maxtext_arguments_of_a_stage():
    p = local_plan(run_name="demo")
    args = dict(a.split("=", 1) for a in p.stages[1].maxtext_args)
    assert args["run_name"] == "tiny-70b-recipe"
    assert args["base_output_directory"] == "/data/out/demo"
    assert args["dcn_fsdp_parallelism"] == "2" and args["ici_tensor_parallelism"] == "2"
    assert args["remat_policy"] == "full" and args["enable_checkpointing"] == "true"
    assert args["mlp_activations"] == "[silu,linear]" and args["base_num_kv_heads"] == "2"
    assert args["jax_cache_dir"] == "/data/out/demo/jax_cache"
    assert "hardware" not in args


def test_cpu_and_tpu_pods_use_the_runs_compilation_cache():
    p = local_plan(run_name="demo")
    stage = p.stages[0]
    _, tpu_args = worker_command(p, stage, "tpu")
    _, cpu_args = worker_command(p, stage, "cpu")
    assert "jax_cache_dir=/data/out/demo/jax_cache" in tpu_args
    # Every CPU process writes its own entries (multislice.trainer.compile_cache), so they use the run's cache too.
    assert [a for a in cpu_args if a.startswith("jax_cache_dir=")] == ["jax_cache_dir=/data/out/demo/jax_cache"]
    assert "hardware=cpu" in cpu_args and "num_slices=2" in cpu_args


def test_named_model_uses_model_name():
    p = plan.make_plan(config.load_profile("gke-v6e-16x2-seed"))
    args = dict(a.split("=", 1) for a in p.stages[0].maxtext_args)
    assert args["model_name"] == "llama3-8b" and "base_emb_dim" not in args


def test_worker_command_per_hardware():
    p = local_plan()
    stage = p.stages[1]
    command, tpu_args = worker_command(p, stage, "tpu")
    assert command == ["python", "-m", "multislice.trainer.worker"]
    assert tpu_args[0] == "--" and tpu_args[1:] == stage.maxtext_args
    _, cpu_args = worker_command(p, stage, "cpu")
    assert cpu_args[:3] == ["--emulate-slices", "--distributed-timeout=900", "--"]  # timeouts.collectives, local
    assert cpu_args[-2:] == ["hardware=cpu", "num_slices=2"]


def test_plan_round_trips_through_json():
    p = local_plan()
    assert plan.Plan.from_json(p.to_json()) == p


def test_the_elastic_example_profile_plans_its_stage_on_two_slices_and_on_one_with_the_same_batch():
    from multislice.backends import manifests
    from multislice.render import jobset

    spec = config.load_profile("elastic", {"output_dir": "/data/out"})
    assert (spec.backend, spec.num_slices, spec.tpu_type) == ("local", 2, "v5litepod-8")
    made = plan.make_plan(spec)
    [stage] = made.stages
    assert spec.stages[0].elastic.min_slices == 1 and stage.steps > 3 * stage.checkpoint_period
    two, one = (stage.on_slices(n) for n in (2, 1))
    assert (two.runnable, two.gradient_accumulation_steps, two.dcn["data"]) == (True, 1, 2)
    assert (one.runnable, one.gradient_accumulation_steps, one.dcn["data"]) == (True, 2, 1)
    assert one.global_batch_size == two.global_batch_size == stage.global_batch_size
    assert "gradient_accumulation_steps=2" in one.maxtext_args
    # On the local corpus: grain's elastic iterator on every slice count (its position restores on any host
    # count), which MaxText allows unpacked only
    for count in (two, one):
        assert {"grain_use_elastic_iterator=true", "packing=false", "use_truncation=true"} <= set(count.maxtext_args)
    assert not any(a.startswith("grain_packing_type=") for a in stage.maxtext_args)
    # Every manifest validates, and the JobSet a shrink submits has one slice of the same hosts.
    assert manifests.render_all(made, "elastic-example")
    smaller_plan, smaller_stage = made.on_slices(stage, 1)
    shrunk = jobset.render_jobset(smaller_plan, smaller_stage, hardware="cpu", pipeline_run_id="elastic-example")
    [replicated] = shrunk["spec"]["replicatedJobs"]
    assert replicated["replicas"] == 1 and replicated["template"]["spec"]["parallelism"] == made.slice.hosts


def test_the_plan_step_says_when_a_checkpoint_period_follows_the_pipelines_steps(tmp_path, capsys):
    from multislice.steps import plan as plan_step

    # As the compiled pipeline's plan task passes a stage's steps parameter (components/plan.py).
    parameters = {"output_dir": str(tmp_path), "stages.tiny-8b-recipe.steps": 4}
    made = plan_step.run(config.read_profile("local"), parameters, "tiny-8b-recipe", "")
    assert (made.stage("tiny-8b-recipe").steps, made.stage("tiny-8b-recipe").checkpoint_period) == (4, 4)
    out = capsys.readouterr().out
    assert "stage 1 tiny-8b-recipe: checkpoint_period follows steps=4 (the profile's 5 exceeds it" in out
