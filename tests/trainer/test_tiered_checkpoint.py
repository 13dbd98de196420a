"""The multi-tier manager with persistent checkpoints (multislice.trainer.tiered_checkpoint), driven through MaxText's
own save and restore functions on CPU (one process, ``jax.distributed`` on localhost; Orbax 0.12.8, MaxText 0.2.5).

What this cannot run: GKE's replicator, which on a cluster renames the local step directories it restores (and
garbage-collects the rest); here the local directory keeps what Orbax wrote, as a node's ramdisk does between an
in-place restart's attempts.
"""

from __future__ import annotations

import json

from multislice.metrics import parse_restore_line
from tests.conftest import run_in_trainer

SCRIPT = r"""
import json, socket, sys, types
from absl import flags
flags.FLAGS.mark_as_parsed()
import jax, jax.numpy as jnp, numpy as np
from etils import epath
sock = socket.socket(); sock.bind(("localhost", 0)); port = sock.getsockname()[1]; sock.close()
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=1, process_id=0)
from orbax.checkpoint._src.multihost import multihost
multihost.initialize_runtime_to_distributed_ids(); multihost.initialize_distributed_to_device_ids()
from maxtext.common import checkpointing, emergency_checkpointing
from maxtext.utils import train_utils
from multislice.trainer import digests, tiered_checkpoint

root = epath.Path(sys.argv[1]); local, persistent = root / "local", root / "checkpoints"; local.mkdir()
config = types.SimpleNamespace(
    enable_multi_tier_checkpointing=True, enable_single_controller=False, local_checkpoint_directory=str(local),
    checkpoint_dir=str(persistent), local_checkpoint_period=2, checkpoint_period=5,
    checkpoint_storage_target_data_file_size_bytes=2 * 1024**3,
)
from maxtext.utils import max_utils
started = {}
max_utils.initialize_multi_tier_checkpointing = lambda directory, **kwargs: started.update(kwargs)
args = ["run_name=llama3-70b", "base_output_directory=gs://b/runs/llama3-multislice-1a2b3c4d",
        "enable_multi_tier_checkpointing=true"]
out = {"installed": tiered_checkpoint.install(args),
       "left_alone": tiered_checkpoint.install(["run_name=s", "enable_multi_tier_checkpointing=false"])}
max_utils.initialize_multi_tier_checkpointing("/local", run_name="llama3-70b", data_parallelism=1)  # as MaxText
out["replicator_job"] = started["run_name"]
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "fsdp"))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
def state(step):
    return {"params": {"w": jax.device_put(jnp.full((8,), float(step)), sharding)},
            "step": jax.device_put(jnp.asarray(step), sharding)}
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), jnp.asarray(a).dtype, sharding=sharding), state(0))

manager = train_utils.create_checkpoint_manager(config, mesh, None)  # MaxText's factory, patched by install
out["class"] = type(manager).__name__
out["maxtext_treats_it_as_replicator"] = isinstance(manager, checkpointing.EmergencyReplicatorCheckpointManager)
saved = {}
for step in range(1, 8):  # MaxText calls save on every step due in either tier, and forces the final one (7)
    if step % 2 == 0 or step % 5 == 0 or step == 7:
        saved[step] = bool(emergency_checkpointing.save(manager, step, state(step), config, force=step == 7))
checkpointing.wait_until_finished(manager)
out["saved"] = saved
out["local_steps"] = sorted(int(p.name) for p in local.iterdir() if p.name.isdigit())
out["persistent_steps"] = sorted(int(p.name) for p in persistent.iterdir() if p.name.isdigit())
out["item_dir"] = digests.item_dir(persistent / "7").name
out["latest"] = checkpointing.latest_step(manager)
restored = emergency_checkpointing.restore(manager, out["latest"], abstract)
out["restored_local"] = float(restored["params"]["w"][0])
manager.close()

# A replaced node: its ramdisk is empty. The newest step comes from the persistent tier.
for entry in local.iterdir():
    entry.rmtree() if entry.is_dir() else entry.unlink()
again = train_utils.create_checkpoint_manager(config, mesh, None)
out["latest_after_node_loss"] = checkpointing.latest_step(again)
restored = emergency_checkpointing.restore(again, out["latest_after_node_loss"], abstract)
out["restored_persistent"] = float(restored["params"]["w"][0])
out["restored_older_persistent"] = float(emergency_checkpointing.restore(again, 5, abstract)["params"]["w"][0])
again.close()
print("RESULT " + json.dumps(out))
"""


def test_local_tier_every_local_period_persistent_checkpoints_where_verify_reads_them(trainer_python, tmp_path):
    done = run_in_trainer(trainer_python, SCRIPT, str(tmp_path), timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    out = json.loads(line.removeprefix("RESULT "))
    assert (out["installed"], out["left_alone"]) == (True, False)
    assert out["replicator_job"] == "llama3-multislice-1a2b3c4d-llama3-70b"  # the JobSet's name, not the stage's
    assert out["class"] == "TieredCheckpointManager" and out["maxtext_treats_it_as_replicator"]
    assert out["saved"] == {"2": True, "4": True, "5": True, "6": True, "7": True}
    assert out["local_steps"] == [2, 4, 6, 7]  # every local period, and the forced final step
    assert out["persistent_steps"] == [5, 7]  # every checkpoint_period, and the final step: verify's input
    assert out["item_dir"] == "default"  # digests.item_dir finds it (verify, export)
    assert (out["latest"], out["restored_local"]) == (7, 7.0)
    assert (out["latest_after_node_loss"], out["restored_persistent"]) == (7, 7.0)
    assert out["restored_older_persistent"] == 5.0
    # The line the train report reads the tier from (multislice.metrics.TIER_LINE), once per restore.
    tiers = [parse_restore_line(line) for line in done.stdout.splitlines()]
    assert [t for t in tiers if t] == [
        {"step": 7, "tier": "local"}, {"step": 7, "tier": "persistent"}, {"step": 5, "tier": "persistent"}
    ]  # fmt: skip


RESIZE = r"""
import json, os, socket, sys, types
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={sys.argv[2]}"
from absl import flags
flags.FLAGS.mark_as_parsed()
import jax, jax.numpy as jnp, numpy as np
from etils import epath
sock = socket.socket(); sock.bind(("localhost", 0)); port = sock.getsockname()[1]; sock.close()
jax.distributed.initialize(coordinator_address=f"localhost:{port}", num_processes=1, process_id=0)
from orbax.checkpoint._src.multihost import multihost
multihost.initialize_runtime_to_distributed_ids(); multihost.initialize_distributed_to_device_ids()
from maxtext.common import checkpointing, emergency_checkpointing
from multislice.trainer import tiered_checkpoint

root = epath.Path(sys.argv[1]); local, persistent = root / "local", root / "checkpoints"; local.mkdir(exist_ok=True)
config = types.SimpleNamespace(enable_multi_tier_checkpointing=True, local_checkpoint_directory=str(local),
                               checkpoint_storage_target_data_file_size_bytes=2 * 1024**3)
mesh = jax.sharding.Mesh(np.array(jax.devices()).reshape(1, -1), ("data", "fsdp"))
sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("fsdp"))
def state(step):
    return {"w": jax.device_put(jnp.full((8,), float(step)), sharding)}
abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding), state(0))
manager = tiered_checkpoint.manager_class()(local, persistent, global_mesh=mesh, local_interval=2,
                                            persistent_interval=5)
if sys.argv[3] == "train":
    for step in (2, 4, 5, 6):
        emergency_checkpointing.save(manager, step, state(step), config, force=False)
    checkpointing.wait_until_finished(manager)
out = {"devices": len(jax.devices()), "latest": checkpointing.latest_step(manager),
       "local_steps": sorted(int(p.name) for p in local.iterdir() if p.name.isdigit())}
out["restored"] = float(emergency_checkpointing.restore(manager, out["latest"], abstract)["w"][0])
manager.close()
print("RESULT " + json.dumps(out))
"""


def test_after_a_resize_the_local_steps_of_the_old_mesh_are_passed_over_for_the_persistent_tier(
    trainer_python, tmp_path
):
    """An elastic stage's resize: the surviving nodes' ramdisks hold local steps saved on the old mesh (2 devices),
    newer than the persistent one; on the new mesh (1 device) the restart takes the persistent step (Orbax would
    raise on the old mesh's local step: 'Multi-controller MTC does not support elastic scale up/down')."""
    results = []
    for devices, phase in (("2", "train"), ("1", "restart")):
        done = run_in_trainer(trainer_python, RESIZE, str(tmp_path), devices, phase, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        [line] = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
        results.append(json.loads(line.removeprefix("RESULT ")))
    trained, resized = results
    assert (trained["devices"], trained["latest"], trained["restored"]) == (2, 6, 6.0)  # the local tier's newest
    assert resized["local_steps"] == [2, 4, 6]  # still on the node
    assert (resized["devices"], resized["latest"], resized["restored"]) == (1, 5, 5.0)  # from the persistent tier
