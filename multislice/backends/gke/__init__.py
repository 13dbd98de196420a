"""The GKE backend: the steps' work done through the Kubernetes API (JobSet, Kueue) on a GKE cluster.

Modules, named after what they act on:

- :mod:`.access`: a ``kubernetes.client.ApiClient`` from ``plan.spec.cluster``
  (in-cluster ServiceAccount, a kubeconfig context, or a GKE cluster reference
  resolved with google-cloud-container);
- :mod:`.client`: :class:`~.client.Kube`, the API client with the run's namespace
  and the retry policy every call goes through (:mod:`.retry`);
- :mod:`.watch`: list-then-watch that re-lists after 410 Gone;
- :mod:`.cluster`: the CRDs the run needs are served; server-side apply;
- :mod:`.jobset`: create or adopt a stage's JobSet (spec-hash annotation), its
  conditions, delete; :mod:`.workload`: its Kueue Workload and admission;
- :mod:`.pods`: pods of a JobSet, placement on node pools, failure causes with events;
- :mod:`.logs`: following the leader pod's log across JobSet restarts;
- :mod:`.verifier`: the checkpoint verifier as a Job in the trainer image.

The steps (:mod:`multislice.steps`) call these when ``plan.spec.backend == "gke"``.
Every wait takes its intervals and deadlines from :class:`Timings`, so tests
run the same code in seconds.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Timings:
    """Intervals and deadlines of the GKE steps, seconds.

    Attributes:
        poll_seconds: Between two reads of an object's status while waiting.
        report_seconds: Between two "still waiting" progress lines.
        watch_seconds: Server-side timeout of one watch request (``timeoutSeconds``);
            the watch is re-opened from the last resourceVersion after it.
        admit_timeout: How long admit waits for Kueue to admit the Workload.
        launch_timeout: How long launch waits for every pod to run.
        unschedulable_grace: How long a pod may stay Unschedulable before launch fails.
        train_timeout: How long train follows a JobSet before giving up.
        readmit_timeout: How long train waits for an evicted Workload to be admitted again.
        verify_timeout: How long the verifier Job may run.
        api_deadline: How long one API call is retried (429, 5xx, connection resets).
        backoff_initial: First retry delay; doubled after each failure ...
        backoff_max: ... up to this cap.
    """

    poll_seconds: float = 5.0
    report_seconds: float = 60.0
    watch_seconds: int = 60
    admit_timeout: float = 6 * 3600.0
    launch_timeout: float = 1800.0
    unschedulable_grace: float = 600.0
    train_timeout: float = 7 * 24 * 3600.0
    readmit_timeout: float = 6 * 3600.0
    verify_timeout: float = 1800.0
    api_deadline: float = 300.0
    backoff_initial: float = 1.0
    backoff_max: float = 30.0


DEFAULT_TIMINGS = Timings()
