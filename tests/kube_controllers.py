"""Test support: the parts of a GKE cluster the tests play, acting through the Kubernetes API over HTTP.

Kueue (suspends the JobSet, creates its Workload, sets QuotaReserved /
Admitted / Evicted and unsuspends), the JobSet and Job controllers and the
kubelet (pods through phases, container states, exit codes, logs, events,
JobSet conditions and restarts), GKE (nodes labelled with their node pool and
TPU shape) and the installed CRDs (the upstream files in multislice/crds).
"""

from __future__ import annotations

import copy
import functools
import json
from pathlib import Path
from typing import Any

import yaml
from kubernetes import client as k8s

from multislice import names, tpu
from multislice.backends.gke.client import JOBSET_GROUP, JOBSET_PLURAL, JOBSET_VERSION, KUEUE_GROUP, KUEUE_VERSION
from tests.kube_cluster import Served, wait_until

CRDS = Path(__file__).resolve().parents[1] / "multislice" / "crds"


@functools.cache
def upstream_crds() -> list[dict[str, Any]]:
    """The CRDs in multislice/crds (JobSet v0.12.0, Kueue v0.19.2), schemas dropped (the emulator ignores them)."""
    found = []
    for path in sorted(CRDS.glob("*/*.yaml")):
        crd = yaml.load(path.read_text(encoding="utf-8"), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        if crd.get("kind") == "CustomResourceDefinition":
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

    # -- installation ------------------------------------------------------

    def install_crds(self, skip: tuple[str, ...] = ()) -> None:
        """Create the upstream JobSet and Kueue CRDs, established, except the names in ``skip``."""
        for crd in upstream_crds():
            if crd["metadata"]["name"] in skip:
                continue
            crd = copy.deepcopy(crd)
            crd["status"] = {"conditions": [{"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                                             "message": "accepted"}]}  # fmt: skip
            self.crds.create_custom_resource_definition(crd)

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
        owner = {"apiVersion": f"{JOBSET_GROUP}/{JOBSET_VERSION}", "kind": "JobSet", "name": jobset,
                 "uid": js["metadata"]["uid"], "controller": True}  # fmt: skip
        workload = {
            "apiVersion": f"{KUEUE_GROUP}/{KUEUE_VERSION}", "kind": "Workload",
            "metadata": {"name": self.workload_name(jobset), "namespace": self.ns, "ownerReferences": [owner]},
            "spec": {"queueName": js["metadata"]["labels"][names.KUEUE_QUEUE_LABEL]},
            "status": {"conditions": [{"type": "QuotaReserved", "status": "False", "reason": reason,
                                       "message": message}]},
        }  # fmt: skip
        self.custom.create_namespaced_custom_object(KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", workload)

    def kueue_admits(
        self, jobset: str, cluster_queue: str = "multislice-cluster-queue", flavor: str = "v6e-4x4"
    ) -> None:
        """QuotaReserved and Admitted; the JobSet is unsuspended."""
        status = {
            "conditions": [
                {"type": "QuotaReserved", "status": "True", "reason": "QuotaReserved", "message": "reserved"},
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": "admitted"},
            ],
            "admission": {"clusterQueue": cluster_queue,
                          "podSetAssignments": [{"name": "slice", "flavors": {tpu.TPU_RESOURCE: flavor}}]},
        }  # fmt: skip
        self.custom.patch_namespaced_custom_object_status(
            KUEUE_GROUP, KUEUE_VERSION, self.ns, "workloads", self.workload_name(jobset), {"status": status}
        )
        self.patch_jobset(jobset, {"spec": {"suspend": False}})

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

    # -- JobSet, Job controllers and the kubelet -----------------------------

    def pod_name(self, jobset: str, slice_index: int, host: int, attempt: int = 0) -> str:
        return f"{names.pod_hostname(jobset, slice_index, host)}-a{attempt}bcd"

    def pods(
        self, jobset: str, slices: int, hosts: int, *, attempt: int = 0, phase: str = "Running",
        pools: list[str] | None = None, status: dict[str, Any] | None = None,
    ) -> list[str]:  # fmt: skip
        """Create the JobSet's pods of one restart attempt, on node pool ``pools[slice]`` (unscheduled if None)."""
        created = []
        for j in range(slices):
            for h in range(hosts):
                name = self.pod_name(jobset, j, h, attempt)
                labels = {names.JOBSET_NAME_KEY: jobset, names.JOB_INDEX_KEY: str(j),
                          names.RESTART_ATTEMPT_KEY: str(attempt), names.JOB_COMPLETION_INDEX_KEY: str(h)}  # fmt: skip
                spec: dict[str, Any] = {"containers": [{"name": names.TRAINER_CONTAINER, "image": "trainer"}]}
                if pools:
                    spec["nodeName"] = f"gke-{pools[j]}-{h}"
                body = {"metadata": {"name": name, "namespace": self.ns, "labels": labels}, "spec": spec,
                        "status": status or {"phase": phase}}  # fmt: skip
                self.core.create_namespaced_pod(self.ns, body)
                created.append(name)
        return created

    def pod_status(self, name: str, status: dict[str, Any]) -> None:
        self.core.patch_namespaced_pod_status(name, self.ns, {"status": status})

    def event(self, pod: str, reason: str, message: str, kind: str = "Warning", involved: str = "Pod") -> None:
        """An event on object ``pod`` of kind ``involved`` (a Pod, a JobSet, a Job)."""
        body = {"metadata": {"name": f"{pod}.{reason.lower()}", "namespace": self.ns},
                "involvedObject": {"kind": involved, "name": pod, "namespace": self.ns},
                "reason": reason, "message": message, "type": kind}  # fmt: skip
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


def step_line(step: int, loss: float, seconds: float = 2.0) -> str:
    """One MaxText step log line as the leader prints it."""
    return (
        f"I1122 10:00:00.000000 1 metric_logger.py:214] completed step: {step}, seconds: {seconds:.3f}, "
        f"TFLOP/s/device: 100.000, Tokens/s/device: 2000.000, total_weights: 65536, loss: {loss:.3f}\n"
    )


def verifier_log(verdict: str = "PASS") -> str:
    report = {"verdict": verdict, "latest_step": 199, "parameter_count": 8030261248, "written_mesh": "fsdp=4",
              "checks": [{"name": "latest_step", "passed": verdict == "PASS", "detail": "step 199"}]}  # fmt: skip
    return "WARNING: jax on cpu\n" + json.dumps(report, indent=1) + "\n"
