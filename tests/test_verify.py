"""Checkpoint verifier: passes the pipeline's real checkpoints, and fails broken or mismatched ones."""

import json
import shutil
import subprocess
import sys

import pytest

from multislice.trainer.verify import _devices, choose_samples, logged_losses
from tests.conftest import ROOT, run_in_trainer

VERIFY = "import sys; from multislice.trainer.verify import main; sys.exit(main())"


def verify(trainer_python, checkpoint_dir, expected_step, args, *options):
    done = run_in_trainer(
        trainer_python, VERIFY, "--checkpoint-dir", str(checkpoint_dir), "--expected-step", str(expected_step),
        *options, "--", *args,
    )  # fmt: skip
    return done.returncode, json.loads(done.stdout)


@pytest.fixture
def stage_copy(local_runs, tmp_path):
    """A copy of stage 1's checkpoints from the synthetic-data run beside the end-to-end run, safe to break.

    Synthetic data: the functional checks replay the logged loss on MaxText's synthetic batch.
    """
    stage = local_runs[1].plan.stages[0]
    target = tmp_path / "checkpoints"
    shutil.copytree(stage.checkpoint_dir, target)
    return stage, target


def failed_checks(report):
    return {c["name"] for c in report["checks"] if not c["passed"]}


def detail(report, name):
    return next(c["detail"] for c in report["checks"] if c["name"] == name)


@pytest.mark.e2e
def test_real_checkpoint_passes_every_check(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    status, report = verify(trainer_python, checkpoints, stage.final_step, stage.maxtext_args)
    assert (status, report["verdict"]) == (0, "PASS"), report["checks"]
    assert [c["name"] for c in report["checks"]] == [
        "latest_step",
        "commit_markers",
        "metadata",
        "recorded_step",
        "params_tree",
        "parameter_count",
        "finite_arrays",
        "loss_replay",
        "final_loss",
    ]
    assert report["parameter_count"] == 2_098_432
    assert report["state_step"] == stage.steps
    # every array (parameters, Adam's mu and nu, counters, NNX rngs) restored: the checkpoint is small
    assert report["array_check"]["mode"] == "all"
    assert report["array_check"]["restored"] == report["array_check"]["arrays"] > 36
    # the functional check replays the newest checkpoint whose next step MaxText logged (15 -> step 16)
    replay = report["loss_replay"]
    assert (replay["checkpoint_step"], replay["logged_step"]) == (stage.final_step - 4, stage.final_step - 3)
    assert abs(replay["computed_loss"] - replay["logged_loss"]) <= replay["tolerance"]


@pytest.mark.e2e
def test_wrong_final_step_fails(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    status, report = verify(trainer_python, checkpoints, stage.final_step + 10, stage.maxtext_args)
    assert (status, report["verdict"]) == (1, "FAIL") and failed_checks(report) == {"latest_step"}


@pytest.mark.e2e
def test_uncommitted_checkpoint_fails(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    (checkpoints / str(stage.final_step) / "items" / "commit_success.txt").unlink()
    (checkpoints / f"{stage.final_step}.orbax-checkpoint-tmp-1").mkdir()
    status, report = verify(trainer_python, checkpoints, stage.final_step, stage.maxtext_args)
    assert status == 1 and failed_checks(report) == {"commit_markers"}
    assert "items commit_success.txt" in detail(report, "commit_markers")


@pytest.mark.e2e
def test_checkpoint_of_another_model_fails(trainer_python, stage_copy):
    stage, checkpoints = stage_copy
    args = [a if not a.startswith("base_mlp_dim=") else "base_mlp_dim=512" for a in stage.maxtext_args]
    status, report = verify(trainer_python, checkpoints, stage.final_step, args)
    assert status == 1 and failed_checks(report) == {"params_tree", "parameter_count", "loss_replay"}
    assert "mlp/wi_0/kernel: expected (256, 2, 512)" in detail(report, "params_tree")


@pytest.mark.e2e
def test_cli_finds_the_plan_from_the_checkpoint_path(local_run):
    stage = local_run.plan.stages[1]
    done = subprocess.run(
        [sys.executable, "-m", "multislice.cli", "verify-checkpoint", stage.checkpoint_dir],
        capture_output=True, text=True, cwd=ROOT,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict: PASS" in done.stdout and "PASS params_tree" in done.stdout


def test_sample_choice_takes_all_that_fit_or_spreads_over_the_tree():
    sizes = {f"p{i}": 10 for i in range(16)}
    assert choose_samples(sizes, 1000) == sorted(sizes)
    chosen = choose_samples(sizes | {"huge": 10_000}, 60)
    assert "huge" not in chosen and 0 < len(chosen) <= 6
    assert len({name[:2] for name in chosen}) > 1


def test_devices_of_a_stage_come_from_its_ici_and_dcn_parallelism():
    # the synthetic batch has per_device_batch_size x devices rows; a -1 (fill in) leaves it unknown
    assert _devices(["ici_fsdp_parallelism=4", "ici_tensor_parallelism=2", "dcn_data_parallelism=2", "steps=20"]) == 16
    assert _devices(["ici_fsdp_parallelism=-1", "dcn_data_parallelism=2"]) is None


def test_logged_losses_fall_back_to_the_metrics_lines_and_their_rounding(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 15.0, "learning/loss": 7.149}\n{"step": 16.0, "learning/loss": 7.143}\n')
    assert logged_losses(metrics, tmp_path / "no-tensorboard") == ({15: 7.149, 16: 7.143}, str(metrics), 5e-4)
    assert logged_losses(tmp_path / "absent.jsonl", None)[0] == {}


def test_steps_tensorboard_lacks_are_taken_from_the_metrics_lines(tmp_path, monkeypatch):
    """An elastic resize stops a JobSet right after a checkpoint: its last steps are in the log, not in TensorBoard."""
    from multislice.trainer import verify

    board = tmp_path / "tensorboard" / "stage"
    board.mkdir(parents=True)
    (board / "events.out.tfevents.1").write_bytes(b"")
    monkeypatch.setattr(verify, "_tensorboard_losses", lambda data: {10: 7.25, 11: 7.2412345})
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(f'{{"step": {s}, "learning/loss": {7.3 - s / 100:.3f}}}\n' for s in range(8, 12)))
    losses, source, rounding = logged_losses(metrics, tmp_path / "tensorboard")
    assert losses == {8: 7.22, 9: 7.21, 10: 7.25, 11: 7.2412345}  # TensorBoard's where it has them
    assert "steps it lacks from" in source and rounding == 5e-4
    metrics.write_text('{"step": 10, "learning/loss": 7.25}\n')
    assert logged_losses(metrics, tmp_path / "tensorboard") == (
        {10: 7.25, 11: 7.2412345},
        str(tmp_path / "tensorboard"),
        0.0,
    )


def test_checkpoint_dir_keeps_a_cloud_storage_url(trainer_python):
    # pathlib would make gs://bucket/x into gs:/bucket/x; the verifier Job on GKE reads gs:// checkpoints.
    script = (
        "from multislice.trainer.verify import checkpoint_path as p; print(p('gs://b/runs/ckpt') / '19', p('/tmp'))"
    )
    done = run_in_trainer(trainer_python, script)
    assert done.stdout.split() == ["gs://b/runs/ckpt/19", "/tmp"], done.stderr


# Rewrites a step's items with Orbax after changing one array: NaN in it, or one bit flipped in its first value.
REWRITE = """
import shutil, sys
from pathlib import Path
import jax, numpy as np, orbax.checkpoint as ocp
items, target, how = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
tree = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
args = jax.tree_util.tree_map(
    lambda m: ocp.ArrayRestoreArgs(sharding=device, global_shape=m.shape, dtype=m.dtype), tree
)
state = ocp.PyTreeCheckpointer().restore(items, args=ocp.args.PyTreeRestore(item=tree, restore_args=args))
def damage(path, leaf):
    if '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path) != target:
        return leaf
    values = np.array(leaf)
    if how == 'nan':
        values.flat[0] = np.nan
    else:  # flip bit 30 of the first float32: a finite value 2**128 times larger
        values.view(np.uint32).flat[0] ^= np.uint32(1 << 30)
        assert np.isfinite(values).all()
    return jax.device_put(values, device)
state = jax.tree_util.tree_map_with_path(damage, state)
fresh = items.with_name('items.rewritten')
ocp.PyTreeCheckpointer().save(fresh, args=ocp.args.PyTreeSave(state))
shutil.rmtree(items)
fresh.rename(items)
"""


#: Bytes overwritten with 0xFF in the middle of each array data file: a damaged disk block or a torn write.
#: Where the file stores the values raw (zstd keeps incompressible float data as raw blocks), any aligned
#: float32 or bfloat16 of 0xFF bytes is NaN; where it stores them compressed, the block breaks decompression.
#: A single flipped bit is not a fair case: in a mantissa it changes a value by less than training noise, and
#: which array sits in the middle of a file depends on how the processes' writes were chunked.
DAMAGED_BLOCK = 512


def damage_a_block_in_every_array_file(trainer_python, final):
    for data in sorted(final.glob("items/ocdbt.process_*/d/*")):
        raw = bytearray(data.read_bytes())
        middle = len(raw) // 2
        raw[middle : middle + DAMAGED_BLOCK] = b"\xff" * len(raw[middle : middle + DAMAGED_BLOCK])
        data.write_bytes(bytes(raw))


def nan_in_the_optimizer_state(trainer_python, final):
    target = "opt_state/0/nu/params/decoder/logits_dense/kernel"
    done = run_in_trainer(trainer_python, REWRITE, str(final / "items"), target, "nan")
    assert done.returncode == 0, done.stderr[-2000:]


def delete_the_array_metadata(trainer_python, final):
    shutil.rmtree(final / "items" / "array_metadatas")


def rename_a_stale_step_to_the_final_one(trainer_python, final):
    stale = final.with_name(str(int(final.name) - 4))
    shutil.rmtree(final)
    stale.rename(final)


def an_unexpected_layout(trainer_python, final):
    (final / "items").rename(final / "default")  # e.g. a checkpoint whose item is not named "items"


DAMAGE = {
    # a damaged block in each of the final step's array data files (OCDBT): the values it held read as NaN,
    # or cannot be decompressed; whichever arrays the files hold, the array check finds it.
    "damaged block in every array file": (
        damage_a_block_in_every_array_file,
        {"finite_arrays": ("non-finite: [", "unreadable: [")},
    ),
    "NaN in the optimizer state": (
        nan_in_the_optimizer_state,
        {"finite_arrays": "non-finite: ['opt_state/0/nu/params/decoder/logits_dense/kernel (1 of 262144 values"},
    ),
    "array metadata deleted": (delete_the_array_metadata, {"metadata": "no array_metadatas/process_*"}),
    "stale step renamed to the final one": (
        rename_a_stale_step_to_the_final_one,
        {"recorded_step": "directory 19 holds the state after step 15 (TrainState step 16)"},
    ),
    "unexpected layout": (an_unexpected_layout, {"metadata": "no items directory (found ["}),
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_fails_with_the_reason(trainer_python, stage_copy, case):
    stage, checkpoints = stage_copy
    damage, reasons = DAMAGE[case]  # the check(s) that must catch it, and what each says
    assert stage.final_step == 19 and stage.checkpoint_period == 5  # the steps the cases name
    damage(trainer_python, checkpoints / str(stage.final_step))
    status, report = verify(trainer_python, checkpoints, stage.final_step, stage.maxtext_args)
    assert (status, report["verdict"]) == (1, "FAIL"), report
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    caught = [
        check
        for check, reason in reasons.items()
        if check in failed and any(r in failed[check] for r in ((reason,) if isinstance(reason, str) else reason))
    ]
    assert caught, report["checks"]
    assert all(str(stage.final_step) in failed[check] for check in caught)  # what is wrong, and where


@pytest.mark.e2e
def test_the_loss_check_finds_a_flipped_bit_the_sampled_arrays_miss(trainer_python, stage_copy):
    # A large checkpoint's arrays are only sampled; force that with a zero full-check size and a
    # sample too small for the damaged array. Bit 30 of one weight makes it 2**128 times larger,
    # still finite: only the final checkpoint's loss shows it.
    stage, checkpoints = stage_copy
    target = "params/params/decoder/layers/mlp/wo/kernel"
    done = run_in_trainer(trainer_python, REWRITE, str(checkpoints / str(stage.final_step) / "items"), target, "bit")
    assert done.returncode == 0, done.stderr[-2000:]
    options = ("--full-check-bytes", "0", "--sample-bytes", str(2**20))
    status, report = verify(trainer_python, checkpoints, stage.final_step, stage.maxtext_args, *options)
    assert report["array_check"]["mode"] == "sample" and target not in report["array_check"]["checked"]
    assert status == 1 and failed_checks(report) == {"final_loss"}, report["checks"]
