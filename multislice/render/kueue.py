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

Kueue v0.19 serves v1beta2 (storage) and v1beta1 (deprecated); v1beta2
renamed ``ClusterQueue.spec.cohort`` to ``cohortName``.
"""

from __future__ import annotations

from typing import Any

from multislice import names, tpu
from multislice.plan import Plan

API_VERSION = "kueue.x-k8s.io/v1beta2"


def render_kueue_objects(plan: Plan) -> list[dict[str, Any]]:
    """ResourceFlavor, ClusterQueue, LocalQueue and WorkloadPriorityClass for a plan.

    Returns:
        Four objects as plain data, cluster-scoped first.
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
    return [flavor, cluster_queue, priority, local_queue]
