"""Render a stage for the Ray launcher (``launcher: ray``): a KubeRay ``RayJob`` and DRANET claim templates.

Why a ``RayJob`` and not a ``RayCluster``: a stage is a run-to-completion
workload, as its JobSet is. A ``RayJob`` (``ray.io/v1``, KubeRay v1.7.0) carries
the cluster spec and the entrypoint in one object with a terminal status
(``status.jobDeploymentStatus`` ``Complete``/``Failed``, ``status.jobStatus``),
KubeRay deletes the cluster when the driver ends (``shutdownAfterJobFinishes``),
and Kueue admits it as one Workload through its RayJob integration (the
``kueue.x-k8s.io/queue-name`` label; Kueue suspends it until admitted,
https://kueue.sigs.k8s.io/docs/tasks/run/rayjobs/). A bare ``RayCluster``
would need a second step to submit the driver and to tear the cluster down.

The cluster (KubeRay's multi-host TPU worker groups, ``ray-project/kuberay``
``docs/guidance/tpu.md`` and Ray's ``doc/source/cluster/kubernetes/user-guides/tpu.md``):

- a CPU head group (the driver, :mod:`multislice.trainer.ray_driver`, runs there);
- one worker group ``slice`` with ``replicas`` = slices and ``numOfHosts`` =
  hosts per slice (KubeRay makes one multi-host replica per slice), each worker
  pod with ``google.com/tpu`` = chips per host, the TPU accelerator and
  topology node selectors and a memory-backed ``/dev/shm``;
- the head pod on the CPU node pool ``ray.head_node_selector`` names (required on GKE,
  :func:`multislice.config.checks.cross_field_issues`); not on the host network (it carries no DCN traffic);
- with ``service_accounts.tpu_host_network`` (the default, as the JobSet path and xpk) the worker pods use
  ``hostNetwork`` with ``dnsPolicy: ClusterFirstWithHostNet``; ``tpu_workload_identity`` drops it (GKE gives
  hostNetwork pods no Workload Identity). KubeRay v1.7.0 passes ``hostNetwork`` through untouched
  (``ray-operator/controllers/ray/common/pod.go``, ``DefaultWorkerPodTemplate``/``BuildPod``: no reference to it),
  so on the node's network are: the ports rendered here (8471 slice builder, 8081 megascale), the ``metrics``
  port 8080 KubeRay adds when absent (``DefaultMetricsPort``), the dashboard agent's 52365 that its
  ``/api/healthz`` probes use (``DefaultDashboardAgentListenPort``), and Ray's raylet, object manager and worker
  ports (``ray start``: random, and 10002-19999 for workers). A hostNetwork pod's container ports are host ports,
  so two Ray workers never share a node (each also asks all of the node's chips), and a node must not run another
  hostNetwork pod on those ports (the JobSet path's megascale port is 8080, hence 8081 here). The worker's init
  container and ``ray start`` reach the head by its Service's DNS name (KubeRay's ``fqdnRayIP``): hence
  ``ClusterFirstWithHostNet``; with the node's resolver they could not resolve it.
- ``MEGASCALE_*``: not rendered. The KubeRay TPU webhook sets
  ``TPU_WORKER_HOSTNAMES``, ``TPU_WORKER_ID`` and ``TPU_NAME`` (the multi-host
  replica), and Ray Train's ``JaxTrainer`` sets ``MEGASCALE_COORDINATOR_ADDRESS``,
  ``MEGASCALE_NUM_SLICES`` and ``MEGASCALE_SLICE_ID`` on every worker for the
  current worker group, overwriting any value in the pod environment
  (ray 2.60.0 ``ray/train/v2/jax/config.py``, ``_JAX_MULTISLICE_OVERRIDE_KEYS``):
  a rendered value would be overwritten, or stale after an elastic resize.
- with ``node_pools.additional_node_networks``: one DRANET
  ``ResourceClaimTemplate`` (``resource.k8s.io/v1``, device class
  ``netdev.google.com``, GKE managed DRANET,
  https://cloud.google.com/kubernetes-engine/docs/how-to/allocate-network-resources-dra)
  asking for one network device per additional network, claimed by every TPU
  worker pod, so that DCN traffic uses the extra NICs of the TPU nodes. The node
  pools then carry the label DRANET's driver runs on,
  ``cloud.google.com/gke-networking-dra-driver=true`` (:data:`DRANET_NODE_LABEL`). Such workers are never
  ``hostNetwork``: DRANET refuses a host-network pod that claims a device (its NRI hook ``RunPodSandbox`` fails with
  "using host network can not claim host devices", google/dranet ``pkg/driver/nri_hooks.go``) and moves the claimed
  NICs into the pod's network namespace instead, so the config refuses ``tpu_host_network`` with them
  (:func:`multislice.config.checks.cross_field_issues`).
"""

from __future__ import annotations

import shlex
from typing import Any

from multislice import libtpu_flags, names, tpu
from multislice.plan import Plan, StagePlan
from multislice.render import jobset

API_VERSION = "ray.io/v1"
#: The Ray version of the trainer image (``ray[default,train]`` in the trainer extra: the dashboard, its agent
#: and the Jobs API, which KubeRay's probes and submitter use); KubeRay's ``rayVersion``.
RAY_VERSION = "2.60.0"
#: The driver module, run by the RayJob's entrypoint on the head.
DRIVER_MODULE = "multislice.trainer.ray_driver"
#: The TPU worker group's name.
WORKER_GROUP = names.REPLICATED_JOB
#: The DRANET device class for network devices without RDMA (GKE installs it, GKE 1.34.1-gke.1829001+).
DRANET_DEVICE_CLASS = "netdev.google.com"
#: The node label on which GKE runs its managed DRANET driver (set on the TPU node pools).
DRANET_NODE_LABEL = ("cloud.google.com/gke-networking-dra-driver", "true")
CLAIM_API_VERSION = "resource.k8s.io/v1"
#: Name of the pod's claim (pod ``spec.resourceClaims[].name``).
DCN_CLAIM = "dcn-networks"

#: Ray's accelerator type names differ from ours for v5e
#: (Ray's ``VALID_TPU_TYPES``, ``ray/_private/accelerators/tpu.py``).
_RAY_GENERATION = {"v5e": "V5LITEPOD"}


def ray_accelerator_type(plan: Plan) -> str:
    """Ray Train's ``ScalingConfig.accelerator_type`` for the plan's slices, e.g. ``TPU-V6E``."""
    generation = plan.slice.generation.name
    return f"TPU-{_RAY_GENERATION.get(generation, generation.upper())}"


def claim_template_name(stage: StagePlan) -> str:
    """Name of the stage's DRANET ResourceClaimTemplate."""
    return f"{stage.workload}-dcn"


def driver_command(plan: Plan, stage: StagePlan, hardware: jobset.Hardware) -> list[str]:
    """The driver's command line: :mod:`multislice.trainer.ray_driver` with the stage's shape and MaxText arguments.

    On ``cpu`` (the local backend) the MaxText arguments carry the CPU variant's additions
    (:func:`multislice.render.jobset.worker_command`) and the driver runs one CPU Ray worker per emulated host.
    """
    spec = plan.spec
    _, worker_args = jobset.worker_command(plan, stage, hardware)
    maxtext_args = worker_args[worker_args.index("--") + 1 :]
    command = [
        "python",
        "-m",
        DRIVER_MODULE,
        f"--slices={spec.num_slices}",
        f"--hosts-per-slice={plan.slice.hosts}",
        f"--chips-per-host={plan.slice.chips_per_host}",
        f"--max-failures={spec.max_restarts}",
        f"--storage-path={stage.checkpoint_dir}",
        f"--name={stage.workload}",
    ]
    if spec.ray.min_slices is not None:
        command.append(f"--min-slices={spec.ray.min_slices}")
    if hardware == "tpu":
        command += ["--tpu", f"--topology={plan.slice.topology}", f"--accelerator-type={ray_accelerator_type(plan)}"]
    else:
        command += [f"--distributed-timeout={worker_args[1].split('=', 1)[1]}"]
    return [*command, "--", *maxtext_args]


def _container(plan: Plan, name: str, resources: dict[str, Any] | None = None) -> dict[str, Any]:
    container: dict[str, Any] = {
        "name": name,
        "image": plan.spec.images.trainer,
        "imagePullPolicy": "IfNotPresent",
        "env": [jobset.unbuffered_env()],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    if resources:
        container["resources"] = resources
    return container


def render_rayjob(plan: Plan, stage: StagePlan, *, pipeline_run_id: str) -> dict[str, Any]:
    """The RayJob that trains ``stage`` on GKE TPU node pools.

    Raises:
        ValueError: ``pipeline_run_id`` is not a valid label value.
    """
    spec = plan.spec
    labels = jobset.run_labels(plan, pipeline_run_id, stage)
    dshm = {"name": "dshm", "emptyDir": {"medium": "Memory"}}
    head = _container(plan, "ray-head")
    head["ports"] = [
        {"containerPort": 6379, "name": "gcs-server", "protocol": "TCP"},
        {"containerPort": 8265, "name": "dashboard", "protocol": "TCP"},
        {"containerPort": 10001, "name": "client", "protocol": "TCP"},
    ]
    head["resources"] = {"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"cpu": "4", "memory": "16Gi"}}
    chips = plan.slice.chips_per_host
    worker = _container(
        plan, "ray-worker", {"limits": {tpu.TPU_RESOURCE: chips}, "requests": {tpu.TPU_RESOURCE: chips}}
    )
    if stage.libtpu_flags:  # MaxText's recipe flags for the generation and model (multislice.libtpu_flags)
        worker["env"].insert(0, {"name": libtpu_flags.ENV, "value": libtpu_flags.init_args(stage.libtpu_flags)})
    worker["env"][-1:-1] = jobset.data_token_env(plan, stage)  # Ray's worker processes inherit the pod's
    worker["ports"] = [
        {"containerPort": 8471, "name": "slice-builder", "protocol": "TCP"},
        {"containerPort": 8081, "name": "megascale", "protocol": "TCP"},
    ]
    worker_pod: dict[str, Any] = {
        "serviceAccountName": spec.service_accounts.trainer,
        "nodeSelector": {tpu.ACCELERATOR_LABEL: plan.slice.gke_accelerator, tpu.TOPOLOGY_LABEL: plan.slice.topology},
        "containers": [worker],
        "volumes": [dshm],
    }
    if spec.service_accounts.tpu_host_network:
        # As the JobSet's TPU pods (multislice.render.jobset): DCN traffic on the node's network. The workers
        # reach the head through its Service's DNS name (KubeRay's FQ_RAY_IP), so cluster DNS stays on.
        worker_pod["hostNetwork"] = True
        worker_pod["dnsPolicy"] = "ClusterFirstWithHostNet"
    if spec.node_pools.additional_node_networks:
        worker_pod["resourceClaims"] = [{"name": DCN_CLAIM, "resourceClaimTemplateName": claim_template_name(stage)}]
        worker["resources"]["claims"] = [{"name": DCN_CLAIM}]
    head_selector = spec.ray.head_node_selector  # a CPU node pool; required on GKE (config checks)
    slices = spec.num_slices
    min_slices = spec.ray.min_slices if spec.ray.min_slices is not None else slices
    return {
        "apiVersion": API_VERSION,
        "kind": "RayJob",
        "metadata": {
            "name": stage.workload,
            "namespace": spec.namespace,
            "labels": {names.KUEUE_QUEUE_LABEL: spec.queue, names.KUEUE_PRIORITY_LABEL: spec.priority, **labels},
        },
        "spec": {
            "entrypoint": shlex.join(driver_command(plan, stage, "tpu")),
            "submissionMode": "K8sJobMode",
            "shutdownAfterJobFinishes": True,
            "ttlSecondsAfterFinished": 600,
            # Restarts happen inside the driver (FailureConfig(max_failures=max_restarts)), not by resubmission.
            "backoffLimit": 0,
            # Kueue's RayJob integration creates it suspended and unsuspends it on admission.
            "suspend": False,
            "rayClusterSpec": {
                "rayVersion": RAY_VERSION,
                "enableInTreeAutoscaling": False,
                "headGroupSpec": {
                    "rayStartParams": {"dashboard-host": "0.0.0.0"},
                    "template": {
                        "metadata": {"labels": dict(labels)},
                        "spec": {
                            "serviceAccountName": spec.service_accounts.trainer,
                            **({"nodeSelector": dict(head_selector)} if head_selector else {}),
                            "containers": [head],
                            "volumes": [dshm],
                        },
                    },
                },
                "workerGroupSpecs": [
                    {
                        "groupName": WORKER_GROUP,
                        "replicas": slices,
                        "minReplicas": min_slices,
                        "maxReplicas": slices,
                        "numOfHosts": plan.slice.hosts,
                        "rayStartParams": {},
                        "template": {"metadata": {"labels": dict(labels)}, "spec": worker_pod},
                    }
                ],
            },
        },
    }


def render_claim_templates(plan: Plan, stage: StagePlan, *, pipeline_run_id: str) -> list[dict[str, Any]]:
    """The stage's DRANET ResourceClaimTemplates: one, when the node pools have additional networks, else none.

    It asks the ``netdev.google.com`` class for as many network devices as there are additional networks.
    """
    networks = plan.spec.node_pools.additional_node_networks
    if not networks:
        return []
    return [
        {
            "apiVersion": CLAIM_API_VERSION,
            "kind": "ResourceClaimTemplate",
            "metadata": {
                "name": claim_template_name(stage),
                "namespace": plan.spec.namespace,
                "labels": jobset.run_labels(plan, pipeline_run_id, stage),
            },
            "spec": {
                "spec": {
                    "devices": {
                        "requests": [
                            {
                                "name": "dcn",
                                "exactly": {
                                    "deviceClassName": DRANET_DEVICE_CLASS,
                                    "allocationMode": "ExactCount",
                                    "count": len(networks),
                                },
                            }
                        ]
                    }
                }
            },
        }
    ]


_DNS_LABEL = {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63}
#: The part of ``resource.k8s.io/v1`` ResourceClaimTemplate this project renders, from the Kubernetes API
#: reference (ResourceClaimTemplateSpec -> ResourceClaimSpec -> DeviceClaim -> DeviceRequest with ``exactly``:
#: ExactDeviceRequest; https://kubernetes.io/docs/reference/kubernetes-api/workload-resources/resource-claim-template-v1/).
#: Strict: fields outside it are refused, as for CRDs (:mod:`multislice.render.schema`).
CLAIM_TEMPLATE_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"enum": [CLAIM_API_VERSION]},
        "kind": {"enum": ["ResourceClaimTemplate"]},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object",
            "required": ["spec"],
            "additionalProperties": False,
            "properties": {
                "metadata": {"type": "object"},
                "spec": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "devices": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {
                                "requests": {
                                    "type": "array",
                                    "maxItems": 32,
                                    "items": {
                                        "type": "object",
                                        "required": ["name"],
                                        "additionalProperties": False,
                                        "properties": {
                                            "name": _DNS_LABEL,
                                            "exactly": {
                                                "type": "object",
                                                "required": ["deviceClassName"],
                                                "additionalProperties": False,
                                                "properties": {
                                                    "deviceClassName": {"type": "string", "minLength": 1},
                                                    "allocationMode": {"enum": ["ExactCount", "All"]},
                                                    "count": {"type": "integer", "minimum": 1},
                                                    "adminAccess": {"type": "boolean"},
                                                    "selectors": {"type": "array"},
                                                    "tolerations": {"type": "array"},
                                                },
                                            },
                                        },
                                    },
                                },
                                "constraints": {"type": "array"},
                                "config": {"type": "array"},
                            },
                        }
                    },
                },
            },
        },
    },
}


def claim_template_problems(obj: dict[str, Any]) -> list[str]:
    """Why the API server would reject a rendered ResourceClaimTemplate: its fields and its ObjectMeta."""
    import jsonschema  # 0.3 s: only when a claim template is checked, not in every importer (supervisors)

    from multislice.render import schema  # celpy and the CRDs: only when a claim template is checked

    found = [
        f"{'.'.join(map(str, e.absolute_path)) or '<root>'}: {e.message}"
        for e in jsonschema.Draft4Validator(CLAIM_TEMPLATE_SCHEMA).iter_errors(obj)
    ]
    return found + schema.builtin_problems(obj)
