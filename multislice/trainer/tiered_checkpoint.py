"""Multi-tier checkpoints that keep the stage's persistent Orbax checkpoints: MaxText's multi-tier manager, plus a
checkpoint in the stage's checkpoint directory every ``checkpoint_period`` steps.

MaxText 0.2.5 with ``enable_multi_tier_checkpointing`` (``maxtext/utils/train_utils.py``,
``create_checkpoint_manager``) builds Orbax's ``ReplicatorCheckpointManager``
(``orbax/checkpoint/experimental/emergency/multi_tier_checkpointing/replicator_checkpoint_manager.py``) and nothing
else: every process writes its own shards to its node's ramdisk (GKE's multi-tier checkpointing CSI driver), and
the only copy off the nodes is GKE's replicator's backup, per-node ``<hash>.data`` directories in the
CheckpointConfiguration's bucket (checkpoint-replicator ``src/replicator/sync.py``, ``backup``). Verify and export
read an Orbax checkpoint in the stage's checkpoint directory; they would find none.

:class:`TieredCheckpointManager` is that manager with a plain Orbax ``CheckpointManager`` beside it: the local tier
every ``local_checkpoint_period`` steps, as MaxText's, and ``<checkpoint_dir>/<step>/default`` every
``checkpoint_period`` steps and at the final step (MaxText forces that save), the layout of Orbax's emergency
manager's persistent tier (``checkpoint_manager.py``, ``_restore_from_persistent``), which
:func:`multislice.trainer.digests.item_dir` reads. A restart restores the newest step: from the ramdisk when every
process has it there (the replicator put it back: ``initialization.py``, ``_block_and_process_restore_dir``), else
from the checkpoint directory. It subclasses ``ReplicatorCheckpointManager`` because MaxText picks its save and
restore path by ``isinstance`` (``maxtext/common/checkpointing.py``).

It serves a stage with ONE data-parallel replica (FSDP over DCN): the replicator then has no peer holding the same
shards (Orbax declares ``assume-data-parallelism``, so peers receive only ``.meta`` files), and a host's local
checkpoint survives only on its own node: an in-place restart, or a JobSet restart whose pods come back to the same
nodes, restores from the ramdisk; a replaced node sends the restart to the persistent tier.
:func:`install` makes MaxText build it (the worker calls it before MaxText starts).
"""

from __future__ import annotations

from typing import Any

#: MaxText's key that selects the multi-tier manager (``maxtext/configs/base.yml``).
MULTI_TIER_KEY = "enable_multi_tier_checkpointing"
#: How the manager names itself in the line it prints on restoring, which the train report reads for the tier, as
#: it reads Orbax's emergency manager's (:data:`multislice.metrics.TIER_LINE`).
LOG_NAME = "tiered.CheckpointManager"


def _persistent_options(interval: int) -> Any:
    import orbax.checkpoint as ocp

    return ocp.CheckpointManagerOptions(
        save_interval_steps=interval, create=True, enable_async_checkpointing=True, save_root_metadata=False
    )


def _agreed(step: int | None) -> int | None:
    """``step`` when every process passes the same step, else None (one collective: Orbax's ``global_max`` of the
    step and of its negation; -1 stands for none)."""
    from orbax.checkpoint._src.multihost import multihost

    value = step if step is not None else -1
    highest, negated_lowest = multihost.global_max([value, -value])
    return step if highest == -negated_lowest == value and value >= 0 else None


def rcm_module() -> Any:
    """Orbax's ``replicator_checkpoint_manager`` module (imported on first use: the trainer environment only)."""
    from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import replicator_checkpoint_manager

    return replicator_checkpoint_manager


def _base() -> type:
    return rcm_module().ReplicatorCheckpointManager


def manager_class() -> type:
    """:class:`TieredCheckpointManager`, built on first use (Orbax is imported only in the trainer)."""
    global TieredCheckpointManager
    if TieredCheckpointManager is not None:
        return TieredCheckpointManager
    base = _base()

    class Tiered(base):  # type: ignore[misc, valid-type]
        """Orbax's ``ReplicatorCheckpointManager`` (the local tier) and a ``CheckpointManager`` on the stage's
        checkpoint directory (the persistent tier, one unnamed item: ``<step>/default``).

        Args:
            local_directory: The node's ramdisk as the pod mounts it (MaxText ``local_checkpoint_directory``).
            persistent_directory: The stage's checkpoint directory (MaxText ``checkpoint_dir``).
            global_mesh: The training mesh.
            local_interval: Steps between local checkpoints (``local_checkpoint_period``).
            persistent_interval: Steps between persistent checkpoints (``checkpoint_period``).
        """

        def __init__(
            self,
            local_directory: Any,
            persistent_directory: Any,
            *,
            global_mesh: Any,
            local_interval: int,
            persistent_interval: int,
        ) -> None:
            import orbax.checkpoint as ocp
            from etils import epath
            from orbax.checkpoint.experimental.emergency.multi_tier_checkpointing import (
                replicator_checkpoint_manager as rcm,
            )

            super().__init__(
                epath.Path(local_directory),
                options=rcm.ReplicatorCheckpointManagerOptions(save_interval_steps=local_interval),
                global_mesh=global_mesh,
            )
            self._persistent_interval = persistent_interval
            self._persistent = ocp.CheckpointManager(
                epath.Path(persistent_directory), options=_persistent_options(persistent_interval)
            )

        def _local_steps(self) -> list[int]:
            return list(super().all_steps())

        def all_steps(self, read: bool = False) -> list[int]:
            return sorted({*self._local_steps(), *self._persistent.all_steps(read=read)})

        def _local_fits(self, step: int) -> bool:
            """Whether local step ``step`` was saved by this topology (processes and devices): Orbax restores a
            local checkpoint only onto the mesh it was saved with and raises otherwise ("Multi-controller MTC does
            not support elastic scale up/down", ``_restore_placement_plan``). An elastic stage's resize leaves such
            steps on the surviving nodes."""
            engine = self._non_null_local_engine
            try:
                previous, previous_devices = engine._restore_process_metadata(step)
            except (FileNotFoundError, ValueError):
                return False
            return rcm_module()._can_use_mesh_consistency(
                previous, engine._get_distributed_to_device_ids(), previous_devices
            )

        def _local_latest(self) -> int | None:
            """The newest local step every process holds, saved by this topology; None if there is none."""
            step = super().latest_step()
            return _agreed(step if step is not None and self._local_fits(step) else None)

        def latest_step(self) -> int | None:
            """The newest step of either tier (a local one only when :meth:`_local_latest` accepts it)."""
            steps = [s for s in (self._local_latest(), self._persistent.latest_step()) if s is not None]
            return max(steps) if steps else None

        def save(self, step: int, args: Any, *, force: bool = False, custom_metadata: Any = None) -> bool:
            """The local tier when its interval (or ``force``) says so, the persistent tier when its own does."""
            local = super().save(step, args=args, force=force, custom_metadata=custom_metadata)
            # Orbax's own interval check would also save the first step it sees: the period decides here.
            persistent = (force or step % self._persistent_interval == 0) and self._persistent.save(
                step, args=args["state"], force=True
            )
            return bool(local or persistent)

        def restore(self, step: int | None, args: Any) -> Any:
            """``step`` (None: the newest) from the local tier when every process holds it there, else from the
            persistent tier; a ``Composite`` with ``state``, as MaxText reads it."""
            import orbax.checkpoint as ocp

            if step is None:
                step = self.latest_step()
                if step is None:
                    raise FileNotFoundError(f"no checkpoint in {self.directory} or {self._persistent.directory}")
            if step == self._local_latest():
                print(f"{LOG_NAME}: restoring step={step} from local checkpoint", flush=True)
                return super().restore(step, args=args)
            where = self._persistent.directory
            print(f"{LOG_NAME}: restoring step={step} from persistent checkpoint in directory={where}", flush=True)
            return ocp.args.Composite(state=self._persistent.restore(step, args=args["state"]))

        def wait_until_finished(self) -> None:
            super().wait_until_finished()
            self._persistent.wait_until_finished()

        def check_for_errors(self) -> None:
            super().check_for_errors()
            self._persistent.check_for_errors()

        def close(self) -> None:
            super().close()
            self._persistent.close()

    Tiered.__name__ = Tiered.__qualname__ = "TieredCheckpointManager"
    TieredCheckpointManager = Tiered
    return Tiered


#: Set by :func:`manager_class`.
TieredCheckpointManager: Any = None


def replicator_job_name(maxtext_args: list[str]) -> str:
    """The job name GKE's replicator files this stage's local checkpoints under: the JobSet's,
    ``<run name>-<stage>`` (the last part of ``base_output_directory``, the run directory, and MaxText's
    ``run_name``, the stage; :func:`multislice.names.jobset_name`), as Orbax names it when given none
    (``initialization.py``: ``JOBSET_NAME``). MaxText passes its ``run_name``, the stage's name alone, the same in
    every run of the profile: a new run on nodes whose ramdisks still hold an earlier run's steps would be handed
    those (the replicator restores the newest step filed under the job name, checkpoint-replicator
    ``coordinator.py``)."""
    values = dict(arg.split("=", 1) for arg in maxtext_args if "=" in arg)
    run = values.get("base_output_directory", "").rstrip("/").rsplit("/", 1)[-1]
    return f"{run}-{values['run_name']}" if run else values["run_name"]


def install(maxtext_args: list[str]) -> bool:
    """Make MaxText's ``train_utils.create_checkpoint_manager`` build a :class:`TieredCheckpointManager` when the
    stage's arguments turn multi-tier checkpointing on (``enable_multi_tier_checkpointing=true``, which the plan sets
    for a one-replica stage with ``emergency_checkpoint``), and its multi-tier start-up
    (``max_utils.initialize_multi_tier_checkpointing``) name the replicator's job :func:`replicator_job_name`;
    otherwise leave MaxText alone. True when installed."""
    if f"{MULTI_TIER_KEY}=true" not in maxtext_args:
        return False
    from maxtext.utils import max_utils, train_utils

    original = train_utils.create_checkpoint_manager
    original_start = max_utils.initialize_multi_tier_checkpointing
    job = replicator_job_name(maxtext_args)

    def create_checkpoint_manager(config: Any, mesh: Any, init_state_fn: Any) -> Any:
        if not config.enable_multi_tier_checkpointing or config.enable_single_controller:
            return original(config, mesh, init_state_fn)
        from absl import flags

        flags.FLAGS.experimental_orbax_use_distributed_process_id = True  # as MaxText's own factory sets it
        return manager_class()(
            config.local_checkpoint_directory,
            config.checkpoint_dir,
            global_mesh=mesh,
            local_interval=config.local_checkpoint_period,
            persistent_interval=config.checkpoint_period,
        )

    def initialize_multi_tier_checkpointing(*args: Any, **kwargs: Any) -> Any:
        return original_start(*args, **{**kwargs, "run_name": job})

    train_utils.create_checkpoint_manager = create_checkpoint_manager
    max_utils.initialize_multi_tier_checkpointing = initialize_multi_tier_checkpointing
    return True
