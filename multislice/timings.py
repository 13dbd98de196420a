"""One source of timeouts: what each step waits for, and the pod deadline the compiled pipeline gives it.

A backend waits with its :class:`Timings` (:data:`DEFAULTS` per backend, with
the profile's ``timeouts`` section on top: :func:`timings_for`). The compiled
pipeline's pod deadlines (kfp-kubernetes ``set_timeout``, i.e. the pod's
``activeDeadlineSeconds``) come from the same values (:func:`step_deadline`):
a step's deadline is its longest wait (:meth:`Timings.longest_wait`) plus
:data:`START_MARGIN_SECONDS` and one API retry deadline, on whichever backend
waits longest, since ``backend`` is a run-time parameter. So a pod is never
stopped while its step still has a wait left that would end in an actionable
message (e.g. launch's "Unschedulable ... check node pools" after
``unschedulable_grace``).

All values are seconds.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from multislice.config import RunSpec

#: The pipeline's steps, in graph order (the names of their components).
STEPS = (
    "plan",
    "prepare_data",
    "preflight",
    "provision",
    "admit",
    "launch",
    "train",
    "verify_checkpoint",
    "export",
    "cleanup",
)
#: Time a step's pod needs besides its waits: start, imports, planning, writing reports.
START_MARGIN_SECONDS = 300
#: How long the exit handler's webhook POST may take (:mod:`multislice.delivery.notify`).
NOTIFY_SECONDS = 10


@dataclass(frozen=True)
class Timings:
    """Intervals and deadlines of the steps' waits, seconds.

    Attributes:
        poll_seconds: Between two reads of an object's (or a local JobSet's) status while waiting.
        report_seconds: Between two "still waiting" progress lines.
        watch_seconds: Server-side timeout of one watch request (``timeoutSeconds``); re-opened after it.
        api_deadline: How long one API call is retried (429, 5xx, connection resets).
        backoff_initial: First retry delay; doubled after each failure ...
        backoff_max: ... up to this cap.
        provision_timeout: How long provision may wait in all (node pool operations on GKE).
        admit_timeout: How long admit waits for Kueue to admit the Workload.
        launch_timeout: How long launch waits for every pod to run.
        unschedulable_grace: How long a pod may stay Unschedulable before launch fails (within launch_timeout).
        job_unschedulable_grace: How long the pod of a trainer Job on a CPU node pool (an AOT compile, the shard
            workers, the verify-and-export Job) may stay Unschedulable before the Job is deleted and the step fails
            with the scheduler's message, when the cluster autoscaler is not adding a node for it (no autoscaler
            event on the pod, or ``NotTriggerScaleUp``: no node group it may grow would fit the pod).
        job_scale_up_grace: How long such a pod may stay Unschedulable while the cluster autoscaler is adding a node
            for it (its newest event on the pod ``TriggeredScaleUp``, :func:`multislice.backends.gke.pods.
            autoscaler_verdict`): a new node takes minutes (an M3 export node more), and the autoscaler itself gives
            a node ``--max-node-provision-time``, 15 minutes by default (kubernetes/autoscaler
            ``cluster-autoscaler/FAQ.md``), before it gives up on it. The time a Job's pod waited for a node
            (at most this) does not count against the Job's own timeout (``compile``, ``verify``, ``prepare_data``).
        train_timeout: How long train follows a JobSet before giving up.
        readmit_timeout: How long train waits for an evicted Workload to be admitted again (within train_timeout).
        verify_timeout: How long the checkpoint verifier may run.
        compile_timeout: How long one AOT compile may run (preflight).
        prepare_data_timeout: How long tokenizing a stage's text may run (prepare_data).
        alternative_budget: How long preflight may search for a fitting alternative to a stage that does not fit.
        delete_timeout: How long deleting a workload may wait for its processes to stop (local backend).
        collectives_timeout: CPU pods' ``jax.distributed`` timeouts (every process joining, heartbeats,
            shutdown): the worker passes it to ``jax.distributed.initialize``. JAX's defaults (300 s to
            join, 100 s of missed heartbeats) are tight for processes that import MaxText and compile
            side by side on a loaded 2-core machine.
    """

    poll_seconds: float = 5.0
    report_seconds: float = 60.0
    watch_seconds: int = 60
    api_deadline: float = 300.0
    backoff_initial: float = 1.0
    backoff_max: float = 30.0
    provision_timeout: float = 2 * 3600.0
    admit_timeout: float = 6 * 3600.0
    launch_timeout: float = 1800.0
    unschedulable_grace: float = 600.0
    job_unschedulable_grace: float = 60.0
    job_scale_up_grace: float = 900.0
    train_timeout: float = 7 * 24 * 3600.0
    readmit_timeout: float = 6 * 3600.0
    verify_timeout: float = 1800.0
    compile_timeout: float = 1200.0
    prepare_data_timeout: float = 6 * 3600.0
    alternative_budget: float = 600.0
    delete_timeout: float = 60.0
    collectives_timeout: float = 300.0

    def longest_wait(self, step: str) -> float:
        """The longest a step waits (on others: the API, Kueue, pods, a compile), seconds.

        ``preflight``: one stage's compile plus the alternative search (one task per stage);
        ``cleanup``: deleting what is left (two lists and their deletes, each retried for at
        most ``api_deadline``) plus the webhook post. The steps that run a trainer Job on a CPU
        node pool (``prepare_data``, ``preflight``, ``verify_checkpoint``, ``export``) may also
        wait ``job_scale_up_grace`` for the cluster autoscaler to add a node for it.

        Raises:
            KeyError: not a step of the pipeline.
        """
        waits = {
            "plan": 0.0,
            "prepare_data": self.prepare_data_timeout + self.job_scale_up_grace,
            "preflight": self.compile_timeout + self.alternative_budget + self.job_scale_up_grace,
            "provision": self.provision_timeout,
            "admit": self.admit_timeout,
            "launch": self.launch_timeout,
            "train": self.train_timeout,
            "verify_checkpoint": self.verify_timeout + self.job_scale_up_grace,
            "export": self.verify_timeout + self.job_scale_up_grace,  # the exporter runs under the verifier's timeout
            "cleanup": self.delete_timeout + 4 * self.api_deadline + NOTIFY_SECONDS,
        }
        return waits[step]

    def deadline(self, step: str) -> int:
        """The pod deadline for a step: its longest wait + one API retry deadline + the start margin, seconds."""
        return math.ceil(self.longest_wait(step) + self.api_deadline + START_MARGIN_SECONDS)


#: Each backend's waits. Local: no API and no Kueue, processes of this machine polled often;
#: a local train of the tiny models takes minutes, so 6 h means something is stuck.
DEFAULTS: dict[str, Timings] = {
    "local": Timings(
        poll_seconds=0.5,
        report_seconds=60.0,
        watch_seconds=1,
        api_deadline=10.0,
        backoff_initial=0.1,
        backoff_max=1.0,
        provision_timeout=120.0,
        admit_timeout=120.0,
        launch_timeout=300.0,
        unschedulable_grace=300.0,
        train_timeout=6 * 3600.0,
        readmit_timeout=300.0,
        collectives_timeout=900.0,
    ),  # fmt: skip
    "gke": Timings(),
}

#: ``timeouts`` fields of a profile -> the :class:`Timings` field each sets.
SPEC_FIELDS = {
    "provision": "provision_timeout",
    "admit": "admit_timeout",
    "launch": "launch_timeout",
    "unschedulable_grace": "unschedulable_grace",
    "scale_up_grace": "job_scale_up_grace",
    "train": "train_timeout",
    "readmit": "readmit_timeout",
    "verify": "verify_timeout",
    "compile": "compile_timeout",
    "prepare_data": "prepare_data_timeout",
    "alternative_search": "alternative_budget",
    "collectives": "collectives_timeout",
}


def timings_for(spec: RunSpec, backend: str | None = None) -> Timings:
    """The waits of a run on a backend (default the spec's): the backend's defaults, then the profile's ``timeouts``,
    then on GKE the flex-start capacity wait (:func:`with_capacity_wait`)."""
    name = backend or spec.backend
    changes = {SPEC_FIELDS[key]: value for key, value in spec.timeouts.model_dump().items() if value is not None}
    timings = dataclasses.replace(DEFAULTS[name], **changes)
    return with_capacity_wait(timings, spec) if name == "gke" else timings


def with_capacity_wait(timings: Timings, spec: RunSpec) -> Timings:
    """``timings`` with admit, launch and the Unschedulable grace lasting at least the flex-start capacity wait.

    With flex-start node pools (``node_pools.provisioning: flex-start``) Kueue admits on quota (with queued
    provisioning: once the ProvisioningRequest is Provisioned) and the TPU pods stay Unschedulable while Dynamic
    Workload Scheduler finds the capacity; that is not a failure within ``node_pools.capacity_wait_seconds``
    (default seven days, :data:`multislice.config.models.FLEX_START_MAX_WAIT_SECONDS`). Other provisioning:
    ``timings`` unchanged. All values seconds.
    """
    wait = spec.node_pools.capacity_wait_seconds
    if wait is None:
        return timings
    return dataclasses.replace(
        timings,
        admit_timeout=max(timings.admit_timeout, wait),
        launch_timeout=max(timings.launch_timeout, wait),
        unschedulable_grace=max(timings.unschedulable_grace, wait),
    )


def step_deadline(spec: RunSpec, step: str) -> int:
    """The pod deadline of ``step`` in the compiled pipeline: the largest over the backends, seconds.

    ``backend`` is a pipeline parameter, so the YAML compiled for a local
    profile may be run with ``backend=gke``; the deadline must cover both.
    """
    return max(timings_for(spec, backend).deadline(step) for backend in DEFAULTS)
