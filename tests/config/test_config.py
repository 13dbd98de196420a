"""Run spec validation: every bad field is named with its fix, before anything starts."""

import subprocess
import sys

import pytest
import yaml

from multislice import config
from tests.conftest import ROOT


def issues(overrides, profile="local"):
    with pytest.raises(config.ConfigError) as caught:
        config.load_profile(profile, overrides)
    return caught.value.issues


@pytest.mark.parametrize("profile", ["local", "local-synthetic", "gke-v6e-16x2-seed"])
def test_profiles_are_valid(profile):
    spec = config.load_profile(profile)
    assert len(spec.stages) == 2
    assert spec.num_slices == 2


def test_gke_profile_holds_the_seed_8b_stage_a_70b_stage_that_fits_and_the_seed_70b_as_an_example():
    spec = config.load_profile("gke-v6e-16x2-seed")
    eight, seventy = spec.stages
    assert (eight.model.name, eight.per_device_batch_size, eight.max_target_length) == ("llama3-8b", 4, 4096)
    assert eight.ici == {"fsdp": 4, "tensor": 4}
    # The seed 70B recipe at per-device batch 1 with AdamW moments in host memory: preflight says it fits.
    assert (seventy.model.name, seventy.per_device_batch_size, seventy.remat_policy) == ("llama3-70b", 1, "full")
    assert seventy.ici == {"tensor": 4, "fsdp": 4} and seventy.dcn == {"fsdp": 2, "data": 1}
    assert seventy.maxtext_overrides == {"optimizer_memory_host_offload": True}
    [seed] = spec.example_stages
    assert (seed.name, seed.per_device_batch_size, seed.ici, seed.dcn) == (
        "seed-llama3-70b",
        2,
        {"tensor": 4, "fsdp": 4},
        {"fsdp": 2, "data": 1},
    )
    assert spec.stage("seed-llama3-70b") == seed and seed not in spec.stages


def test_local_stages_do_not_claim_8b_or_70b_models():
    spec = config.load_profile("local")
    for stage in spec.stages:
        assert stage.model.name is None, "local stages use explicit tiny dims"
        assert stage.model.emb_dim <= 512 and stage.model.num_decoder_layers <= 4
        assert stage.name.startswith("tiny-")
        assert (stage.model.decoder_block, stage.model.mlp_activations) == ("llama2", ("silu", "linear"))
        assert stage.model.num_kv_heads < stage.model.num_query_heads  # grouped-query attention
        assert stage.model.rope_max_timescale == 500_000


def test_ici_product_must_equal_chips_per_slice():
    [(field, message)] = issues({"stages.0.ici.fsdp": 2})
    assert field == "stages[0] (tiny-8b-recipe).ici"
    assert "multiplies to 4" in message and "8 chips per v5litepod-8 slice" in message and "-1" in message


def test_dcn_product_must_equal_slices():
    [(field, message)] = issues({"num_slices": 4})
    assert field == "stages[1] (tiny-70b-recipe).dcn"
    assert "multiplies to 2" in message and "4 slices" in message


def test_one_slice_says_which_dcn_axes_to_set_to_one():
    [(field, message)] = issues({"num_slices": 1})
    assert field == "stages[1] (tiny-70b-recipe).dcn"
    assert message.endswith("one slice has no DCN axis: --set stages.1.dcn.fsdp=1")
    assert config.load_profile("local", {"num_slices": 1, "stages.1.dcn.fsdp": 1}).num_slices == 1  # it is enough


def test_fill_axis_must_divide():
    [(field, message)] = issues({"stages.0.ici": {"fsdp": -1, "tensor": 3}})
    assert field.endswith(".ici") and "does not divide 8" in message


def test_run_name_too_long_for_pod_names():
    [(field, message)] = issues({"run_name": "r" * 70})
    assert field == "run_name"
    assert "63" in message and "at most 31" in message


def test_run_name_must_be_dns_1035():
    [(field, message)] = issues({"run_name": "My_Run"})
    assert field == "run_name" and "DNS-1035" in message


def test_unknown_tpu_type():
    [(field, message)] = issues({"tpu_type": "v7q-16"})
    assert field == "tpu_type" and "v6e-16" in message


def test_unknown_model_name_and_both_name_and_dims():
    [(field, message)] = issues({"stages.0.model": {"name": "llama3-9b"}})
    assert field == "stages[0] (tiny-8b-recipe).model" and "llama3-8b" in message
    [(field, message)] = issues({"stages.0.model.name": "llama3-8b"})
    assert "either a MaxText model name or explicit dims" in message


def test_misspelled_field_and_nonpositive_steps():
    found = dict(issues({"stages.tiny-70b-recipe.stepz": 5, "stage1_steps": 0}))
    assert "stages[1] (tiny-70b-recipe).stepz" in found
    assert "greater than 0" in found["stages[0] (tiny-8b-recipe).steps"]


def test_gke_needs_cloud_storage_and_local_needs_a_path():
    [(field, message)] = issues({"output_dir": "/tmp/out"}, profile="gke-v6e-16x2-seed")
    assert field == "output_dir" and "gs://" in message
    [(field, _)] = issues({"output_dir": "gs://bucket/x"})
    assert field == "output_dir"


def test_managed_maxtext_keys_cannot_be_overridden():
    [(field, message)] = issues({"stages.0.maxtext_overrides": {"steps": 3}})
    assert field.endswith("maxtext_overrides") and "steps" in message


def test_parameter_names_and_paths_reach_the_same_field():
    by_param = config.load_profile("local", {"stage2_steps": 7, "trainer_image": "img:1", "num_slices": 2})
    by_path = config.load_profile("local", {"stages.1.steps": 7, "images.trainer": "img:1"})
    by_name = config.load_profile("local", {"stages.tiny-70b-recipe.steps": 7, "images.trainer": "img:1"})
    assert by_param == by_path == by_name
    assert by_param.stages[1].steps == 7


def test_an_override_of_one_stage_leaves_a_stage_sharing_its_yaml_alias_alone():
    # configs/local.yaml gives both stages `maxtext_overrides: *local_maxtext` (one object once loaded)
    spec = config.load_profile("local", {"stages.tiny-8b-recipe.maxtext_overrides.lr_schedule_type": "wsd"})
    assert spec.stages[0].maxtext_overrides["lr_schedule_type"] == "wsd"
    assert "lr_schedule_type" not in spec.stages[1].maxtext_overrides
    assert spec.stages[1].maxtext_overrides["learning_rate"] == spec.stages[0].maxtext_overrides["learning_rate"]


def test_unknown_stage_in_override():
    [(field, message)] = issues({"stages.9.steps": 3})
    assert field == "stages.9.steps" and "tiny-8b-recipe" in message


def test_set_arguments_parse_yaml_scalars():
    parsed = config.parse_set_arguments(["num_slices=4", "run_name=abc", "x=[1,2]"])
    assert parsed["num_slices"] == 4 and parsed["run_name"] == "abc" and parsed["x"] == [1, 2]
    with pytest.raises(config.ConfigError) as refused:  # one --set sets one field: the fix gives the dotted keys
        config.parse_set_arguments(["stages.0.ici={fsdp: 8, tensor: 1}"])
    assert "--set stages.0.ici.fsdp=8 --set stages.0.ici.tensor=1" in str(refused.value)
    with pytest.raises(config.ConfigError):
        config.parse_set_arguments(["no-equals-sign"])


def test_spec_round_trips_through_plain_data():
    spec = config.load_profile("gke-v6e-16x2-seed")
    assert config.load_spec(config.spec_to_data(spec)) == spec


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ("stages.0.ici.fsdp=3", "ici"),
        ("run_name=" + "r" * 70, "run_name"),
        ("tpu_type=v6e-17", "tpu_type"),
    ],
)
def test_cli_rejects_bad_config_and_starts_nothing(tmp_path, override, field):
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "run", "--profile", "local", "--set", override,
         "--set", f"output_dir={tmp_path / 'out'}"],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert field in done.stderr and "nothing was created or started" in done.stderr
    assert not (tmp_path / "out").exists()


def test_model_presets_are_files_over_which_a_stage_sets_its_own_keys():
    spec = config.load_profile("local")
    tiny = yaml.safe_load((config.PROFILES_DIR / "models" / "llama3-tiny.yaml").read_text())
    eight, seventy = (s.model for s in spec.stages)
    assert eight.decoder_block == seventy.decoder_block == tiny["decoder_block"] == "llama2"
    assert (eight.num_decoder_layers, seventy.num_decoder_layers) == (2, 4)  # the stage's key wins
    assert "about 16.7M parameters" in seventy.label
    deeper = config.load_profile("local", {"stages.1.model.num_decoder_layers": 6})
    assert deeper.stages[1].model.num_decoder_layers == 6 and deeper.stages[1].model.emb_dim == 64
    # The loaded spec holds the dims, not the preset's name: a compiled pipeline needs no preset file.
    assert "preset" not in config.spec_to_data(spec)["stages"][0]["model"]
    assert config.load_spec(config.spec_to_data(spec)) == spec


def test_an_unknown_model_preset_names_the_known_ones():
    with pytest.raises(config.ConfigError, match=r"stages\[0\] \(tiny-8b-recipe\).model.preset: no model preset "
                                                 r"'llama9'; known presets: llama3-tiny"):  # fmt: skip
        config.load_profile("local", {"stages.0.model.preset": "llama9"})


def test_fewer_steps_than_the_checkpoint_period_lower_the_period_unless_it_was_set():
    profile = config.read_profile("local")
    assert profile["stages"][0]["checkpoint_period"] == 5  # what a short run used to be refused by
    for key in ("stage1_steps", "stages.0.steps", "stages.tiny-8b-recipe.steps"):
        spec = config.load_spec(profile, {key: 4})
        assert (spec.stages[0].steps, spec.stages[0].checkpoint_period) == (4, 4)
        assert spec.stages[1].checkpoint_period == 5  # the other stage keeps the profile's
    [followed] = config.followed_checkpoint_periods(profile, {"stage1_steps": 4})
    assert (followed.index, followed.steps, followed.profile_period) == (0, 4, 5)
    assert "checkpoint_period follows steps=4" in followed.describe()
    assert "stages.0.checkpoint_period" in followed.describe()
    # More steps than the period: nothing follows; a period given with the steps is checked as given.
    assert config.followed_checkpoint_periods(profile, {"stage1_steps": 40}) == []
    assert config.load_spec(profile, {"stage1_steps": 40}).stages[0].checkpoint_period == 5
    [(field, message)] = issues({"stage1_steps": 4, "stages.0.checkpoint_period": 5})
    assert field == "stages[0] (tiny-8b-recipe).checkpoint_period" and "make it at most steps" in message
    chosen = config.load_spec(profile, {"stage1_steps": 4, "stages.0.checkpoint_period": 2})
    assert chosen.stages[0].checkpoint_period == 2


@pytest.mark.parametrize("profile, output_dir", [("local", "/data/out"), ("gke-v6e-16x2-seed", "gs://bucket/runs")])
def test_a_profile_that_went_through_kfp_plans_as_the_cli_plans_it(profile, output_dir):
    """The plan task's ``profile`` is a dict parameter, which KFP stores as a protobuf Struct
    (``to_protobuf_value``, the compiler's own): every number comes back a float, ``grain_worker_count: 0.0`` in the
    compiled YAML. The spec gives MaxText's integer keys (and whole libtpu flag values) their ints back, so a
    pipeline's plan is the CLI's: same spec, same MaxText arguments (in the Struct's key order)."""
    import json

    from google.protobuf import json_format
    from kfp.compiler.pipeline_spec_builder import to_protobuf_value

    from multislice.plan import make_plan

    data = config.read_profile(profile)
    data["libtpu_flags"] = {"add": {"xla_tpu_scoped_vmem_limit_kib": 81920}}
    data["stages"][0]["maxtext_overrides"] = {"grain_worker_count": 0, "learning_rate": 3.0e-3, "compress_ratios": [4]}
    through = json_format.MessageToDict(to_protobuf_value(data))
    sent = through["stages"][0]["maxtext_overrides"]
    assert sent == {"grain_worker_count": 0.0, "learning_rate": 0.003, "compress_ratios": [4.0]}  # what KFP sends
    assert isinstance(sent["grain_worker_count"], float) and isinstance(sent["compress_ratios"][0], float)
    cli, kfp = (make_plan(config.load_spec(d, {"output_dir": output_dir})) for d in (data, through))
    assert json.dumps(kfp.spec.model_dump(mode="json"), sort_keys=True) == json.dumps(
        cli.spec.model_dump(mode="json"), sort_keys=True
    )
    for ours, theirs in zip(kfp.stages, cli.stages, strict=True):
        assert sorted(ours.maxtext_args) == sorted(theirs.maxtext_args)
        assert sorted(ours.libtpu_flags.items()) == sorted(theirs.libtpu_flags.items())
    assert {"grain_worker_count=0", "learning_rate=0.003", "compress_ratios=[4]"} <= set(kfp.stages[0].maxtext_args)
    assert kfp.spec.libtpu_flags.add["xla_tpu_scoped_vmem_limit_kib"] == 81920


def emergency(**more):
    """Overrides: the GKE profile's 8B stage with emergency checkpoints (elastic removed: they exclude each other).
    A new dict each call: applying overrides fills their nested values in."""
    return {"stages.0.elastic": None, "stages.0.emergency_checkpoint": {"local_period": 10}, **more}


def test_emergency_checkpoints_plan_maxtexts_keys_with_the_persistent_period_unchanged():
    from multislice.plan import make_plan

    spec = config.load_profile("gke-v6e-16x2-seed", emergency())
    stage = make_plan(spec).stages[0]
    periods = (stage.local_checkpoint_period, stage.checkpoint_period)
    assert (stage.local_checkpoint_directory, periods) == ("/local", (10, 50))
    args = dict(arg.split("=", 1) for arg in stage.maxtext_args)
    assert (args["enable_emergency_checkpoint"], args["local_checkpoint_period"], args["checkpoint_period"]) == (
        "true",
        "10",
        "50",
    )
    assert args["mesh_axes"].startswith("[data,diloco,")  # Orbax's replica axis (the first) is the data axis
    other = make_plan(spec).stages[1]  # the 70B stage, one data-parallel replica: multi-tier, no emergency manager
    assert other.local_checkpoint_directory == "/local" and not any("emergency" in a for a in other.maxtext_args)
    off = config.load_profile("gke-v6e-16x2-seed", emergency(**{"stages.0.emergency_checkpoint.enabled": False}))
    assert not any("emergency" in a for a in make_plan(off).stages[0].maxtext_args)


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        (
            {"stages.0.maxtext_overrides": {"enable_multi_tier_checkpointing": True}},
            "stages[0] (llama3-8b).maxtext_overrides",
            "sets MaxText's local-tier keys itself",
        ),
        ({"stages.0.maxtext_overrides": {"local_checkpoint_period": 5}}, "maxtext_overrides", "stage's own fields"),
        ({"stages.0.emergency_checkpoint.local_directory": "local"}, "local_directory", "absolute path"),
        ({"stages.0.emergency_checkpoint.local_directory": "/dev/shm"}, "local_directory", "hide the container"),
    ],
)
def test_emergency_checkpoint_settings_the_plan_cannot_use_are_refused(overrides, field, words):
    found = issues(emergency(**overrides), profile="gke-v6e-16x2-seed")
    assert any(f.endswith(field) or field in f for f, _ in found), found
    assert any(words in message for _, message in found), found


@pytest.mark.parametrize(
    ("overrides", "words"),
    [
        ({"backend": "local", "output_dir": "/tmp/out"}, "the local backend has none (to have them: use backend gke)"),
        ({"stages.0.launcher": "ray"}, "launcher jobset only"),
        ({"stages.0.data": {"kind": "grain", "train_files": "gs://b/shard-*"}}, "not the grain data iterator"),
        ({"stages.0.steps": 4}, "local_period (10) is not fewer steps than checkpoint_period (4"),
    ],
)
def test_a_run_parameter_that_rules_the_local_tier_out_leaves_it_out_and_the_plan_says_why(overrides, words):
    """Backend, launcher and data can be run parameters: a profile with emergency checkpoints still runs with any of
    them, without the local tier, and the plan's note (printed by `multislice render`) says why."""
    from multislice.plan import make_plan, restore_notes

    plan = make_plan(config.load_profile("gke-v6e-16x2-seed", emergency(**overrides)))
    stage = plan.stages[0]
    assert stage.local_checkpoint_directory is None
    assert not [a for a in stage.maxtext_args if a.startswith(("enable_emergency", "enable_multi_tier", "local_"))]
    note = restore_notes(plan)[0]
    assert "emergency_checkpoint is set but left out" in note and words in note, note


def test_one_replica_and_elastic_stages_get_multi_tier_checkpoints_with_the_replicas_of_each_slice_count():
    """FSDP over DCN (one data-parallel replica) and an elastic stage: MaxText's multi-tier checkpointing, which the
    worker extends with the persistent tier (multislice.trainer.tiered_checkpoint); mtc_data_parallelism is each
    slice count's replicas, and GKE's replicator never backs up on its own."""
    from multislice.plan import MULTI_TIER_BACKUP_INTERVAL_MINUTES, make_plan

    spec = config.load_profile(
        "gke-v6e-16x2-seed",
        {
            "stages.0.emergency_checkpoint": {"local_period": 10},  # elastic, min_slices 1
            "stages.1.emergency_checkpoint": {"local_period": 5},  # dcn fsdp 2, data 1
        },
    )
    eight, seventy = make_plan(spec).stages

    def keys(maxtext_args):
        return {k: v for k, v in (a.split("=", 1) for a in maxtext_args) if "tier" in k or "local_" in k or "mtc" in k}

    expected = {
        "enable_multi_tier_checkpointing": "true",
        "local_checkpoint_directory": "/local",
        "local_checkpoint_period": "5",
        "multi_tier_checkpointing_backup_interval_minutes": str(MULTI_TIER_BACKUP_INTERVAL_MINUTES),
        "mtc_data_parallelism": "1",
    }
    assert keys(seventy.maxtext_args) == expected
    assert not any(a.startswith(("enable_emergency_checkpoint=", "mesh_axes=")) for a in seventy.maxtext_args)
    by_slices = {count.slices: keys(count.maxtext_args)["mtc_data_parallelism"] for count in eight.elastic}
    assert by_slices == {2: "2", 1: "1"}
    assert keys(eight.maxtext_args)["local_checkpoint_period"] == "10"


def test_the_plan_says_what_each_stage_restores_from():
    from multislice.plan import make_plan, restore_notes

    on = config.load_profile(
        "gke-v6e-16x2-seed",
        {"stages.0.emergency_checkpoint": {"local_period": 10}, "stages.1.emergency_checkpoint": {"local_period": 5}},
    )
    eight, seventy = restore_notes(make_plan(on))
    assert "every 10 steps" in eight and "its peer in another slice" in eight and "every 50 steps)" in eight
    assert "every 5 steps" in seventy and "no peer holds a replaced node's shards" in seventy
    off = config.load_profile("gke-v6e-16x2-seed", {"stages.0.emergency_checkpoint": None})
    assert "would add a local tier" in restore_notes(make_plan(off))[0]
    grain = config.load_profile(
        "gke-v6e-16x2-seed",
        {"stages.0.emergency_checkpoint": None, "stages.0.data": {"kind": "grain", "train_files": "gs://b/s-*"}},
    )
    assert "no emergency checkpoints: MaxText's emergency and multi-tier managers" in restore_notes(make_plan(grain))[0]


def test_a_ray_stage_on_gke_needs_a_cpu_node_pool_for_its_head():
    found = issues({"launcher": "ray", "ray.head_node_selector": {}}, profile="gke-v6e-16x2-seed")
    [(field, message)] = [issue for issue in found if issue[0] == "ray.head_node_selector"]
    assert "stage(s) llama3-8b, llama3-70b are launched by Ray" in message
    assert "cloud.google.com/gke-nodepool: cpu-pool" in message
    # A jobset run needs none; the profile names one, so launcher=ray from the run form is valid.
    config.load_profile("gke-v6e-16x2-seed", {"ray.head_node_selector": {}})
    assert config.load_profile("gke-v6e-16x2-seed", {"launcher": "ray"}).ray.head_node_selector == {
        "cloud.google.com/gke-nodepool": "cpu-pool"
    }
    [(field, message)] = issues({"ray.head_node_selector": {"cloud.google.com/gke-nodepool": "cpu pool"}},
                                profile="gke-v6e-16x2-seed")  # fmt: skip
    assert field == "ray.head_node_selector" and "label value 'cpu pool': at most 63 letters" in message


def test_ray_workers_claiming_dranet_devices_are_refused_on_the_host_network():
    """DRANET refuses a hostNetwork pod that claims a device (google/dranet pkg/driver/nri_hooks.go,
    runPodSandbox): a Ray stage on node pools with additional networks must keep its TPU workers off the host
    network. A JobSet stage claims nothing, so it keeps hostNetwork there."""
    dcn = [{"network": "dcn-net", "subnetwork": "dcn-sub"}]
    found = issues({"launcher": "ray", "node_pools.additional_node_networks": dcn}, profile="gke-v6e-16x2-seed")
    [(field, message)] = [issue for issue in found if issue[0] == "service_accounts.tpu_host_network"]
    assert "refuses to start a hostNetwork pod" in message and "service_accounts.tpu_host_network: false" in message
    assert "drop node_pools.additional_node_networks" in message
    off_host = {"launcher": "ray", "node_pools.additional_node_networks": dcn}
    off_host["service_accounts.tpu_host_network"] = False
    assert config.load_profile("gke-v6e-16x2-seed", off_host).service_accounts.tpu_host_network is False
    jobset = config.load_profile("gke-v6e-16x2-seed", {"node_pools.additional_node_networks": dcn})
    assert jobset.service_accounts.tpu_host_network is True
