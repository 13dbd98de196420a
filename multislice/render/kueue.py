"""Render the Kueue objects a multislice run is admitted through (``kueue.x-k8s.io/v1beta2``).

As in the JobSet project's TPU multislice example
(kubernetes-sigs/jobset ``site/static/examples/tpu-multislice/kueue-config.yaml``)
and GKE's tutorial
(https://cloud.google.com/kubernetes-engine/docs/tutorials/tpu-multislice-kueue):

- a ResourceFlavor selecting the slice's TPU nodes by accelerator and topology labels;
- a ClusterQueue covering ``google.com/tpu`` with a nominal quota of
  ``slices x chips per slice``, so that Kueue admits a JobSet only when all of
  its slices fit at once (all-or-nothing admission);
- a LocalQueue in the run's namespace, named by the JobSet's
  ``kueue.x-k8s.io/queue-name`` label;
- a WorkloadPriorityClass, named by the ``kueue.x-k8s.io/priority-class`` label.

With ``node_pools.queued_provisioning`` (flex-start pools that grow only for
ProvisioningRequests), also, as xpk renders them (``src/xpk/core/kueue_manager.py``
and its Kueue templates) and GKE's queued-provisioning guide
(https://cloud.google.com/kubernetes-engine/docs/how-to/provisioningrequest):

- a ProvisioningRequestConfig with ``provisioningClassName:
  queued-provisioning.gke.io``, managing ``google.com/tpu``, whose pod-set
  update pins the pods to the nodes GKE created for the request (node selector
  ``autoscaling.gke.io/provisioning-request`` from the class detail
  ``ResizeRequestName``);
- an AdmissionCheck of Kueue's ProvisioningRequest controller
  (``kueue.x-k8s.io/provisioning-request``) with that config as parameters;
- the ClusterQueue listing it in ``admissionChecksStrategy`` (v1beta2 dropped
  ``spec.admissionChecks``), so Kueue admits a Workload only once its
  ProvisioningRequest is Provisioned.

Kueue v0.19 serves v1beta2 (storage) and v1beta1 (deprecated); v1beta2
renamed ``ClusterQueue.spec.cohort`` to ``cohortName``.
"""

from __future__ import annotations

from typing import Any

from multislice import names, tpu
from multislice.plan import Plan

API_VERSION = "kueue.x-k8s.io/v1beta2"
#: GKE's ProvisioningRequest class for flex-start with queued provisioning.
QUEUED_PROVISIONING_CLASS = "queued-provisioning.gke.io"
#: The controller name of Kueue's built-in ProvisioningRequest admission check.
PROVISIONING_CONTROLLER = "kueue.x-k8s.io/provisioning-request"
#: The node label GKE puts on the nodes of one ProvisioningRequest (xpk's ProvisioningRequestConfig template).
PROVISIONING_REQUEST_NODE_LABEL = "autoscaling.gke.io/provisioning-request"


def admission_check_name(cluster_queue: str) -> str:
    """The AdmissionCheck of a ClusterQueue whose nodes come from queued provisioning: ``<cluster_queue>-dws``."""
    return f"{cluster_queue}-dws"


def provisioning_config_name(cluster_queue: str) -> str:
    """The ProvisioningRequestConfig the AdmissionCheck names: ``<cluster_queue>-dws-config``."""
    return f"{cluster_queue}-dws-config"


def render_queued_provisioning(cluster_queue: str, labels: dict[str, str]) -> list[dict[str, Any]]:
    """ProvisioningRequestConfig and AdmissionCheck for flex-start with queued provisioning (both cluster-scoped).

    Source: xpk's Kueue templates (``ProvisioningRequestConfig`` ``dws-config``, ``AdmissionCheck`` ``dws-prov``)
    and Kueue v0.19.2's CRDs (``multislice/crds/kueue-v0.19.2``).
    """
    config_name = provisioning_config_name(cluster_queue)
    config = {
        "apiVersion": API_VERSION,
        "kind": "ProvisioningRequestConfig",
        "metadata": {"name": config_name, "labels": labels},
        "spec": {
            "provisioningClassName": QUEUED_PROVISIONING_CLASS,
            "managedResources": [tpu.TPU_RESOURCE],
            "podSetUpdates": {
                "nodeSelector": [
                    {"key": PROVISIONING_REQUEST_NODE_LABEL, "valueFromProvisioningClassDetail": "ResizeRequestName"}
                ]
            },
        },
    }
    check = {
        "apiVersion": API_VERSION,
        "kind": "AdmissionCheck",
        "metadata": {"name": admission_check_name(cluster_queue), "labels": labels},
        "spec": {
            "controllerName": PROVISIONING_CONTROLLER,
            "parameters": {"apiGroup": "kueue.x-k8s.io", "kind": "ProvisioningRequestConfig", "name": config_name},
        },
    }
    return [config, check]


def render_kueue_objects(plan: Plan) -> list[dict[str, Any]]:
    """ResourceFlavor, ClusterQueue, LocalQueue and WorkloadPriorityClass for a plan (and, with queued
    provisioning, the ProvisioningRequestConfig and AdmissionCheck the ClusterQueue names).

    Returns:
        Four objects as plain data, cluster-scoped first (six with queued provisioning: the two before the
        ClusterQueue that names them).
    """
    spec = plan.spec
    shape = spec.slice_type
    labels = {names.LABEL_MANAGED_BY: names.MANAGED_BY}
    flavor = {
        "apiVersion": API_VERSION,
        "kind": "ResourceFlavor",
        "metadata": {"name": shape.flavor_name, "labels": labels},
        "spec": {
            "nodeLabels": {
                tpu.ACCELERATOR_LABEL: shape.gke_accelerator,
                tpu.TOPOLOGY_LABEL: shape.topology,
            }
        },
    }
    cluster_queue = {
        "apiVersion": API_VERSION,
        "kind": "ClusterQueue",
        "metadata": {"name": spec.cluster_queue, "labels": labels},
        "spec": {
            "namespaceSelector": {},
            "queueingStrategy": "BestEffortFIFO",
            "preemption": {"withinClusterQueue": "LowerPriority", "reclaimWithinCohort": "Never"},
            "resourceGroups": [
                {
                    "coveredResources": [tpu.TPU_RESOURCE],
                    "flavors": [
                        {
                            "name": shape.flavor_name,
                            "resources": [{"name": tpu.TPU_RESOURCE, "nominalQuota": plan.total_chips}],
                        }
                    ],
                }
            ],
        },
    }
    queued = spec.node_pools.queued_provisioning
    if queued:
        cluster_queue["spec"]["admissionChecksStrategy"] = {
            "admissionChecks": [{"name": admission_check_name(spec.cluster_queue)}]
        }
    local_queue = {
        "apiVersion": API_VERSION,
        "kind": "LocalQueue",
        "metadata": {"name": spec.queue, "namespace": spec.namespace, "labels": labels},
        "spec": {"clusterQueue": spec.cluster_queue},
    }
    priority = {
        "apiVersion": API_VERSION,
        "kind": "WorkloadPriorityClass",
        "metadata": {"name": spec.priority, "labels": labels},
        "value": spec.priority_value,
        "description": "Priority of multislice training workloads (rendered by multislice-pipelines).",
    }
    provisioning = render_queued_provisioning(spec.cluster_queue, labels) if queued else []
    return [flavor, *provisioning, cluster_queue, priority, local_queue]
