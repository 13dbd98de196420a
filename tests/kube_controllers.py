"""Test support: the parts of a GKE cluster the tests play, acting through the Kubernetes API over HTTP.

Kueue (suspends the JobSet, creates its Workload with Kueue's pod sets, sets
QuotaReserved / Admitted / Evicted and unsuspends; it admits only what
:class:`tests.kueue_model.Kueue` admits against the ClusterQueue, ResourceFlavors,
LocalQueue, Kueue Configuration and claim templates stored in the emulator, and
otherwise writes Kueue's pending condition), the JobSet and Job controllers and the
kubelet (pods through phases, container states, exit codes, logs, events,
JobSet conditions and restarts; JobSet v0.12.0's in-place restart: its webhook's feature gate, the
controller's attempt bookkeeping, the agent sidecar and the kubelet's RestartAllContainers), GKE
(nodes labelled with their node pool and TPU shape), the installed CRDs (the upstream files in multislice/crds), and
KubeRay for a stage launched by Ray (:class:`KubeRay`: the RayCluster, its
head and worker pods, the submitter Job and pod with the driver's log, the
RayJob's status, a worker killed and replaced, the garbage collector).
"""

from __future__ import annotations

import copy
import datetime
import functools
import json
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s

from multislice import names, tpu
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, KUEUE_GROUP, KUEUE_VERSION
from multislice.render import in_place
from multislice.render.ray import DRANET_DEVICE_CLASS
from multislice.trainer import verify_export
from tests import kueue_model
from tests.kube_cluster import Served, wait_until

CRDS = Path(__file__).resolve().parents[1] / "multislice" / "crds"


@functools.cache
def upstream_crds() -> list[dict[str, Any]]:
    """The CRDs in multislice/crds (JobSet v0.12.0, Kueue v0.19.2, KubeRay v1.7.0). The emulator does not validate
    against their schemas, so they are dropped, except KubeRay's: provision reads those to check the cluster's KubeRay
    release (:func:`multislice.backends.gke.kuberay.check_kuberay`)."""
    found = []
    for path in sorted(CRDS.glob("*/*.yaml")):
        crd = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if crd.get("kind") == "CustomResourceDefinition":
            if crd["spec"]["group"] != "ray.io":
                for version in crd["spec"]["versions"]:
                    version.pop("schema", None)
            found.append(crd)
    return found


class Play:
    """Acts as the cluster's controllers on a served emulator, through its own official client."""

    def __init__(self, served: Served, namespace: str = "default"):
        self.served, self.cluster, self.ns = served, served.cluster, namespace
        api = served.api(admin=True)  # the controllers are not bound by the pipeline's RBAC
        self.custom, self.core, self.batch = k8s.CustomObjectsApi(api), k8s.CoreV1Api(api), k8s.BatchV1Api(api)
        self.crds = k8s.ApiextensionsV1Api(api)
        # The feature gates in-place restart needs, at their upstream defaults (off): feature_gates() turns them on.
        self.gates = {"InPlaceRestart": False, "RestartAllContainers": False}
        self.cluster.admission.append(self._admission)
        self._clock = datetime.datetime(2026, 11, 24, 10, 0, 0, tzinfo=datetime.UTC)

    # -- installation ------------------------------------------------------

    def install_crds(self, skip: tuple[str, ...] = ()) -> None:
        """Create the upstream JobSet, Kueue and KubeRay CRDs (:func:`upstream_crds`), established, except the names in
        ``skip``."""
        for crd in upstream_crds():
            if crd["metadata"]["name"] in skip:
                continue
            crd = copy.deepcopy(crd)
            crd["status"] = {"conditions": [{"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                                             "message": "accepted"}]}  # fmt: skip
            self.crds.create_custom_resource_definition(crd)

    def install_kueue(self, objects: list[dict[str, Any]], configuration: dict[str, Any] | None = None) -> None:
        """What a cluster admin applies for Kueue: the Kueue ``objects`` (``multislice render``'s kueue-*.yaml) and
        Kueue's ConfigMap with its shipped Configuration, ``configuration``'s ``resources`` and ``featureGates``
        merged in (the fragment ``multislice render`` writes under kueue-config/)."""
        for obj in objects:
            plural = {"ResourceFlavor": "resourceflavors", "ClusterQueue": "clusterqueues", "LocalQueue": "localqueues",
                      "WorkloadPriorityClass": "workloadpriorityclasses", "AdmissionCheck": "admissionchecks",
                      "ProvisioningRequestConfig": "provisioningrequestconfigs"}[obj["kind"]]  # fmt: skip
            group, version = obj["apiVersion"].split("/")
            if obj["metadata"].get("namespace"):
                self.custom.create_namespaced_custom_object(group, version, obj["metadata"]["namespace"], plural, obj)
            else:
                self.custom.create_cluster_custom_object(group, version, plural, obj)
        merged = copy.deepcopy(kueue_model.DEFAULT_CONFIGURATION)
        for key in ("resources", "featureGates"):
            if configuration and key in configuration:
                merged[key] = configuration[key]
        self.kueue_configuration(merged)

    def kueue_configuration(self, configuration: dict[str, Any]) -> None:
        """Kueue's ConfigMap (``kueue-system/kueue-manager-config``) holding ``configuration``, created or replaced."""
        body = {"metadata": {"name": kueue_model.CONFIG_MAP, "namespace": kueue_model.CONFIG_NAMESPACE},
                "data": {kueue_model.CONFIG_KEY: yaml.safe_dump(configuration)}}  # fmt: skip
        try:
            self.core.create_namespaced_config_map(kueue_model.CONFIG_NAMESPACE, body)
        except k8s.ApiException as error:
            if error.status != 409:
                raise
            # kmock serves no PUT: the ConfigMap is replaced by deleting and creating it
            self.core.delete_namespaced_config_map(kueue_model.CONFIG_MAP, kueue_model.CONFIG_NAMESPACE)
            self.core.create_namespaced_config_map(kueue_model.CONFIG_NAMESPACE, body)

    def nodes(self, pools: dict[str, int], accelerator: str = "tpu-v6e-slice", topology: str = "4x4") -> None:
        """GKE nodes: ``pools`` maps node pool name -> node count."""
        for pool, count in pools.items():
            for index in range(count):
                labels = {tpu.NODEPOOL_LABEL: pool, tpu.ACCELERATOR_LABEL: accelerator, tpu.TOPOLOGY_LABEL: topology}
                self.core.create_node({"metadata": {"name": f"gke-{pool}-{index}", "labels": labels}})

    # -- Kueue ---------------------------------------------------------------

    def jobset(self, name: str) -> dict[str, Any]:
        """Wait for the JobSet to exist; returns it."""

        def get() -> Any:
            found = self.custom.list_namespaced_custom_object(
                JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL, field_selector=f"metadata.name={name}"
            )
            return found["items"][0] if found["items"] else None

        return wait_until(get, what=f"JobSet {name}")

    def patch_jobset(self, name: str, body: dict[str, Any], status: bool = False) -> dict[str, Any]:
        """Merge-patch the JobSet (its status subresource when ``status``); returns it as stored."""
        patch = (
            self.custom.patch_namespaced_custom_object_status if status else self.custom.patch_namespaced_custom_object
        )
        return patch(JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL, name, body)

    def workload_name(self, jobset: str) -> str:
        return f"jobset-{jobset}-1a2b3"

    def kueue_queues(self, jobset: str, message: str, reason: str = "Pending") -> None:
        """Kueue's webhook suspends the JobSet; its controller creates a pending Workload (QuotaReserved False)."""
        js = self.jobset(jobset)
        self.patch_jobset(jobset, {"spec": {"suspend": True}})
        self._pending_workload(js, self.workload_name(jobset), f"{JOBSET_GROUP}/{JOBSET_VERSION}", message, reason)

    def _pending_workload(self, owner_obj: dict[str, Any], name: str, api: str, message: str, reason: str) -> None:
        jobset = owner_obj["metadata"]["name"]
        js = owner_obj
        owner = {"apiVersion": api, "kind": owner_obj["kind"], "name": jobset,
                 "uid": js["metadata"]["uid"], "controller": True}  # fmt: skip
        workload = {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "Workload",
            "metadata": {"name": name, "namespace": self.ns, "ownerReferences": [owner]},
            "spec": {"queueName": js["metadata"]["labels"][names.KUEUE_QUEUE_LABEL],
                     "podSets": kueue_model.pod_sets(js)},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": reason,
                                       "message": message}]},
        }  # fmt: skip
        self.custom.create_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", workload)

    def kueue_admits(self, jobset: str) -> str | None:
        """Kueue's scheduler on the JobSet's Workload (:class:`tests.kueue_model.Kueue`): QuotaReserved and Admitted,
        the JobSet unsuspended, and None; or, when Kueue cannot admit it, the Workload left pending with Kueue's
        condition and its message returned."""
        message = self._admit_workload(self.workload_name(jobset))
        if message is None:
            self.patch_jobset(jobset, {"spec": {"suspend": False}})
        return message

    def decide(self, name: str) -> kueue_model.Verdict:
        """What Kueue decides for Workload ``name`` now (:meth:`tests.kueue_model.Kueue.decide`)."""
        found = self.custom.get_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", name)
        return kueue_model.Kueue(self).decide(found)

    def _admit_workload(self, name: str) -> str | None:
        verdict = self.decide(name)
        if verdict.admission is None:
            status: dict[str, Any] = {
                "conditions": [
                    {"type": "QuotaReserved", "status": "False", "reason": verdict.reason, "message": verdict.message},
                    {"type": "Admitted", "status": "False", "reason": "NoReservation",
                     "message": "The workload has no reservation"},
                ],
                "admission": None,
            }  # fmt: skip
        else:
            status = {
                "conditions": [
                    {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "reserved"},
                    {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "admitted"},
                ],
                "admission": verdict.admission,
            }
        self.custom.patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", name, {"status": status}
        )
        return verdict.message or None

    def kueue_evicts(self, jobset: str, message: str) -> None:
        """Evicted (Preempted): Admitted False, the JobSet suspended again."""
        status = {"conditions": [
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": message},
            {"type": "Admitted", "status": "False", "reason": "NoReservation", "message": "evicted"},
        ]}  # fmt: skip
        self.custom.patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", self.workload_name(jobset), {"status": status}
        )
        self.patch_jobset(jobset, {"spec": {"suspend": True}})

    def kueue_checks(self, jobset: str, check: str, state: str, message: str) -> None:
        """Quota reserved, one admission check in ``state`` with ``message``: what Kueue's ProvisioningRequest
        controller mirrors into the Workload (``status.admissionChecks[]``, kueue
        ``pkg/controller/admissionchecks/provisioning/controller.go`` ``syncCheckStates``). The JobSet stays
        suspended: Kueue admits only once every check is Ready (then :meth:`kueue_admits`). The quota reservation is
        the model's (:class:`tests.kueue_model.Kueue`); a scenario whose queue cannot hold the JobSet fails here."""
        verdict = self.decide(self.workload_name(jobset))
        assert verdict.admission is not None, verdict.message
        status = {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "reserved",
                 "lastTransitionTime": "2026-01-01T00:00:00Z"},
            ],
            "admission": verdict.admission,
            "admissionChecks": [{"name": check, "state": state, "message": message,
                                 "lastTransitionTime": "2026-01-01T00:00:00Z"}],
        }  # fmt: skip
        self.custom.patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", self.workload_name(jobset), {"status": status}
        )

    # -- JobSet, Job controllers and the kubelet -----------------------------

    def pod_name(self, jobset: str, slice_index: int, host: int, attempt: int = 0) -> str:
        return f"{names.pod_hostname(jobset, slice_index, host)}-a{attempt}bcd"

    def pods(
        self, jobset: str, slices: int, hosts: int, *, attempt: int = 0, phase: str = "Running",
        pools: list[str] | None = None, status: dict[str, Any] | None = None,
    ) -> list[str]:  # fmt: skip
        """Create the JobSet's pods of one restart attempt, on node pool ``pools[slice]`` (unscheduled if None).

        Each pod carries its replicated job's pod-template labels (the pipeline's run id among them) under
        the JobSet's own labels, as the JobSet controller makes them (``labelAndAnnotateObject`` in
        kubernetes-sigs/jobset ``pkg/controllers/jobset_controller.go`` labels the Job's pod template, which
        the Job controller copies to its pods).
        """
        try:
            found = self.custom.get_namespaced_custom_object(JOBSET_GROUP, JOBSET_VERSION, self.ns, JOBSET_PLURAL,
                                                            jobset)  # fmt: skip
            replicated = found["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
            template_labels = dict(replicated.get("metadata", {}).get("labels") or {})
        except (k8s.ApiException, KeyError, IndexError):  # a scenario's pods without a JobSet object
            template_labels = {}
        created = []
        for j in range(slices):
            for h in range(hosts):
                name = self.pod_name(jobset, j, h, attempt)
                labels = {**template_labels, names.JOBSET_NAME_KEY: jobset, names.JOB_INDEX_KEY: str(j),
                          names.RESTART_ATTEMPT_KEY: str(attempt), names.JOB_COMPLETION_INDEX_KEY: str(h)}  # fmt: skip
                spec: dict[str, Any] = {"containers": [{"name": names.TRAINER_CONTAINER, "image": "trainer"}]}
                if pools:
                    spec["nodeName"] = f"gke-{pools[j]}-{h}"
                body = {"metadata": {"name": name, "namespace": self.ns, "labels": labels}, "spec": spec,
                        "status": status or {"phase": phase}}  # fmt: skip
                self.core.create_namespaced_pod(self.ns, body)
                created.append(name)
        return created

    def pod_scheduled(self, name: str, node: str) -> None:
        """The scheduler binds the pod to ``node`` and the kubelet runs it (``spec.nodeName``, phase Running)."""
        self.core.patch_namespaced_pod(name, self.ns, {"spec": {"nodeName": node}})
        self.pod_status(name, {"phase": "Running", "conditions": [{"type": "PodScheduled", "status": "True"}]})

    def pod_status(self, name: str, status: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": status})

    def event(self, pod: str, reason: str, message: str, kind: str = "Warning", involved: str = "Pod") -> None:
        """An event on object ``pod`` of kind ``involved`` (a Pod, a JobSet, a Job)."""
        body = {"metadata": {"name": f"{pod}.{reason.lower()}", "namespace": self.ns},
                "involvedObject": {"kind": involved, "name": pod, "namespace": self.ns},
                "reason": reason, "message": message, "type": kind}  # fmt: skip
        self.core.create_namespaced_event(self.ns, body)

    def autoscaler_event(self, pod: str, *, triggered: bool, detail: str) -> None:
        """The cluster autoscaler's verdict on pending pod ``pod`` after a scale-up attempt, as an Event on it as
        kubernetes/autoscaler writes it (``cluster-autoscaler/processors/status/eventing_scale_up_processor.go``,
        ``EventingScaleUpStatusProcessor.Process``; type Normal, source ``cluster-autoscaler``): ``TriggeredScaleUp``
        "pod triggered scale-up: [{<group> 0->1 (max: 1)}]" (``detail`` the ``ScaleUpInfo`` list,
        ``processors/nodegroupset``, ``ScaleUpInfo.String``) when it is adding a node for the pod, else
        ``NotTriggerScaleUp`` "pod didn't trigger scale-up: <reasons>" (``detail``, e.g. ``1 Insufficient memory``,
        ``1 in backoff after failed scale-up``). Each event is its own object named as client-go's recorder names
        it (``<pod>.<hex nanoseconds>``, ``tools/record/event.go``), its ``lastTimestamp`` now. Not modelled: the
        autoscaler's loop itself (when it looks, which group it picks, its backoff), and the recorder's
        aggregation of repeats into one object with a count."""
        stamp = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
        reason = "TriggeredScaleUp" if triggered else "NotTriggerScaleUp"
        message = f"pod triggered scale-up: {detail}" if triggered else f"pod didn't trigger scale-up: {detail}"
        body = {"metadata": {"name": f"{pod}.{time.time_ns():x}", "namespace": self.ns},
                "involvedObject": {"kind": "Pod", "name": pod, "namespace": self.ns},
                "reason": reason, "message": message, "type": "Normal", "source": {"component": "cluster-autoscaler"},
                "firstTimestamp": stamp, "lastTimestamp": stamp, "count": 1}  # fmt: skip
        self.core.create_namespaced_event(self.ns, body)

    def log(self, pod: str, text: str) -> None:
        self.cluster.append_log(self.ns, pod, text)

    def jobset_done(self, jobset: str, kind: str, reason: str, message: str, restarts: int | None = None) -> None:
        """JobSet condition ``kind`` (Completed or Failed) and terminalState (and ``status.restarts`` when given)."""
        status: dict[str, Any] = {"terminalState": kind,
                  "conditions": [{"type": kind, "status": "True", "reason": reason, "message": message}]}  # fmt: skip
        if restarts is not None:
            status["restarts"] = restarts
        self.patch_jobset(jobset, {"status": status}, status=True)

    def job_done(self, name: str, log: str, kind: str = "Complete") -> None:
        """The verifier Job: its pod with ``log`` and the Job's terminal condition."""
        pod = f"{name}-xyz12"
        self.core.create_namespaced_pod(
            self.ns, {"metadata": {"name": pod, "labels": {"job-name": name}}, "status": {"phase": "Succeeded"}}
        )
        self.log(pod, log)
        self.batch.patch_namespaced_job_status(
            name, self.ns, {"status": {"conditions": [{"type": kind, "status": "True"}]}}
        )

    def job_pod(self, name: str) -> tuple[dict[str, Any], str]:
        """The Job controller creates the pod of one-pod Job ``name`` (waits for the Job): ``(the Job, pod name)``.

        As the Job controller (kubernetes ``pkg/controller/job/job_controller.go``): the pod
        ``<job>-<5 random>`` from the Job's template, labelled ``job-name`` and ``batch.kubernetes.io/job-name``,
        owned by the Job; the Job's ``status.active`` 1 and ``startTime``. The pod is Pending, not yet scheduled.
        """
        job = wait_until(
            lambda: next((j for j in self.batch.list_namespaced_job(self.ns).items if j.metadata.name == name), None),
            what=f"Job {name}",
        )
        job = self.batch.api_client.sanitize_for_serialization(job)
        pod = f"{name}-k7q2m"
        template = job["spec"]["template"]
        labels = {**template["metadata"].get("labels", {}), "job-name": name, "batch.kubernetes.io/job-name": name}
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"],
                 "controller": True}  # fmt: skip
        self.core.create_namespaced_pod(
            self.ns,
            {"metadata": {"name": pod, "labels": labels, "ownerReferences": [owner]}, "spec": template["spec"],
             "status": {"phase": "Pending"}},
        )  # fmt: skip
        self.batch.patch_namespaced_job_status(
            name, self.ns, {"status": {"active": 1, "startTime": "2026-11-24T10:00:00Z"}}
        )
        return job, pod

    def job_pod_stuck(self, pod: str, reason: str, message: str) -> None:
        """The kubelet cannot start the pod's container: ``containerStatuses[].state.waiting`` with ``reason``
        (e.g. ``CreateContainerConfigError``, message ``secret "x" not found``: kubelet
        ``pkg/kubelet/kubelet_pods.go``, ``makeEnvironmentVariables``); the pod stays Pending."""
        self.pod_status(pod, {"phase": "Pending", "containerStatuses": [
            {"name": names.TRAINER_CONTAINER, "ready": False, "restartCount": 0, "image": "trainer", "imageID": "",
             "state": {"waiting": {"reason": reason, "message": message}}}]})  # fmt: skip

    def job_pod_ends(self, name: str, pod: str, log: str, exit_code: int = 0) -> None:
        """The pod of one-pod Job ``name`` (``backoffLimit: 0``) ends with ``exit_code`` and ``log``; the Job ends.

        The kubelet: the container terminated with the exit code, the pod ``Succeeded`` (0) or ``Failed``. The Job
        controller (kubernetes ``pkg/controller/job/job_controller.go``, v1.31+, where the terminal condition waits
        for the pods to terminate): first the interim condition, ``SuccessCriteriaMet`` (reason
        ``CompletionsReached``, "Reached expected number of succeeded pods") or ``FailureTarget`` (reason
        ``BackoffLimitExceeded``, "Job has reached the specified backoff limit": one failed pod exceeds
        ``backoffLimit`` 0), then beside it the terminal ``Complete`` or ``Failed`` with the same reason, and
        ``status.succeeded`` or ``failed`` 1, ``active`` 0 (``completionTime`` on success only).
        """
        self.log(pod, log)
        terminated = {"exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error"}
        self.pod_status(pod, {"phase": "Succeeded" if exit_code == 0 else "Failed", "containerStatuses": [
            {"name": names.TRAINER_CONTAINER, "ready": False, "restartCount": 0, "image": "trainer", "imageID": "",
             "state": {"terminated": terminated}}]})  # fmt: skip
        if exit_code == 0:
            interim, terminal, reason, message = (
                "SuccessCriteriaMet", "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
            )  # fmt: skip
        else:
            interim, terminal, reason, message = (
                "FailureTarget", "Failed", "BackoffLimitExceeded", "Job has reached the specified backoff limit"
            )  # fmt: skip
        conditions = [{"type": interim, "status": "True", "reason": reason, "message": message}]
        self.batch.patch_namespaced_job_status(name, self.ns, {"status": {"conditions": conditions}})
        counts = {"succeeded": 1} if exit_code == 0 else {"failed": 1}
        done = {"active": 0, **counts, "conditions": [
            *conditions, {"type": terminal, "status": "True", "reason": reason, "message": message}]}  # fmt: skip
        if exit_code == 0:
            done["completionTime"] = "2026-11-24T10:30:00Z"
        self.batch.patch_namespaced_job_status(name, self.ns, {"status": done})

    def indexed_job_runs(self, prefix: str, kubelet: Any) -> dict[str, Any]:
        """The Job controller and the kubelet run Indexed Job ``<prefix>...`` to its end (waits for the Job); the Job.

        As the Job controller does for ``completionMode: Indexed`` (kubernetes ``pkg/controller/job``, v1.33:
        ``indexed_job_utils.go`` and ``job_controller.go``): one pod per completion index ``0..completions-1``, at
        most ``parallelism`` active at once, named from ``generateName`` ``<job>-<index>-``
        (``podGenerateNameWithIndex``; here a fixed 5-character suffix), its index in annotation and label
        ``batch.kubernetes.io/job-completion-index``
        (``addCompletionIndexAnnotation``, ``addCompletionIndexLabel``), ``$JOB_COMPLETION_INDEX`` appended to each
        container's env from that label (``addCompletionIndexEnvVariable``, PodIndexLabel on), labels ``job-name``
        and ``batch.kubernetes.io/job-name``, owned by the Job. ``kubelet(pod) -> subprocess.Popen`` runs a pod's
        container; its exit code and output become the pod's terminated state and log. The Job's status then:
        ``succeeded``/``failed`` counts, ``completedIndexes`` (``"0-1"``: the controller's interval string,
        ``orderedIntervals.String``), ``failedIndexes``, and the interim then terminal conditions as in
        :meth:`job_pod_ends`: ``SuccessCriteriaMet``/``Complete`` (``CompletionsReached``) once every index
        succeeded, or ``FailureTarget``/``Failed`` (``MaxFailedIndexesExceeded``: ``maxFailedIndexes`` 0).

        Not modelled: ``backoffLimitPerIndex`` retries (a failed index is not run again here), pod scheduling and
        node selection, the Job's ``startTime``/``completionTime``.
        """
        job = wait_until(
            lambda: next((j for j in self.batch.list_namespaced_job(self.ns).items
                          if j.metadata.name.startswith(prefix)), None),
            what=f"Job {prefix}*",
        )  # fmt: skip
        job = self.batch.api_client.sanitize_for_serialization(job)
        name, spec = job["metadata"]["name"], job["spec"]
        assert spec.get("completionMode") == "Indexed", spec
        template = spec["template"]
        owner = {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": job["metadata"]["uid"],
                 "controller": True}  # fmt: skip
        exits: dict[int, int] = {}
        pending = list(range(int(spec["completions"])))
        while pending:
            batch = [pending.pop(0) for _ in range(min(int(spec.get("parallelism") or 1), len(pending)))]
            running = []
            for index in batch:
                pod = f"{name}-{index}-x7k2q"
                labels = {
                    **template["metadata"].get("labels", {}),
                    "job-name": name,
                    "batch.kubernetes.io/job-name": name,
                    "batch.kubernetes.io/job-completion-index": str(index),
                }
                pod_spec = copy.deepcopy(template["spec"])
                field = "metadata.labels['batch.kubernetes.io/job-completion-index']"
                for container in pod_spec["containers"]:
                    container.setdefault("env", []).append(
                        {"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {"fieldPath": field}}}
                    )
                body = {"metadata": {"name": pod, "labels": labels, "ownerReferences": [owner],
                                     "annotations": {"batch.kubernetes.io/job-completion-index": str(index)}},
                        "spec": pod_spec, "status": {"phase": "Pending"}}  # fmt: skip
                self.core.create_namespaced_pod(self.ns, body)
                self.pod_status(pod, {"phase": "Running"})
                running.append((index, pod, kubelet(body)))
            self.batch.patch_namespaced_job_status(name, self.ns, {"status": {"active": len(running)}})
            for index, pod, process in running:
                out, _ = process.communicate()
                exits[index] = process.returncode
                self.log(pod, out)
                ok = process.returncode == 0
                terminated = {"exitCode": process.returncode, "reason": "Completed" if ok else "Error"}
                self.pod_status(pod, {"phase": "Succeeded" if ok else "Failed", "containerStatuses": [
                    {"name": names.TRAINER_CONTAINER, "ready": False, "restartCount": 0, "image": "trainer",
                     "imageID": "", "state": {"terminated": terminated}}]})  # fmt: skip
            if any(code != 0 for code in exits.values()):
                break
        done = sorted(i for i, code in exits.items() if code == 0)
        failed = sorted(i for i, code in exits.items() if code != 0)

        def intervals(indexes: list[int]) -> str:
            spans: list[list[int]] = []
            for i in indexes:
                if spans and spans[-1][1] == i - 1:
                    spans[-1][1] = i
                else:
                    spans.append([i, i])
            return ",".join(f"{a}-{b}" if b > a else str(a) for a, b in spans)

        if failed:
            interim, terminal, reason, message = (
                "FailureTarget", "Failed", "MaxFailedIndexesExceeded", "Job has exceeded the specified maximal number "
                "of failed indexes")  # fmt: skip
        else:
            interim, terminal, reason, message = (
                "SuccessCriteriaMet", "Complete", "CompletionsReached", "Reached expected number of succeeded pods"
            )  # fmt: skip
        conditions = [{"type": interim, "status": "True", "reason": reason, "message": message}]
        status = {"active": 0, "succeeded": len(done), "failed": len(failed), "completedIndexes": intervals(done),
                  **({"failedIndexes": intervals(failed)} if failed else {})}  # fmt: skip
        self.batch.patch_namespaced_job_status(name, self.ns, {"status": {**status, "conditions": conditions}})
        terminal_conditions = [*conditions, {"type": terminal, "status": "True", "reason": reason, "message": message}]
        self.batch.patch_namespaced_job_status(name, self.ns, {"status": {"conditions": terminal_conditions}})
        return job

    # -- in-place restart (JobSet v0.12.0, KEP-467; Kubernetes 1.35 RestartAllContainers) -----------------

    def feature_gates(self, *, in_place_restart: bool, restart_all_containers: bool) -> None:
        """Turn the emulated feature gates on or off: JobSet's ``InPlaceRestart`` (its controller's
        ``--feature-gates``) and Kubernetes' ``ContainerRestartRules`` with ``RestartAllContainersOnContainerExits``
        (the API server's; the kubelet model below acts on the rules whatever they are)."""
        self.gates = {"InPlaceRestart": in_place_restart, "RestartAllContainers": restart_all_containers}

    def _admission(self, plural: str, obj: dict[str, Any]) -> tuple[int, str] | None:
        """What refuses a create here (installed as a :attr:`tests.kube_cluster.Cluster.admission` hook).

        JobSet v0.12.0's validating webhook (``pkg/webhooks/jobset_webhook.go``, ``ValidateCreate``): with its gate
        off, ``restartStrategy: InPlaceRestart`` is refused with the webhook's message; with it on, each replicated
        Job needs ``backoffLimit`` MaxInt32, ``podReplacementPolicy: Failed`` and ``completions`` == ``parallelism``.
        A webhook's denial reaches the client as 403, "admission webhook "<name>" denied the request: <errors>".

        The API server's pod validation of a Pod or a Job's template: with the Kubernetes gates off, a container's
        ``restartPolicyRules`` are refused (422 Invalid; ``pkg/api/pod/util.go`` builds the validation options
        ``AllowContainerRestartPolicyRules`` and ``AllowRestartAllContainers`` from the gates). The wording of that
        message is this model's: the field path and "Forbidden", not the API server's exact text.
        """
        spec = obj.get("spec") or {}
        if plural == "jobsets" and (spec.get("failurePolicy") or {}).get("restartStrategy") == "InPlaceRestart":
            denied = 'admission webhook "vjobset.kb.io" denied the request: '
            if not self.gates["InPlaceRestart"]:
                return 403, denied + in_place.GATE_OFF_MESSAGE
            errors = []
            for i, rjob in enumerate(spec.get("replicatedJobs") or []):
                job, where = rjob["template"]["spec"], f"spec.replicatedJobs[{i}].template.spec"
                if job.get("backoffLimit") != in_place.BACKOFF_LIMIT:
                    limit = in_place.BACKOFF_LIMIT
                    errors.append(f"{where}.backoffLimit: Invalid value: replicatedJob {rjob['name']}: must be set "
                                  f"to {limit} (MaxInt32) when in-place restart is enabled")  # fmt: skip
                if job.get("podReplacementPolicy") != "Failed":
                    errors.append(f"{where}.podReplacementPolicy: Invalid value: replicatedJob {rjob['name']}: must "
                                  "be set to Failed when in-place restart is enabled")  # fmt: skip
                if job.get("completions") is None or job.get("completions") != job.get("parallelism"):
                    errors.append(f"{where}.completions: Invalid value: replicatedJob {rjob['name']}: completions "
                                  "and parallelism must be set and equal to each other when in-place restart is "
                                  "enabled")  # fmt: skip
            return (403, denied + "[" + ", ".join(errors) + "]") if errors else None
        if plural in ("pods", "jobs") and not self.gates["RestartAllContainers"]:
            pod = spec.get("template", {}).get("spec", {}) if plural == "jobs" else spec
            prefix = "spec.template.spec" if plural == "jobs" else "spec"
            for field in ("initContainers", "containers"):
                for i, container in enumerate(pod.get(field) or []):
                    if container.get("restartPolicyRules"):
                        kind = "Job.batch" if plural == "jobs" else "Pod"
                        name = obj.get("metadata", {}).get("name") or obj.get("metadata", {}).get("generateName", "")
                        return 422, (f'{kind} "{name}" is invalid: {prefix}.{field}[{i}].restartPolicyRules: '
                                     "Forbidden: not allowed while the ContainerRestartRules and "
                                     "RestartAllContainersOnContainerExits feature gates are disabled")  # fmt: skip
        return None

    def _now(self) -> str:
        """The kubelet's clock for container states: one second later at each call (order without sleeping)."""
        self._clock += datetime.timedelta(seconds=1)
        return self._clock.strftime("%Y-%m-%dT%H:%M:%SZ")

    def _pod(self, name: str) -> dict[str, Any]:
        """The pod as stored, raw: the official client 30's models predate ``restartPolicyRules`` and drop it."""
        return json.loads(self.core.read_namespaced_pod(name, self.ns, _preload_content=False).data)

    def in_place_pods(self, jobset: str, slices: int, hosts: int, pools: list[str]) -> list[str]:
        """The JobSet and Job controllers create the pods of an ``InPlaceRestart`` JobSet (names and labels as
        :meth:`pods`, the pod spec from the JobSet's template), the kubelet runs them (the agent sidecar started,
        the trainer running) and each agent annotates its pod (:meth:`agent_starts`); then the controller lifts the
        barrier (:meth:`in_place_reconcile`)."""
        js = self.jobset(jobset)
        template = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        names_ = self.pods(jobset, slices, hosts, pools=pools)
        for name in names_:
            spec = {**copy.deepcopy(template), "nodeName": self._pod(name)["spec"]["nodeName"]}
            self.core.patch_namespaced_pod(name, self.ns, {"spec": spec})
            started = self._now()
            self.pod_status(name, {
                "phase": "Running",
                "initContainerStatuses": [{"name": c["name"], "ready": True, "restartCount": 0, "image": c["image"],
                                           "imageID": "", "started": True, "state": {"running": {"startedAt": started}}}
                                          for c in spec.get("initContainers", [])],
                "containerStatuses": [{"name": c["name"], "ready": True, "restartCount": 0, "image": c["image"],
                                       "imageID": "", "started": True, "state": {"running": {"startedAt": started}}}
                                      for c in spec["containers"]],
            })  # fmt: skip
            self.agent_starts(jobset, name)
        self.in_place_reconcile(jobset)
        return names_

    def agent_starts(self, jobset: str, pod: str) -> int:
        """The agent of ``pod`` starts (``cmd/in-place-restart-agent/main.go``, ``Reconcile``, start-up): it sets
        the pod's annotation ``jobset.sigs.k8s.io/in-place-restart-attempt`` to 0 when the JobSet has no
        ``status.currentInPlaceRestartAttempt`` yet, else to that + 1 (it waits at the barrier until the controller
        catches up). Returns the attempt."""
        current = (self.jobset(jobset).get("status") or {}).get("currentInPlaceRestartAttempt")
        attempt = 0 if current is None else int(current) + 1
        self.core.patch_namespaced_pod(pod, self.ns, {"metadata": {"annotations": {
            in_place.ATTEMPT_ANNOTATION: str(attempt)}}})  # fmt: skip
        return attempt

    def in_place_reconcile(self, jobset: str) -> str:
        """The JobSet controller's ``reconcileInPlaceRestart`` (``pkg/controllers/in_place_restart.go``), once:

        fail the JobSet (``ReachedMaxRestarts``) when any container's ``restartCount`` exceeds ``maxRestarts``
        (``getMaxContainerRestartCount``) or when the highest pod attempt, less the restarts that do not count
        (``status.restarts - status.restartsCountTowardsMax``), does (``exceededMaxRestarts``); else, when every pod
        (not Failed, annotated) is at the same attempt and they are all there (replicas x parallelism), set
        ``status.currentInPlaceRestartAttempt`` to it (the agents lift their barriers); else, unless there is no
        attempt or the highest is 0, set ``status.previousInPlaceRestartAttempt`` to the highest - 1, never lowering
        it (the agents of pods at or below it restart their pods in place). Returns what it did: ``failed``,
        ``current``, ``previous`` or ``nothing``.
        """
        js = self.jobset(jobset)
        status, policy = js.get("status") or {}, js["spec"]["failurePolicy"]
        found = [self._pod(p.metadata.name) for p in self.core.list_namespaced_pod(
            self.ns, label_selector=f"{names.JOBSET_NAME_KEY}={jobset}").items]  # fmt: skip
        statuses = [c for pod in found for key in ("initContainerStatuses", "containerStatuses")
                    for c in pod["status"].get(key, [])]  # fmt: skip
        counts = [c.get("restartCount", 0) for c in statuses]
        attempts = [int(pod["metadata"]["annotations"][in_place.ATTEMPT_ANNOTATION]) for pod in found
                    if pod["status"].get("phase") != "Failed"
                    and in_place.ATTEMPT_ANNOTATION in (pod["metadata"].get("annotations") or {})]  # fmt: skip
        uncounted = int(status.get("restarts", 0)) - int(status.get("restartsCountTowardsMax", 0))
        if (
            max(counts, default=0) > policy["maxRestarts"]
            or max(attempts, default=0) - uncounted > policy["maxRestarts"]
        ):
            self.jobset_done(
                jobset, "Failed", "ReachedMaxRestarts", "jobset failed due to reaching max number of restarts"
            )
            return "failed"
        total = sum(r["replicas"] * r["template"]["spec"]["parallelism"] for r in js["spec"]["replicatedJobs"])
        if len(attempts) == total and len(set(attempts)) == 1:
            if status.get("currentInPlaceRestartAttempt") != attempts[0]:
                self.patch_jobset(jobset, {"status": {"currentInPlaceRestartAttempt": attempts[0]}}, status=True)
            return "current"
        if not attempts or max(attempts) == 0:
            return "nothing"
        previous = max(attempts) - 1
        if (
            status.get("previousInPlaceRestartAttempt") is not None
            and previous <= status["previousInPlaceRestartAttempt"]
        ):
            return "nothing"
        self.patch_jobset(jobset, {"status": {"previousInPlaceRestartAttempt": previous}}, status=True)
        return "previous"

    def container_exits(self, pod: str, container: str, exit_code: int, reason: str = "Error") -> str:
        """The kubelet on ``container`` of ``pod`` exiting with ``exit_code``: the first of the container's
        ``restartPolicyRules`` whose ``exitCodes`` match decides (KEP-5307). ``RestartAllContainers`` (KEP-5532):
        every container of the pod is stopped and started again in the same pod (same name, node and UID), each
        status keeping the run that ended as ``lastState.terminated`` (the exiting one with its code, the others
        stopped by the kubelet, 137) and ``restartCount`` one higher; the log the API serves is the new container's
        (the old one's leaves it, open follows end). No rule matched (``restartPolicy: Never``): the container stays
        terminated and the pod fails. Returns ``restarted`` or ``failed``."""
        body = self._pod(pod)
        spec = body["spec"]
        rules = next(c.get("restartPolicyRules") or [] for c in [*spec.get("initContainers", []), *spec["containers"]]
                     if c["name"] == container)  # fmt: skip
        action = None
        for rule in rules:
            codes = rule["exitCodes"]
            if (exit_code in codes["values"]) == (codes["operator"] == "In"):
                action = rule["action"]
                break
        ended = self._now()
        status = body["status"]
        if action != "RestartAllContainers":
            for entry in status["containerStatuses"]:
                if entry["name"] == container:
                    entry["state"] = {"terminated": {"exitCode": exit_code, "reason": reason, "finishedAt": ended}}
            self.pod_status(pod, {"phase": "Failed", "containerStatuses": status["containerStatuses"]})
            return "failed"
        self.cluster.rotate_log(self.ns, pod)
        started = self._now()
        for key in ("initContainerStatuses", "containerStatuses"):
            for entry in status.get(key, []):
                code, why = (exit_code, reason) if entry["name"] == container else (137, "Error")
                entry["lastState"] = {"terminated": {"exitCode": code, "reason": why, "finishedAt": ended}}
                entry["restartCount"] = entry.get("restartCount", 0) + 1
                entry["state"] = {"running": {"startedAt": started}}
        self.pod_status(pod, {"phase": "Running", "initContainerStatuses": status.get("initContainerStatuses", []),
                              "containerStatuses": status["containerStatuses"]})  # fmt: skip
        return "restarted"

    def in_place_restart(self, jobset: str, failed: str, exit_code: int, reason: str = "Error") -> int:
        """One in-place restart of the whole JobSet as the pieces above play it: the trainer of pod ``failed`` exits
        with ``exit_code``; the kubelet restarts its pod in place and its agent announces the next attempt; the
        controller marks the older attempt (``previousInPlaceRestartAttempt``); every other pod's agent, at or below
        it, exits with its in-place exit code 1 (``DefaultInPlaceRestartExitCode``), which its rule
        ``RestartAllContainers`` on non-zero turns into an in-place restart of that pod, and announces the attempt
        too; the controller, all pods agreeing, sets ``currentInPlaceRestartAttempt`` and the barriers lift.
        Returns the new attempt (the JobSet failed instead when the controller said so)."""
        assert self.container_exits(failed, names.TRAINER_CONTAINER, exit_code, reason) == "restarted"
        attempt = self.agent_starts(jobset, failed)
        if self.in_place_reconcile(jobset) == "failed":
            return attempt
        previous = self.jobset(jobset)["status"]["previousInPlaceRestartAttempt"]
        for pod in self.core.list_namespaced_pod(self.ns, label_selector=f"{names.JOBSET_NAME_KEY}={jobset}").items:
            name = pod.metadata.name
            if name != failed and int(pod.metadata.annotations[in_place.ATTEMPT_ANNOTATION]) <= previous:
                assert self.container_exits(name, in_place.AGENT_CONTAINER, 1) == "restarted"
                self.agent_starts(jobset, name)
        self.in_place_reconcile(jobset)
        return attempt


class KubeRay:
    """Plays Kueue's RayJob integration, KubeRay's RayJob and RayCluster controllers, the Job controller, the
    kubelet and the garbage collector for one RayJob, through the API (as :class:`Play` does for a JobSet).

    Names as KubeRay v1.7.0 makes them: the RayCluster ``<rayjob>-<5 random>`` (``utils.GenerateRayClusterName``),
    the submitter Job named as the RayJob, its pod labelled ``job-name``; the Workload ``rayjob-<name>-<hash>``
    (Kueue ``GetWorkloadNameForRayJob``). What it does not model is listed in docs/testing.md.
    """

    def __init__(self, play: Play, name: str, slices: int, hosts: int, pools: list[str]):
        self.play, self.name, self.slices, self.hosts, self.pools = play, name, slices, hosts, pools
        self.cluster = f"{name}-x7k2p"
        self.workload = f"rayjob-{name}-1a2b3"
        self.submitter_pod = f"{name}-sbm4t"
        self.replaced: dict[tuple[int, int], int] = {}  # (slice, host) -> pods KubeRay created for it so far
        self.refused: set[str] = set()  # worker pods whose sandbox DRANET refused (_dranet_refuses)

    def rayjob(self) -> dict[str, Any]:
        """Wait for the RayJob to exist; returns it."""
        play = self.play

        def get() -> Any:
            found = play.custom.list_namespaced_custom_object(
                "ray.io", "v1", play.ns, "rayjobs", field_selector=f"metadata.name={self.name}"
            )
            return found["items"][0] if found["items"] else None

        return wait_until(get, what=f"RayJob {self.name}")

    def patch(self, body: dict[str, Any], status: bool = False) -> dict[str, Any]:
        """Merge-patch the RayJob (its status subresource when ``status``)."""
        play = self.play
        patch = (
            play.custom.patch_namespaced_custom_object_status if status else play.custom.patch_namespaced_custom_object
        )
        return patch("ray.io", "v1", play.ns, "rayjobs", self.name, body)

    def _owner(self, obj: dict[str, Any]) -> dict[str, Any]:
        return {"apiVersion": "ray.io/v1", "kind": obj["kind"], "name": obj["metadata"]["name"],
                "uid": obj["metadata"]["uid"], "controller": True}  # fmt: skip

    def kueue_queues(self, message: str = "waiting", reason: str = "Pending") -> None:
        """Kueue's RayJob webhook suspends it; its controller creates a pending Workload owned by it."""
        found = self.rayjob()
        self.patch({"spec": {"suspend": True}})
        self.patch({"status": {"jobDeploymentStatus": "Suspended"}}, status=True)
        self.play._pending_workload(found, self.workload, "ray.io/v1", message, reason)

    def kueue_admits(self) -> str | None:
        """Kueue's scheduler on the RayJob's Workload (:class:`tests.kueue_model.Kueue`): QuotaReserved and Admitted,
        the RayJob unsuspended (KubeRay moves it to Initializing), and None; or, when Kueue cannot admit it (a pod set
        whose resource no resource group covers, an unmapped DRA DeviceClass ...), the Workload left pending with
        Kueue's condition and its message returned."""
        message = self.play._admit_workload(self.workload)
        if message is None:
            self.patch({"spec": {"suspend": False}})
            self.patch({"status": {"jobDeploymentStatus": "Initializing", "rayClusterName": self.cluster}}, status=True)
        return message

    def _pod(self, name: str, labels: dict[str, str], container: str, node: str | None, phase: str,
             template: dict[str, Any] | None = None) -> None:  # fmt: skip
        play = self.play
        spec: dict[str, Any] = {"containers": [{"name": container, "image": "trainer"}]}
        for key in ("hostNetwork", "dnsPolicy", "resourceClaims"):  # what DRANET's rule reads
            if template and key in template:
                spec[key] = copy.deepcopy(template[key])
        if node:
            spec["nodeName"] = node
        body = {"metadata": {"name": name, "namespace": play.ns, "labels": labels}, "spec": spec,
                "status": {"phase": phase}}  # fmt: skip
        play.core.create_namespaced_pod(play.ns, body)

    def _dranet_refuses(self, spec: dict[str, Any]) -> bool:
        """Whether GKE's DRANET driver refuses the pod's sandbox: a ``hostNetwork`` pod that claims a device of
        DRANET's class. DRANET's NRI hook ``RunPodSandbox`` fails for a pod with devices prepared for it whose
        sandbox has no network namespace of its own ("using host network can not claim host devices", google/dranet
        ``pkg/driver/nri_hooks.go``, ``runPodSandbox``). The emulator allocates no claim, so a claim whose template
        asks DRANET's DeviceClass stands for the allocated device."""
        if not spec.get("hostNetwork"):
            return False
        play = self.play
        for claim in spec.get("resourceClaims") or []:
            template = play.custom.get_namespaced_custom_object(
                "resource.k8s.io", "v1", play.ns, "resourceclaimtemplates", claim["resourceClaimTemplateName"]
            )
            requests = template["spec"]["spec"]["devices"]["requests"]
            if any(r.get("exactly", {}).get("deviceClassName") == DRANET_DEVICE_CLASS for r in requests):
                return True
        return False

    def worker_name(self, slice_index: int, host: int) -> str:
        """The current worker pod of ``(slice, host)``."""
        return f"{self.cluster}-slice-worker-{slice_index}-{host}-r{self.replaced.get((slice_index, host), 0)}"

    def _worker(self, slice_index: int, host: int) -> str:
        """A worker pod from the RayJob's worker template, Running; or, when DRANET refuses its sandbox
        (:meth:`_dranet_refuses`), Pending in ``ContainerCreating`` with the kubelet's ``FailedCreatePodSandBox``
        event ("Failed to create pod sandbox: %v", kubernetes ``pkg/kubelet/kuberuntime/kuberuntime_manager.go``)
        carrying DRANET's error, as it stays on a cluster (the kubelet retries the sandbox, DRANET refuses again)."""
        name = self.worker_name(slice_index, host)
        labels = {"ray.io/cluster": self.cluster, "ray.io/node-type": "worker", "ray.io/group": "slice",
                  "ray.io/is-ray-node": "yes", "ray.io/worker-group-replica-index": str(slice_index),
                  "ray.io/worker-group-replica-name": f"{self.cluster}-slice-{slice_index}",
                  "ray.io/replica-host-index": str(host)}  # fmt: skip
        template = self.rayjob()["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]
        refused = self._dranet_refuses(template)
        node = f"gke-{self.pools[slice_index]}-{host}"
        self._pod(name, labels, "ray-worker", node, "Pending" if refused else "Running", template)
        if refused:
            self.refused.add(name)
            self.play.pod_status(name, {"phase": "Pending", "conditions": [
                {"type": "PodScheduled", "status": "True"}], "containerStatuses": [
                {"name": "ray-worker", "ready": False, "restartCount": 0, "image": "trainer", "imageID": "",
                 "state": {"waiting": {"reason": "ContainerCreating"}}}]})  # fmt: skip
            self.play.event(name, "FailedCreatePodSandBox", "Failed to create pod sandbox: rpc error: code = Unknown "
                            f"desc = RunPodSandbox pod {self.play.ns}/{name} using host network can not claim host "
                            "devices")  # fmt: skip
        return name

    def starts(self) -> list[str]:
        """The RayCluster (owned by the RayJob), its head and worker pods (replicas x numOfHosts) Running, the
        submitter Job and its pod Running; the RayJob Running. Returns the worker pod names.

        When DRANET refuses the workers' sandboxes (:meth:`_worker`), they stay Pending, the RayCluster is not ready
        and there is no submitter: KubeRay's RayJob stays ``Initializing`` with the cluster's status until its state is
        ``ready`` (``ray-operator/controllers/ray/rayjob_controller.go``, ``JobDeploymentStatusInitializing``)."""
        play, found = self.play, self.rayjob()
        cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster",
                   "metadata": {"name": self.cluster, "namespace": play.ns, "ownerReferences": [self._owner(found)],
                                "labels": {"ray.io/originated-from-cr-name": self.name,
                                           "ray.io/originated-from-crd": "RayJob"}},
                   "spec": found["spec"]["rayClusterSpec"]}  # fmt: skip
        play.custom.create_namespaced_custom_object("ray.io", "v1", play.ns, "rayclusters", cluster)
        self._pod(f"{self.cluster}-head", {"ray.io/cluster": self.cluster, "ray.io/node-type": "head"},
                  "ray-head", "gke-cpu-0", "Running")  # fmt: skip
        workers = [self._worker(j, h) for j in range(self.slices) for h in range(self.hosts)]
        count = self.slices * self.hosts
        running = len(set(workers) - self.refused)
        if running < count:  # a worker never starts: the RayCluster is not ready, so KubeRay submits nothing
            self.patch({"status": {"rayClusterName": self.cluster, "rayClusterStatus": {
                "readyWorkerReplicas": running, "desiredWorkerReplicas": count}}}, status=True)  # fmt: skip
            return workers
        job = {"metadata": {"name": self.name, "namespace": play.ns, "ownerReferences": [self._owner(found)],
                            "labels": {"ray.io/originated-from-cr-name": self.name}},
               "spec": {"backoffLimit": 2, "template": {"spec": {"restartPolicy": "Never",
                        "containers": [{"name": "ray-job-submitter", "image": "trainer"}]}}}}  # fmt: skip
        play.batch.create_namespaced_job(play.ns, job)
        self._pod(self.submitter_pod, {"job-name": self.name}, "ray-job-submitter", "gke-cpu-0", "Running")
        self.patch({"status": {
            "jobDeploymentStatus": "Running", "jobStatus": "RUNNING", "rayClusterName": self.cluster,
            "rayClusterStatus": {"state": "ready", "readyWorkerReplicas": count, "availableWorkerReplicas": count,
                                 "desiredWorkerReplicas": count},
        }}, status=True)  # fmt: skip
        return workers

    def driver_logs(self, text: str) -> None:
        """Lines the submitter pod prints (``ray job submit`` tailing the driver's and its workers' output)."""
        self.play.log(self.submitter_pod, text)

    def submitter_retried(self) -> str:
        """The submitter pod fails (its node went away) and the Job controller starts another (Running); its name.

        KubeRay's retried submitter runs ``ray job logs --follow``, which prints the Ray job's log from its start:
        the new pod's log begins with every line the old one had.
        """
        old = self.submitter_pod
        self.play.pod_status(old, {"phase": "Failed"})
        self.submitter_pod = f"{self.name}-sbm5u"
        self._pod(self.submitter_pod, {"job-name": self.name}, "ray-job-submitter", "gke-cpu-0", "Running")
        with self.play.cluster.log_lock:
            replay = "".join(line for _, line in self.play.cluster.logs.get((self.play.ns, old), []))
        self.driver_logs(replay)
        return self.submitter_pod

    def worker_killed(self, slice_index: int, host: int, exit_code: int = 137) -> str:
        """The worker pod of ``(slice, host)`` fails (its container killed); returns its name."""
        name = self.worker_name(slice_index, host)
        terminated = {"name": "ray-worker", "ready": False, "restartCount": 0, "image": "t", "imageID": "",
                      "state": {"terminated": {"exitCode": exit_code, "reason": "Error"}}}  # fmt: skip
        self.play.pod_status(name, {"phase": "Failed", "containerStatuses": [terminated]})
        return name

    def worker_replaced(self, slice_index: int, host: int) -> str:
        """KubeRay deletes the failed worker pod and creates a new one for the replica (Running); its name."""
        self.play.core.delete_namespaced_pod(self.worker_name(slice_index, host), self.play.ns)
        self.replaced[(slice_index, host)] = self.replaced.get((slice_index, host), 0) + 1
        return self._worker(slice_index, host)

    def job_ends(self, job_status: str, message: str = "", reason: str = "") -> None:
        """The Ray job ends: the submitter pod finishes, the RayJob reaches Complete (SUCCEEDED) or, when the Ray job
        FAILED, Failed with reason AppFailed (rayjob_controller.go)."""
        ok = job_status == "SUCCEEDED"
        if self.play.core.list_namespaced_pod(self.play.ns, label_selector=f"job-name={self.name}").items:
            self.play.pod_status(self.submitter_pod, {"phase": "Succeeded" if ok else "Failed"})
        deployment = "Complete" if job_status in ("SUCCEEDED", "STOPPED") else "Failed"
        status = {"jobStatus": job_status, "jobDeploymentStatus": deployment, "message": message}
        if deployment == "Failed":
            status["reason"] = reason or "AppFailed"
        self.patch({"status": status}, status=True)

    def kueue_evicts(self, message: str) -> None:
        """Kueue evicts the Workload and suspends the RayJob; KubeRay (``Suspending``) deletes the RayCluster with its
        pods and the submitter Job with its pod, clears ``rayClusterName`` and reaches ``Suspended``."""
        play = self.play
        status = {"conditions": [
            {"type": "Evicted", "status": "True", "reason": "Preempted", "message": message},
            {"type": "Admitted", "status": "False", "reason": "NoReservation", "message": "evicted"},
        ]}  # fmt: skip
        play.custom.patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, play.ns, "workloads", self.workload, {"status": status}
        )
        self.patch({"spec": {"suspend": True}})
        self._cluster_gone()
        self.patch({"status": {"jobDeploymentStatus": "Suspended", "jobStatus": "", "rayClusterName": "",
                               "rayClusterStatus": {}}}, status=True)  # fmt: skip
        self.cluster = f"{self.name}-y8m3q"  # the next admission's RayCluster (GenerateRayClusterName again)
        self.submitter_pod = f"{self.name}-sbm6v"

    def _cluster_gone(self) -> None:
        play = self.play
        play.custom.delete_namespaced_custom_object("ray.io", "v1", play.ns, "rayclusters", self.cluster)
        for pod in play.core.list_namespaced_pod(play.ns, label_selector=f"ray.io/cluster={self.cluster}").items:
            play.core.delete_namespaced_pod(pod.metadata.name, play.ns)
        play.batch.delete_namespaced_job(self.name, play.ns)
        for pod in play.core.list_namespaced_pod(play.ns, label_selector=f"job-name={self.name}").items:
            play.core.delete_namespaced_pod(pod.metadata.name, play.ns)

    def garbage_collected(self) -> None:
        """Once the RayJob is gone, what it owned goes: the RayCluster and its pods, the submitter Job and its pod,
        Kueue's Workload (the garbage collector's part; KubeRay's finalizer is not modelled)."""
        play = self.play

        def gone() -> bool:
            found = play.custom.list_namespaced_custom_object(
                "ray.io", "v1", play.ns, "rayjobs", field_selector=f"metadata.name={self.name}"
            )
            return not found["items"]

        wait_until(gone, what=f"RayJob {self.name} deleted")
        self._cluster_gone()
        play.custom.delete_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, play.ns, "workloads", self.workload)


def step_line(step: int, loss: float, seconds: float = 2.0) -> str:
    """One MaxText step log line as the leader prints it."""
    return (
        f"I1122 10:00:00.000000 1 metric_logger.py:214] completed step: {step}, seconds: {seconds:.3f}, "
        f"TFLOP/s/device: 100.000, Tokens/s/device: 2000.000, total_weights: 65536, loss: {loss:.3f}\n"
    )


def worker_start_line(process: int = 0, slice_index: int = 0, host: int = 0, processes: int = 8) -> str:
    """The training worker's first line (multislice/trainer/worker.py, ``main``): a new attempt's leader log."""
    return f"multislice worker: process {process} (slice {slice_index}, host {host}) of {processes}\n"


def restore_lines(step: int | None, tier: str | None = None, slice_id: int = 1, directory: str = "") -> str:
    """The leader's lines as a training attempt looks for the stage's checkpoint, as MaxText 0.2.5 and Orbax log them.

    ``step`` None: none found (``maxtext/common/checkpointing.py``, ``load_state_if_possible``: ``No existing
    checkpoints found, not restoring checkpoint.``). Otherwise MaxText's ``restoring from this run's directory step
    N``, and with emergency checkpoints (``tier``) Orbax's emergency ``CheckpointManager.restore`` line, which every
    process logs (``orbax/checkpoint/experimental/emergency/checkpoint_manager.py``, orbax-checkpoint 0.12.8:
    ``_restore_from_local`` names the replica ``slice_id`` holding the step, ``_restore_from_persistent`` the
    persistent ``directory``), in absl's format.
    """
    prefix = "I1122 10:00:00.000000 1"
    if step is None:
        return f"{prefix} checkpointing.py:803] No existing checkpoints found, not restoring checkpoint.\n"
    text = (
        f"{prefix} checkpointing.py:701] checkpoint manager exists so trying to load this run's existing checkpoint\n"
        f"{prefix} checkpointing.py:705] restoring from this run's directory step {step}\n"
    )
    if tier == "local":
        text += (
            f"{prefix} checkpoint_manager.py:887] emergency.CheckpointManager: restoring step={step} from local "
            f"checkpoint using slice_id: {slice_id}\n"
        )
    elif tier == "persistent":
        text += (
            f"{prefix} checkpoint_manager.py:1083] emergency.CheckpointManager: restoring step={step} from persistent "
            f"checkpoint in directory={directory}\n"
        )
    return text


def verification_report(verdict: str = "PASS") -> dict[str, Any]:
    """A checkpoint verifier's report (``multislice/trainer/verify.py``, ``verify``) with one check."""
    return {"verdict": verdict, "latest_step": 199, "parameter_count": 8030261248, "written_mesh": "fsdp=4",
            "checks": [{"name": "latest_step", "passed": verdict == "PASS", "detail": "step 199"}]}  # fmt: skip


def verifier_log(verdict: str = "PASS") -> str:
    """The verifier Job's log (``python -m multislice.trainer.verify``): noise, then its report last."""
    return "WARNING: jax on cpu\n" + json.dumps(verification_report(verdict), indent=1) + "\n"


def verification_line(verdict: str = "PASS") -> str:
    """What the verify-and-export Job's pod prints when its verification is done
    (``multislice/trainer/verify_export.py``, ``main``): noise, then the marker line."""
    return "WARNING: jax on cpu\n" + verify_export.MARKER + json.dumps(verification_report(verdict)) + "\n"


def verify_export_end(verdict: str = "PASS", export: dict[str, Any] | None = None) -> str:
    """The rest of the verify-and-export Job's log: the export's noise when it ran, then the last document with
    both reports (``export`` None: the verdict was not PASS, nothing exported)."""
    noise = "converting layer group 0\n" if export is not None else ""
    return noise + json.dumps({"verification": verification_report(verdict), "export": export}, indent=1) + "\n"
