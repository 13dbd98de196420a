"""The GKE backend: a run's workloads on a GKE cluster, through the Kubernetes API (JobSet, Kueue) and the GKE API.

:class:`GkeBackend` (:mod:`.backend`) implements
:class:`multislice.backends.base.Backend`. Modules, named after what they act on:

- :mod:`.access`: a ``kubernetes.client.ApiClient`` from ``plan.spec.cluster``
  (in-cluster ServiceAccount, a kubeconfig context, or a GKE cluster reference
  resolved with google-cloud-container);
- :mod:`.client`: :class:`~.client.Kube`, the API client with the run's namespace
  and the retry policy every call goes through (:mod:`.retry`);
- :mod:`.watch`: list-then-watch that re-lists after 410 Gone;
- :mod:`.cluster`: the CRDs the run needs are served; server-side apply;
- :mod:`.nodepool`: the TPU node pools, one per slice (google-cloud-container);
- :mod:`.launchers`: the stage's launcher (:mod:`multislice.backends.launcher`), a JobSet or a KubeRay RayJob:
  create or adopt, wait until its pods run, follow, failure report, delete;
- :mod:`.jobset`: create or adopt a stage's JobSet (spec-hash annotation), its
  conditions, delete; :mod:`.rayjob`: the same for a RayJob, its RayCluster's pods and submitter;
  :mod:`.workload`: its Kueue Workload and admission;
- :mod:`.pods`: pods of a JobSet, placement on node pools, failure causes with events;
- :mod:`.logs`: following the leader pod's log across JobSet restarts;
- :mod:`.jobs`: one-pod Jobs of the trainer image, run and read back:
  :mod:`.verifier` (the checkpoint verifier) and :mod:`.aot` (preflight's compiles).

Every wait takes its intervals and deadlines from
:class:`multislice.timings.Timings`, so tests run the same code in seconds.
"""

from multislice.backends.gke.backend import GkeBackend

__all__ = ["GkeBackend"]
