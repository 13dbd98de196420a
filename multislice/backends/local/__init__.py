"""The local backend: a run's workloads as processes of this machine (:class:`LocalBackend`).

Modules: :mod:`.backend` (the :class:`~multislice.backends.base.Backend`
implementation), :mod:`.launchers` (a stage's JobSet, or its Ray driver's: launch, follow, failure report,
delete; :mod:`multislice.backends.launcher`), :mod:`.jobsets` (the JobSet API over processes: create or
adopt, state, logs, delete), :mod:`.supervisor` (one detached process per
JobSet, acting as the JobSet and Job controllers), :mod:`.pods` (a JobSet
expanded into its pods), :mod:`.state` (the state file), :mod:`.environment`
(the trainer environment, memory, the coordinator port), :mod:`.aot`
(preflight's compiles) and :mod:`.verifier` (the checkpoint verifier).
"""

from multislice.backends.local.backend import LocalBackend
from multislice.backends.local.environment import TrainerEnvMissing, trainer_env, trainer_process_env
from multislice.backends.local.jobsets import AlreadyExists, LocalJobSets, pid_alive

__all__ = [
    "AlreadyExists", "LocalBackend", "LocalJobSets", "TrainerEnvMissing", "pid_alive", "trainer_env",
    "trainer_process_env",
]  # fmt: skip
