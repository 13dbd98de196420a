"""Checkpoint verifier: passes the pipeline's real checkpoints, and fails broken or mismatched ones."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from multislice.trainer import digests
from multislice.trainer.verify import _devices, choose_samples, logged_losses, loss_checks
from tests.conftest import ROOT, run_in_trainer

# Runs the verifier once per request (JSON lines: name, argv) in one trainer process, so JAX, Orbax and MaxText
# are imported once for every case; writes one JSON line per request (name, exit status, report).
BATCH = """
import contextlib, io, json, sys
from multislice.trainer.verify import main
with open(sys.argv[1]) as requests, open(sys.argv[2], "w") as results:
    for line in requests:
        request = json.loads(line)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            status = main(request["argv"])
        results.write(json.dumps({"name": request["name"], "status": status, "report": json.loads(out.getvalue())}))
        results.write("\\n")
        results.flush()
"""


def failed_checks(report):
    return {c["name"] for c in report["checks"] if not c["passed"]}


def detail(report, name):
    return next(c["detail"] for c in report["checks"] if c["name"] == name)


def intact(trainer_python, stage, checkpoints):
    return stage.final_step, stage.maxtext_args, ()


def expecting_a_later_step(trainer_python, stage, checkpoints):
    return stage.final_step + 10, stage.maxtext_args, ()


def uncommitted(trainer_python, stage, checkpoints):
    (checkpoints / str(stage.final_step) / "items" / "commit_success.txt").unlink()
    (checkpoints / f"{stage.final_step}.orbax-checkpoint-tmp-1").mkdir()
    return stage.final_step, stage.maxtext_args, ()


def of_another_model(trainer_python, stage, checkpoints):
    return (
        stage.final_step,
        [a if not a.startswith("base_mlp_dim=") else "base_mlp_dim=512" for a in stage.maxtext_args],
        (),
    )


def a_weight_bit_flipped_and_arrays_only_sampled(trainer_python, stage, checkpoints):
    # A large checkpoint's arrays are only sampled; force that with a zero full-check size and a
    # sample too small for the damaged array. Bit 30 of one weight makes it 2**128 times larger,
    # still finite: only the final checkpoint's loss shows it.
    (checkpoints / str(stage.final_step) / digests.DIGEST_FILE).unlink()  # as one written before digests:
    (checkpoints / digests.LEDGER_FILE).unlink()  # no record, no ledger
    items = checkpoints / str(stage.final_step) / "items"
    done = run_in_trainer(trainer_python, REWRITE, str(items), SAMPLED_OUT, "bit")
    assert done.returncode == 0, done.stderr[-2000:]
    return stage.final_step, stage.maxtext_args, ("--full-check-bytes", "0", "--sample-bytes", str(2**20))


#: The weight the sampled-arrays case flips a bit of (left out of the sample).
SAMPLED_OUT = "params/params/decoder/layers/mlp/wo/kernel"


@pytest.fixture(scope="module")
def verdicts(trainer_python, local_runs, tmp_path_factory):
    """Every case's verifier report, from one trainer process: ``(stage, {case: (exit status, report)})``.

    Each case breaks (or not) its own copy of stage 1's checkpoints from the synthetic-data run beside the
    end-to-end run (synthetic data: the functional checks replay the logged loss on MaxText's synthetic batch).
    """
    stage = local_runs[1].plan.stages[0]
    root = tmp_path_factory.mktemp("verify")
    cases = {**PLAIN_CASES, **{case: _damaging(damage) for case, (damage, _) in DAMAGE.items()}}
    requests = []
    for number, (case, prepare) in enumerate(cases.items()):
        checkpoints = root / f"case-{number}" / "checkpoints"
        shutil.copytree(stage.checkpoint_dir, checkpoints)
        step, args, options = prepare(trainer_python, stage, checkpoints)
        argv = ["--checkpoint-dir", str(checkpoints), "--expected-step", str(step), *options, "--", *args]
        requests.append(json.dumps({"name": case, "argv": argv}) + "\n")
    (root / "requests.jsonl").write_text("".join(requests))
    done = run_in_trainer(
        trainer_python, BATCH, str(root / "requests.jsonl"), str(root / "results.jsonl"), timeout=1800
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    assert [r["name"] for r in results] == list(cases)
    return stage, {r["name"]: (r["status"], r["report"]) for r in results}


def _damaging(damage):
    def prepare(trainer_python, stage, checkpoints):
        damage(trainer_python, checkpoints / str(stage.final_step))
        return stage.final_step, stage.maxtext_args, ()

    return prepare


@pytest.mark.e2e
def test_real_checkpoint_passes_every_check(verdicts):
    stage, results = verdicts
    status, report = results["intact"]
    checkpoints = Path(report["checkpoint_dir"])
    assert (status, report["verdict"]) == (0, "PASS"), report["checks"]
    assert [c["name"] for c in report["checks"]] == [
        "latest_step",
        "commit_markers",
        "checksums",
        "metadata",
        "recorded_step",
        "params_tree",
        "parameter_count",
        "finite_arrays",
        "loss_replay",
        "final_loss",
    ]
    # the worker recorded the final step's digests at commit, with each chunk's own CRC-32C (a local path)
    assert report["checksums"]["recorded"] and report["checksums"]["chunk_digests"], report["checksums"]
    assert report["checksums"]["files"] > 10 and not report["checksums"]["damaged_arrays"]
    assert all((checkpoints / str(s) / digests.DIGEST_FILE).is_file() for s in report["all_steps"])
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
def test_wrong_final_step_fails(verdicts):
    status, report = verdicts[1]["expecting a later step"]
    assert (status, report["verdict"]) == (1, "FAIL") and failed_checks(report) == {"latest_step"}


@pytest.mark.e2e
def test_uncommitted_checkpoint_fails(verdicts):
    status, report = verdicts[1]["uncommitted"]
    assert status == 1 and failed_checks(report) == {"commit_markers", "checksums"}
    assert "items commit_success.txt" in detail(report, "commit_markers")
    assert "missing: items/commit_success.txt (Orbax's commit marker" in detail(report, "checksums")


@pytest.mark.e2e
def test_checkpoint_of_another_model_fails(verdicts):
    status, report = verdicts[1]["of another model"]
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


def test_a_loss_replay_that_cannot_run_is_skipped_not_passed(tmp_path):
    # A stage of real data (not synthetic): its batch cannot be rebuilt, so the replay does not run (issue 44).
    args = ["dataset_type=hf", "ici_fsdp_parallelism=4", "per_device_batch_size=1"]
    report: dict = {}
    [check] = loss_checks(tmp_path, [3], args, tmp_path / "metrics.txt", 1e-3, report)
    assert (check["name"], check["skipped"]) == ("loss_replay", True) and check["detail"].startswith("skipped: ")


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


# Flips one bit in the middle of a chunk of ``target`` in its OCDBT data file (located through the step's digest
# record) such that the array restores with exactly one value changed and every value finite: what no array or
# loss check can see. Positions are tried 997 bytes apart until one qualifies (where a chunk is compressed, a flip
# may break decoding instead); the first did, on the shared run's optimizer state.
FLIP = """
import json, sys
import numpy as np
from etils import epath
from multislice.trainer import digests, verify
items, target = epath.Path(sys.argv[1]), sys.argv[2]
record, _ = digests.read_record(items.parent)
tree, _ = verify._tree(items)
path = target.replace(".", "/")
before = verify.restore_arrays(items, tree, [path])[path]
file, offset, length, _ = next(c for c in record["arrays"][target] if c[1] is not None)
data = items.parent / file
original = data.read_bytes()
for tries, position in enumerate(range(offset + length // 2, offset + length, 997)):
    raw = bytearray(original)
    raw[position] ^= 0x01
    data.write_bytes(bytes(raw))
    try:
        after = verify.restore_arrays(items, tree, [path])[path]
    except Exception:
        continue
    if np.isfinite(after).all() and int((after != before).sum()) == 1:
        print(json.dumps({"position": position, "tries": tries + 1}))
        break
else:
    data.write_bytes(original)
    raise SystemExit("no single-bit flip kept the array finite")
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


def _largest_data_file(final):
    return max(final.glob("items/ocdbt.process_*/d/*"), key=lambda p: p.stat().st_size)


def xor_16_bytes_in_the_largest_data_file(trainer_python, final):
    data = _largest_data_file(final)
    raw = bytearray(data.read_bytes())
    for i in range(len(raw) // 2, len(raw) // 2 + 16):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))


def one_finite_bit_flip_in_the_optimizer_state(trainer_python, final):
    done = run_in_trainer(trainer_python, FLIP, str(final / "items"), FLIPPED.replace("/", "."))
    assert done.returncode == 0, done.stderr[-2000:]


def truncate_the_largest_data_file(trainer_python, final):
    data = _largest_data_file(final)
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 2])


def delete_the_largest_data_file(trainer_python, final):
    _largest_data_file(final).unlink()


def delete_the_ocdbt_manifest(trainer_python, final):
    (final / "items" / "manifest.ocdbt").unlink()


def garbage_tree_metadata(trainer_python, final):
    (final / "items" / "_METADATA").write_bytes(bytes(range(256)) * 8)


def truncate_a_data_file_of_a_checkpoint_without_digests(trainer_python, final):
    (final / digests.DIGEST_FILE).unlink()
    (final.parent / digests.LEDGER_FILE).unlink()  # as one written before digests: no ledger either
    truncate_the_largest_data_file(trainer_python, final)


def delete_the_digest_record(trainer_python, final):
    (final / digests.DIGEST_FILE).unlink()  # the directory's ledger stays: the record was ours


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
    # a checkpoint whose item is neither "items" nor the emergency manager's "default"
    (final / "items").rename(final / "state")


#: The array the finite bit flip changes: Adam's second moment, which no loss replay reads.
FLIPPED = "opt_state/0/nu/params/decoder/logits_dense/kernel"
DATA_FILE = "items/ocdbt.process_"  # the data files' directories: items/ocdbt.process_<i>/d/<id>

DAMAGE = {
    # a damaged block in each of the final step's array data files (OCDBT). The digests recorded at commit
    # always see it; the array check sees it when the block lands in a chunk it reads (the values read as NaN,
    # or do not decompress), which depends on where this run's chunks sit in the file: one CI run in ~20 had
    # the middle of every file outside them.
    "damaged block in every array file": (
        damage_a_block_in_every_array_file,
        {"finite_arrays": ("non-finite: [", "unreadable: ["), "checksums": ("content differs: " + DATA_FILE,)},
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
    # Issue 31: damage the digests recorded at commit catch, each named by file and array (the checksums check).
    "16 bytes XOR'd in the largest data file": (
        xor_16_bytes_in_the_largest_data_file,
        {"checksums": ("content differs: " + DATA_FILE, "the changed bytes are in ")},
    ),
    "one bit flipped, every value still finite": (
        one_finite_bit_flip_in_the_optimizer_state,
        {"checksums": ("content differs: " + DATA_FILE, f"the changed bytes are in {FLIPPED}")},
    ),
    "OCDBT manifest deleted": (
        delete_the_ocdbt_manifest,
        {"checksums": ("missing: items/manifest.ocdbt (the OCDBT manifest",)},
    ),
    "garbage tree metadata": (garbage_tree_metadata, {"checksums": ("garbage: items/_METADATA (the tree metadata)",)}),
    "truncated data file": (truncate_the_largest_data_file, {"checksums": ("truncated: " + DATA_FILE, "holding ")}),
    "deleted data file": (delete_the_largest_data_file, {"checksums": ("missing: " + DATA_FILE, "holding ")}),
    # issue 43: the record deleted from a checkpoint this project wrote (its ledger says so) no longer passes
    "digest record deleted": (
        delete_the_digest_record,
        {"checksums": (f"its digest record {digests.DIGEST_FILE} is missing", digests.LEDGER_FILE)},
    ),
    # a checkpoint from before digests: the OCDBT manifest's references are still checked
    "truncated data file, no digests": (
        truncate_a_data_file_of_a_checkpoint_without_digests,
        {"checksums": ("no digests recorded", "truncated: " + DATA_FILE, "the OCDBT manifest refers to")},
    ),
}
#: Cases only the digests (the checksums check) catch, or must name: every part of the reason must be there.
DIGEST_CASES = [case for case, (_, reasons) in DAMAGE.items() if list(reasons) == ["checksums"]]


#: Cases other than :data:`DAMAGE`'s, each verified in :func:`verdicts`'s batch.
PLAIN_CASES = {
    "intact": intact,
    "expecting a later step": expecting_a_later_step,
    "uncommitted": uncommitted,
    "of another model": of_another_model,
    "a weight bit flipped, arrays only sampled": a_weight_bit_flipped_and_arrays_only_sampled,
}


@pytest.mark.e2e
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_damaged_checkpoint_fails_with_the_reason(verdicts, case):
    stage, results = verdicts
    _, reasons = DAMAGE[case]  # the check(s) that must catch it, and what each says
    assert stage.final_step == 19 and stage.checkpoint_period == 5  # the steps the cases name
    status, report = results[case]
    assert (status, report["verdict"]) == (1, "FAIL"), report
    failed = {c["name"]: c["detail"] for c in report["checks"] if not c["passed"]}
    caught = [
        check
        for check, reason in reasons.items()
        if check in failed and any(r in failed[check] for r in ((reason,) if isinstance(reason, str) else reason))
    ]
    assert caught, report["checks"]
    assert all(str(stage.final_step) in failed[check] for check in caught)  # what is wrong, and where
    if case in DIGEST_CASES:  # the file's path and role, and the array(s): all of it said
        assert all(part in failed["checksums"] for part in reasons["checksums"]), failed["checksums"]
    if case == "one bit flipped, every value still finite":  # nothing but the digests sees it
        assert set(failed) == {"checksums"}, report["checks"]
    if case == "OCDBT manifest deleted":  # not blamed on the tree metadata
        assert "manifest.ocdbt (the OCDBT manifest" in failed["metadata"] and "_METADATA)" not in failed["metadata"]


@pytest.mark.e2e
def test_the_loss_check_finds_a_flipped_bit_the_sampled_arrays_miss(verdicts):
    status, report = verdicts[1]["a weight bit flipped, arrays only sampled"]
    assert report["array_check"]["mode"] == "sample" and SAMPLED_OUT not in report["array_check"]["checked"]
    assert status == 1 and failed_checks(report) == {"final_loss"}, report["checks"]


# A tiny Orbax checkpoint (an Orbax CheckpointManager with MaxText's item name, OCDBT and Zarr v3 as MaxText
# writes them), written in the trainer environment while a DigestRecorder watches the directory: seconds, no MaxText.
TINY = """
import json, sys
import jax, numpy as np, orbax.checkpoint as ocp
from etils import epath
from multislice.trainer import digests
directory = epath.Path(sys.argv[1])
recorder = digests.DigestRecorder(str(directory), poll_seconds=0.05, log=lambda line: None).start()
rng = np.random.default_rng(0)
state = {
    "params": {"params": {"w": rng.standard_normal((128, 64), np.float32), "b": np.ones(8, np.float32)}},
    "opt_state": [{"mu": {"params": {"w": rng.standard_normal((128, 64), np.float32)}}}],
    "step": np.asarray(3),
}
handler = ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)
with ocp.CheckpointManager(directory, item_names=("items",), item_handlers={"items": handler}) as manager:
    for step in (1, 2):
        manager.save(step, args=ocp.args.Composite(items=ocp.args.PyTreeSave(state)))
    manager.wait_until_finished()
(directory / "3.orbax-checkpoint-tmp-7" / "items").mkdir(parents=True)  # a save in progress
(directory / "4").mkdir()  # a step directory not (yet) committed
recorded = recorder.stop()
with ocp.CheckpointManager(directory, item_names=("items",)) as manager:  # Orbax ignores the records
    restored = manager.restore(2, args=ocp.args.Composite(items=ocp.args.PyTreeRestore()))
print(json.dumps({
    "recorded": recorded, "steps": sorted(manager.all_steps()),
    "restored_w": bool(np.array_equal(np.asarray(restored["items"]["params"]["params"]["w"]),
                                      state["params"]["params"]["w"])),
    "records": sorted(str(p.relative_to(directory)) for p in directory.glob("*/" + digests.DIGEST_FILE)),
}))
"""

# Damages step 2 of the tiny checkpoint one way, then prints the digest check's and the reference check's findings.
DAMAGE_TINY = """
import json, os, sys
from etils import epath
from multislice.trainer import digests
step_dir, how = epath.Path(sys.argv[1]), sys.argv[2]
record, _ = digests.read_record(step_dir)
w_file, offset, length, _ = next(c for c in record["arrays"]["params.params.w"] if c[1] is not None)
data = step_dir / w_file
raw = bytearray(data.read_bytes())
if how == "xor 16 bytes":
    for i in range(offset + length // 2, offset + length // 2 + 16):
        raw[i] ^= 0xFF
    data.write_bytes(bytes(raw))
elif how == "one bit":
    raw[offset + length // 2] ^= 0x01
    data.write_bytes(bytes(raw))
elif how == "truncated":
    data.write_bytes(bytes(raw[: offset + length // 2]))
elif how == "data file deleted":
    data.unlink()
elif how == "manifest deleted":
    (step_dir / "items" / "manifest.ocdbt").unlink()
elif how == "garbage _METADATA":
    (step_dir / "items" / "_METADATA").write_bytes(bytes(range(256)) * 4)
elif how == "record of another step":
    (step_dir / digests.DIGEST_FILE).write_text(json.dumps({**record, "step": 1}))
    record = {**record, "step": 1}
problems, evidence = digests.check(step_dir, record)
(step_dir / digests.DIGEST_FILE).unlink()  # as a checkpoint written before digests were recorded
print(json.dumps({"problems": problems, "evidence": evidence, "references": digests.reference_problems(step_dir)[0],
                  "w_file": w_file}))
"""


@pytest.fixture(scope="module")
def tiny_checkpoint(trainer_python, tmp_path_factory):
    """The tiny checkpoint's directory (steps 1 and 2 committed and recorded) and what TINY printed."""
    directory = tmp_path_factory.mktemp("tiny") / "checkpoints"
    done = run_in_trainer(trainer_python, TINY, str(directory), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return directory, json.loads(done.stdout.splitlines()[-1])


def test_the_leader_records_each_committed_step_and_orbax_still_reads_it(tiny_checkpoint):
    directory, result = tiny_checkpoint
    # the two committed steps, each once; neither the save in progress nor the uncommitted step 4
    assert result["recorded"] == [1, 2]
    assert result["records"] == [f"1/{digests.DIGEST_FILE}", f"2/{digests.DIGEST_FILE}"]
    assert {1, 2} <= set(result["steps"]) and result["restored_w"]
    record = json.loads((directory / "2" / digests.DIGEST_FILE).read_text())
    assert record["step"] == 2 and record["chunk_digests"] is True
    assert {"items/manifest.ocdbt", "items/_METADATA", "_CHECKPOINT_METADATA"} <= set(record["files"])
    on_disk = {str(p.relative_to(directory / "2")) for p in (directory / "2").rglob("*") if p.is_file()}
    assert set(record["files"]) == on_disk - {digests.DIGEST_FILE}
    # every array's chunks are located: w's in a data file with its own CRC-32C, small ones inline in a node
    w_chunks = [c for c in record["arrays"]["params.params.w"] if c[1] is not None]
    assert w_chunks and all(c[0].startswith("items/ocdbt.process_0/d/") and c[3] for c in w_chunks)
    assert set(record["arrays"]) == {"params.params.w", "params.params.b", "opt_state.0.mu.params.w", "step"}


DAMAGE_TINY_CASES = {
    # how -> (a problem line must contain these, with {w} the data file holding params/params/w)
    "xor 16 bytes": ["content differs: {w}", "the changed bytes are in params/params/w"],
    "one bit": ["content differs: {w}", "the changed bytes are in params/params/w"],
    "truncated": ["truncated: {w}", "OCDBT data file holding ", "params/params/w", " recorded"],
    "data file deleted": ["missing: {w}", "OCDBT data file holding ", "params/params/w", " recorded"],
    "manifest deleted": ["missing: items/manifest.ocdbt (the OCDBT manifest"],
    "garbage _METADATA": ["garbage: items/_METADATA (the tree metadata) is not JSON"],
    "record of another step": ["the digest record is of step 1, in directory 2"],
}


@pytest.mark.parametrize("how", list(DAMAGE_TINY_CASES))
def test_digests_name_the_damaged_file_and_array(trainer_python, tiny_checkpoint, tmp_path, how):
    directory, _ = tiny_checkpoint
    step_dir = tmp_path / "2"
    shutil.copytree(directory / "2", step_dir)
    done = run_in_trainer(trainer_python, DAMAGE_TINY, str(step_dir), how)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    wanted = [part.format(w=found["w_file"]) for part in DAMAGE_TINY_CASES[how]]
    assert any(all(part in line for part in wanted) for line in found["problems"]), found["problems"]
    if how in ("xor 16 bytes", "one bit"):  # exactly the array whose bytes changed, not its neighbour in the file
        assert found["evidence"]["damaged_arrays"] == ["params/params/w"]
    # without a record (a checkpoint from before), what the OCDBT manifest refers to is still checked
    expected_reference = {"truncated": "truncated: ", "data file deleted": "missing: ", "manifest deleted": "missing: "}
    if how in expected_reference:
        assert any(line.startswith(expected_reference[how]) for line in found["references"]), found["references"]
    elif how != "garbage _METADATA":
        assert found["references"] == []  # changed bytes need the digests


def test_an_intact_step_matches_its_record_and_a_stale_record_is_replaced(trainer_python, tiny_checkpoint, tmp_path):
    directory, _ = tiny_checkpoint
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp-*"))
    # step 2 deleted and saved again (an elastic discard, then a relaunch): step 1's record stands in for the
    # one a new commit would get; the recorder sees the record is not of this commit and writes a new one
    shutil.copy(copy / "1" / digests.DIGEST_FILE, copy / "2" / digests.DIGEST_FILE)
    script = """
import json, sys
from multislice.trainer import digests
directory = sys.argv[1]
intact = digests.check(directory + "/1", digests.read_record(directory + "/1")[0])
recorder = digests.DigestRecorder(directory, log=lambda line: None)
recorder.record_pending()
gone = digests.write_record(directory + "/9")  # a step deleted before its record was written
print(json.dumps({"intact": intact, "rerecorded": recorder.recorded, "gone": gone,
                  "now": digests.check(directory + "/2", digests.read_record(directory + "/2")[0])[0]}))
"""
    done = run_in_trainer(trainer_python, script, str(copy))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["intact"][0] == [] and found["intact"][1]["files"] > 10
    assert found["rerecorded"] == [2] and found["now"] == []
    assert found["gone"] is False and not (copy / "9").exists()  # never recreated


# Runs the verifier's checksums check on step 2 of a copy of the tiny checkpoint, its record (and ledger) deleted.
CHECKSUMS = """
import json, sys
from etils import epath
from multislice.trainer import verify
report = {}
print(json.dumps({"check": verify.checksum_check(epath.Path(sys.argv[1]), 2, report), "report": report}))
"""


@pytest.mark.parametrize("ledger", ["kept", "deleted"])
def test_a_step_without_its_record_fails_if_ours_and_is_skipped_if_foreign(
    trainer_python, tiny_checkpoint, tmp_path, ledger
):
    """QA deleted a step's multislice_digests.json: ``checksums`` passed ("no digests recorded") and the verdict rested
    on finiteness. The recorder's ledger in the checkpoint directory says the directory's steps have records, so a
    missing one fails; a checkpoint with no ledger (from elsewhere) is SKIPPED, never PASS."""
    directory, _ = tiny_checkpoint
    copy = tmp_path / "checkpoints"
    shutil.copytree(directory, copy, ignore=shutil.ignore_patterns("*.orbax-checkpoint-tmp-*"))
    assert json.loads((copy / digests.LEDGER_FILE).read_text())["writer"] == digests.WRITER  # the recorder wrote it
    (copy / "2" / digests.DIGEST_FILE).unlink()
    if ledger == "deleted":
        (copy / digests.LEDGER_FILE).unlink()
    done = run_in_trainer(trainer_python, CHECKSUMS, str(copy / "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    check, report = found["check"], found["report"]["checksums"]
    assert check["name"] == "checksums" and report["recorded"] is False
    if ledger == "kept":
        assert check["passed"] is False and not check.get("skipped"), check
        assert f"step 2: its digest record {digests.DIGEST_FILE} is missing" in check["detail"]
        assert digests.LEDGER_FILE in check["detail"] and report["ledger"] is True
    else:
        assert check.get("skipped") is True and check["detail"].startswith("SKIPPED: step 2: no digests recorded")
        assert report["ledger"] is False


def test_digests_on_cloud_storage_come_from_the_objects_crc32c(trainer_python, tiny_checkpoint, gcs, monkeypatch):
    """On gs:// no byte is read: Cloud Storage's own CRC-32C of each object, and TensorStore reads the B+tree."""
    directory, _ = tiny_checkpoint
    monkeypatch.setenv("TENSORSTORE_GCS_HTTP_URL", gcs.url)  # TensorStore's GCS driver, to the emulator
    monkeypatch.setenv("GCE_METADATA_ROOT", "127.0.0.1:9")  # no credentials lookup on a metadata server
    script = """
import json, sys
import gcsfs
from multislice.trainer import digests
local, remote = sys.argv[1], "gs://bucket/runs/ck/2"
gcsfs.GCSFileSystem().put(local, remote.removeprefix("gs://"), recursive=True)
record = digests.record(remote)
expected = digests.record(local)
gcsfs.GCSFileSystem().rm(remote.removeprefix("gs://") + "/items/manifest.ocdbt")
print(json.dumps({"files": record["files"] == expected["files"], "chunk_digests": record["chunk_digests"],
                  "arrays": sorted(record["arrays"]) == sorted(expected["arrays"]),
                  "problems": digests.check(remote, record)[0]}))
"""
    done = run_in_trainer(trainer_python, script, str(directory / "2"))
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.splitlines()[-1])
    assert found["files"] and found["arrays"] and found["chunk_digests"] is False
    assert [line.split(" (")[0] for line in found["problems"]] == ["missing: items/manifest.ocdbt"]


def test_tensorstore_errors_are_summarised_with_their_cause_and_meaning():
    cause = ValueError(
        'OUT_OF_RANGE: Error reading "params.params.w/c/0/0" in OCDBT database at local file "/x/items/": '
        "Requested byte range [0, 10356) is not valid for value of size 5000 "
        "[source locations='tensorstore/kvstore/byte_range.cc:43']"
    )
    try:
        try:
            raise cause
        except ValueError as inner:
            raise Exception(  # noqa: TRY002 - what Orbax raises
                "Encountered error while reading array index: (slice(0, 64, 1),). See full TensorStore details: "
                "<bound method pybind11_detail_function_record_v1.spec of TensorStore({ 'base': { 'driver': 'zarr3'"
            ) from inner
    except Exception as error:  # noqa: BLE001
        text = digests.summarize_error(error)
    assert "<bound method" not in text and "source locations" not in text
    assert text.endswith("not valid for value of size 5000 (a file is shorter than the OCDBT manifest says: truncated)")
    empty = ValueError('DATA_LOSS: Error reading shard entry in "w/c/0" ...: Existing shard has size of 0 bytes, ...')
    assert digests.summarize_error(empty).endswith("(a file the OCDBT manifest refers to is missing or empty)")
    long = digests.summarize_error(ValueError("word " * 200), limit=50)
    assert long.endswith(" ...") and "wor " not in long


def test_checkpoint_directory_of_the_maxtext_arguments():
    args = ["base_output_directory=gs://b/runs/r1", "run_name=stage-1", "steps=20"]
    assert digests.checkpoint_dir_of(args) == "gs://b/runs/r1/stage-1/checkpoints"
    assert digests.checkpoint_dir_of([*args, "enable_checkpointing=false"]) is None
    assert digests.checkpoint_dir_of(["run_name=x"]) is None


@pytest.mark.parametrize(("present", "expected"), [(["items"], "items"), (["default"], "default"), ([], "items")])
def test_the_item_directory_is_items_or_the_emergency_managers_default(tmp_path, present, expected):
    """MaxText's standard checkpointer writes <step>/items; with emergency checkpoints the persistent tier is an Orbax
    CheckpointManager with one unnamed item, <step>/default. Verify, export and the digests read either."""
    for name in present:
        (tmp_path / "50" / name).mkdir(parents=True)
    assert digests.item_dir(tmp_path / "50") == tmp_path / "50" / expected
