"""Render the multislice JobSet of a stage (``jobset.x-k8s.io/v1alpha2``).

The TPU variant follows GKE's multislice guide
(https://cloud.google.com/kubernetes-engine/docs/how-to/tpu-multislice) and
what xpk renders (AI-Hypercomputer/xpk ``src/xpk/commands/workload.py``):

- one replicated job ``slice`` with ``replicas`` = slices; each child Job has
  ``parallelism`` = ``completions`` = hosts per slice and ``backoffLimit: 0``
  (any pod failure fails its Job, and the JobSet decides what happens next);
- ``alpha.jobset.sigs.k8s.io/exclusive-topology: cloud.google.com/gke-nodepool``
  so each child Job gets a node pool (a slice) of its own;
- nodeSelector on the TPU accelerator and topology labels, ``google.com/tpu``
  limits of chips per host, ``hostNetwork`` with ``ClusterFirstWithHostNet``,
  a memory-backed ``/dev/shm``, ports 8471 and 8080;
- the Kueue queue and priority labels, and this project's run labels;
- a failure policy: a pod that exits with 42 or is killed by a signal (exit
  129-255: preemption, OOM kill, node loss) fails its Job with
  ``BackoffLimitExceeded`` and the JobSet restarts, up to ``maxRestarts``; any
  other exit (a Python error, a bad argument) fails the Job by
  ``PodFailurePolicy`` and the JobSet fails at once, since restarting a
  deterministic error only burns TPU hours. xpk uses the same split.
  With ``restartStrategy: InPlaceRestart`` (:mod:`multislice.render.in_place`) the same split holds: the
  restartable codes restart the pods' containers in place, any other exit still fails the JobSet.

The CPU variant is the same JobSet for CPU nodes (or the local backend): no TPU
selectors or limits, no exclusive placement, and the environment MaxText's
multi-process CPU path reads, passed through the downward API as xpk does for
CPU workloads (``src/xpk/core/docker_resources.py``, ``get_cpu_env``):
``JOB_INDEX`` and ``JOB_COMPLETION_INDEX`` from pod annotations,
``PROCESSES_IN_JOB`` = hosts per slice, ``JAX_PROCESS_COUNT`` = all hosts, and
``JAX_COORDINATOR_ADDRESS`` = the DNS name of pod 0 of slice 0,
``<jobset>-slice-0-0.<subdomain>``, and ``JAX_COORDINATOR_PORT`` (ours: the
worker initialises ``jax.distributed`` itself at that port, MaxText's 1234 on a
cluster; the local backend sets a free port per JobSet attempt).

Fields that JobSet's defaulting webhook would fill (rule names, completion
mode, network) are rendered explicitly so that offline validation against the
CRD sees the object as the API server stores it.
"""

from __future__ import annotations

from typing import Any, Literal

from multislice import libtpu_flags, maxtext, names, tpu
from multislice.errors import ConfigError
from multislice.plan import Plan, StagePlan
from multislice.render import in_place
from multislice.timings import timings_for

API_VERSION = "jobset.x-k8s.io/v1alpha2"

#: Exit codes after which the JobSet restarts: 42 (a deliberate restart request,
#: xpk's convention) and 129-255 (killed by a signal: 128 + signal number).
RESTARTABLE_EXIT_CODES: tuple[int, ...] = (42, *range(129, 256))

#: Which pods a JobSet is rendered for: ``tpu`` (GKE TPU node pools) or ``cpu`` (CPU nodes, and the
#: local backend's processes). The name is MaxText's own key (``hardware=cpu``); not a Kueue ResourceFlavor.
Hardware = Literal["tpu", "cpu"]

#: Module run by every training pod (trainer image).
WORKER_MODULE = maxtext.WORKER_MODULE
#: Runs a command with ``$HF_TOKEN`` read from Secret Manager (:mod:`multislice.trainer.hub_token`, by name: the
#: render layer does not import the trainer's code).
HUB_TOKEN_MODULE = "multislice.trainer.hub_token"
#: The variable ``huggingface_hub`` reads a token from when MaxText's ``hf_access_token`` is unset, and the key of
#: the Kubernetes Secret that holds it (as for the exporter's token, :mod:`multislice.backends.gke.exporter`).
HF_TOKEN_ENV, HF_TOKEN_SECRET_KEY = "HF_TOKEN", "token"


def data_token_env(plan: Plan, stage: StagePlan) -> list[dict[str, Any]]:
    """The trainer container's ``$HF_TOKEN`` from the Kubernetes Secret the stage's data names
    (``data.hf_token_kubernetes_secret``), by reference: the kubelet reads it, the token is in no object this
    project writes. None without one."""
    secret = getattr(plan.spec.stage(stage.name).data, "hf_token_kubernetes_secret", "")
    if not secret:
        return []
    return [{"name": HF_TOKEN_ENV, "valueFrom": {"secretKeyRef": {"name": secret, "key": HF_TOKEN_SECRET_KEY}}}]


def with_data_token(plan: Plan, stage: StagePlan, command: list[str]) -> list[str]:
    """``command`` run under :mod:`multislice.trainer.hub_token` when the stage's data names a Secret Manager secret
    version (``data.hf_token_secret``): the pod reads the token at start and ``exec``s the command with it in
    ``$HF_TOKEN`` (an argument list; the secret's name, never its value)."""
    secret = getattr(plan.spec.stage(stage.name).data, "hf_token_secret", "")
    if not secret:
        return command
    return ["python", "-m", HUB_TOKEN_MODULE, "--secret-version", secret, "--", *command]


#: GKE's multi-tier checkpointing CSI driver: an in-memory volume per node (its size is the cluster's
#: CheckpointConfiguration ``inMemoryVolumeSize``) that outlives the pods on it, into which the driver writes the
#: ``jax-init-info.txt`` MaxText's emergency-checkpoint start-up reads. xpk renders the same inline volume for
#: ``workload create --ramdisk-directory ... --mtc-enabled`` (``src/xpk/core/docker_resources.py``,
#: ``get_volumes``; its older ``phase1-checkpoint.csi.storage.gke.io`` without ``--mtc-enabled``); GKE's guide:
#: https://cloud.google.com/kubernetes-engine/docs/how-to/machine-learning/training/multi-tier-checkpointing.
CHECKPOINT_CSI_DRIVER = "multitier-checkpoint.csi.storage.gke.io"
#: The pod volume of the local checkpoint tier.
LOCAL_CHECKPOINT_VOLUME = "local-checkpoints"


def local_checkpoint_volume(stage: StagePlan) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """``(volumes, volumeMounts)`` of a TPU training pod for the stage's local checkpoint tier; empty without one.

    The volume is a CSI ephemeral inline volume of :data:`CHECKPOINT_CSI_DRIVER` (no size here: the driver serves
    its node's ramdisk, sized cluster-wide), mounted at the stage's ``local_checkpoint_directory``.
    """
    if not stage.local_checkpoint_directory:
        return [], []
    volume = {"name": LOCAL_CHECKPOINT_VOLUME, "csi": {"driver": CHECKPOINT_CSI_DRIVER}}
    return [volume], [{"name": LOCAL_CHECKPOINT_VOLUME, "mountPath": stage.local_checkpoint_directory}]


def unbuffered_env() -> dict[str, str]:
    """``PYTHONUNBUFFERED=1``, in every trainer-image container this package renders.

    A container's stdout is a pipe, so Python would buffer prints in 8 KiB blocks: a remote
    function's prints and MaxText's per-step lines would reach ``kubectl logs`` (and the caller
    following them) late or only at exit. The local backend's supervisor sets the same variable.
    """
    return {"name": "PYTHONUNBUFFERED", "value": "1"}


def run_labels(plan: Plan, pipeline_run_id: str, stage: StagePlan | None = None) -> dict[str, str]:
    """Labels naming the pipeline run (and stage) that owns an object.

    Raises:
        multislice.errors.ConfigError: ``pipeline_run_id`` is not a valid label value (also a ValueError).
    """
    if not names.LABEL_VALUE.fullmatch(pipeline_run_id) or len(pipeline_run_id) > names.MAX_LABEL_LENGTH:
        raise ConfigError(
            [
                (
                    "pipeline run id",
                    f"{pipeline_run_id[:80]!r} is not a valid Kubernetes label value; give at most 63 letters, "
                    "digits, '-', '_' or '.', alphanumeric at both ends (--pipeline-run-id)",
                )
            ]
        )
    labels = {
        names.LABEL_MANAGED_BY: names.MANAGED_BY,
        names.LABEL_RUN_NAME: plan.spec.run_name,
        names.LABEL_PIPELINE_RUN_ID: pipeline_run_id,
    }
    if stage is not None:
        labels[names.LABEL_STAGE] = stage.name
    return labels


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def cpu_env(plan: Plan, stage: StagePlan) -> list[dict[str, Any]]:
    """Environment of a CPU pod: MaxText's multi-process CPU variables, and :func:`unbuffered_env`.

    ``$(VAR)`` references are expanded by the kubelet (and the local backend)
    from variables defined earlier in the list.
    """
    hosts = plan.slice.hosts
    return [
        _field_env("JOBSET_NAME", f"metadata.annotations['{names.JOBSET_NAME_KEY}']"),
        _field_env("REPLICATED_JOB_NAME", f"metadata.annotations['{names.REPLICATED_JOB_NAME_KEY}']"),
        _field_env(maxtext.ENV_JOB_INDEX, f"metadata.annotations['{names.JOB_INDEX_KEY}']"),
        _field_env(maxtext.ENV_JOB_COMPLETION_INDEX, f"metadata.annotations['{names.JOB_COMPLETION_INDEX_KEY}']"),
        {"name": maxtext.ENV_PROCESSES_IN_JOB, "value": str(hosts)},
        {"name": maxtext.ENV_PROCESS_COUNT, "value": str(hosts * plan.spec.num_slices)},
        {"name": maxtext.ENV_COORDINATOR_ADDRESS, "value": "$(JOBSET_NAME)-$(REPLICATED_JOB_NAME)-0-0.$(JOBSET_NAME)"},
        {"name": maxtext.ENV_COORDINATOR_PORT, "value": str(maxtext.CPU_COORDINATOR_PORT)},
        {"name": "JAX_PLATFORMS", "value": "cpu"},
        # One CPU device per chip of the emulated host.
        {"name": "XLA_FLAGS", "value": f"--xla_force_host_platform_device_count={plan.slice.chips_per_host}"},
        unbuffered_env(),
    ]


def worker_command(plan: Plan, stage: StagePlan, hardware: Hardware) -> tuple[list[str], list[str]]:
    """Container ``command`` and ``args`` of a training pod.

    On TPU, MaxText runs as on GKE. On CPU this adds what
    MaxText's multi-process CPU path needs (``hardware=cpu``, an explicit
    ``num_slices`` so it builds a DCN mesh), the worker's
    ``--emulate-slices`` option and its ``--distributed-timeout`` (the profile's
    ``timeouts.collectives``, :mod:`multislice.timings`). Every process of
    every attempt uses the stage's ``jax_cache_dir`` (the run's
    ``jax_cache/``, a ``gs://`` path on GKE); on CPU each process writes its
    own cache entries (:mod:`multislice.trainer.compile_cache`: JAX writes from
    process 0 only and keys CPU programs by the process's own devices).
    A stage with emergency checkpoints keeps them on TPU only (:func:`local_checkpoint_volume`); its CPU
    variant leaves out MaxText's emergency keys.
    """
    command = with_data_token(plan, stage, ["python", "-m", WORKER_MODULE])
    args = []
    maxtext_args = list(stage.maxtext_args)
    if hardware == "cpu" and stage.local_checkpoint_directory:
        # No checkpoint ramdisk on CPU nodes (GKE's checkpointing CSI driver serves TPU node pools): the CPU variant
        # of an emergency-checkpoint stage checkpoints to the persistent tier only, as a stage without them does.
        maxtext_args = [arg for arg in maxtext_args if arg.split("=", 1)[0] not in maxtext.LOCAL_TIER_KEYS]
    if hardware == "cpu":
        args += ["--emulate-slices", f"--distributed-timeout={timings_for(plan.spec).collectives_timeout:g}"]
        maxtext_args += ["hardware=cpu", f"num_slices={plan.spec.num_slices}"]
    return command, [*args, "--", *maxtext_args]


def render_jobset(
    plan: Plan,
    stage: StagePlan,
    *,
    hardware: Hardware,
    pipeline_run_id: str,
    restart_strategy: in_place.Strategy | None = None,
) -> dict[str, Any]:
    """The multislice JobSet that trains one stage (``launcher: jobset``; a stage's launcher picks its renderer:
    :func:`multislice.render.launchers.kind_of`).

    Args:
        plan: The validated plan.
        stage: The stage to render.
        hardware: ``tpu`` for GKE TPU node pools, ``cpu`` for CPU nodes and the local backend.
        pipeline_run_id: The KFP run id, put in the ``pipeline/runid`` label.
        restart_strategy: ``InPlaceRestart`` or ``Recreate`` (what provision chose for the cluster,
            :mod:`multislice.backends.gke.in_place`); None: :func:`multislice.render.in_place.requested` (the dry
            run's). ``InPlaceRestart`` adds what JobSet v0.12.0 requires (:mod:`multislice.render.in_place`): on TPU
            with the agent sidecar, on CPU without it (the local supervisor plays the agent).

    Returns:
        The JobSet object as plain data (a dict ready for YAML or the API).

    Raises:
        ValueError: ``pipeline_run_id`` is not a valid label value.
    """
    spec = plan.spec
    hosts = plan.slice.hosts
    command, args = worker_command(plan, stage, hardware)
    labels = run_labels(plan, pipeline_run_id, stage)
    container: dict[str, Any] = {
        "name": names.TRAINER_CONTAINER,
        "image": spec.images.trainer,
        "imagePullPolicy": "IfNotPresent",
        "command": command,
        "args": args,
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    annotations: dict[str, str] = {}
    if hardware == "tpu":
        volumes, mounts = local_checkpoint_volume(stage)
        pod_spec["volumes"] += volumes
        container["volumeMounts"] += mounts
        annotations[names.EXCLUSIVE_TOPOLOGY_ANNOTATION] = tpu.NODEPOOL_LABEL
        container["ports"] = [
            {"containerPort": 8471, "name": "slice-builder", "protocol": "TCP"},
            {"containerPort": 8080, "name": "megascale", "protocol": "TCP"},
        ]
        container["resources"] = {"limits": {tpu.TPU_RESOURCE: plan.slice.chips_per_host}}
        if stage.libtpu_flags:  # MaxText's recipe flags for the generation and model (multislice.libtpu_flags)
            container["env"] = [{"name": libtpu_flags.ENV, "value": libtpu_flags.init_args(stage.libtpu_flags)}]
        container["env"] = [*container.get("env", []), *data_token_env(plan, stage), unbuffered_env()]
        # The trainer's ServiceAccount (multislice.render.rbac): no API rights in the trainer container (only the
        # in-place restart agent mounts its token, multislice.render.in_place). With hostNetwork (the default,
        # DCN on the node's network) GKE gives the pods no Workload Identity: they write gs:// as the node's
        # service account (node_pools.service_account and oauth_scopes); service_accounts.tpu_workload_identity
        # drops hostNetwork so the trainer's Google service account applies.
        pod_spec["serviceAccountName"] = spec.service_accounts.trainer
        if spec.service_accounts.tpu_host_network:
            pod_spec["hostNetwork"] = True
            pod_spec["dnsPolicy"] = "ClusterFirstWithHostNet"
        pod_spec["nodeSelector"] = {
            tpu.ACCELERATOR_LABEL: plan.slice.gke_accelerator,
            tpu.TOPOLOGY_LABEL: plan.slice.topology,
        }
    else:
        container["ports"] = [
            {"containerPort": maxtext.CPU_COORDINATOR_PORT, "name": "jax-coordinator", "protocol": "TCP"}
        ]
        container["env"] = cpu_env(plan, stage)

    metadata: dict[str, Any] = {
        "name": stage.workload,
        "namespace": spec.namespace,
        "labels": {
            names.KUEUE_QUEUE_LABEL: spec.queue,
            names.KUEUE_PRIORITY_LABEL: spec.priority,
            **labels,
        },
    }
    if annotations:
        metadata["annotations"] = annotations
    job_spec: dict[str, Any] = {
        "parallelism": hosts,
        "completions": hosts,
        "completionMode": "Indexed",
        "backoffLimit": 0,
        "podFailurePolicy": {
            "rules": [
                {
                    "action": "FailJob",
                    "onExitCodes": {
                        "containerName": names.TRAINER_CONTAINER,
                        "operator": "NotIn",
                        "values": list(RESTARTABLE_EXIT_CODES),
                    },
                }
            ]
        },
        "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
    }
    strategy = restart_strategy or in_place.requested(plan, hardware)
    if strategy == in_place.IN_PLACE:
        in_place.apply(plan, job_spec, pod_spec, container, RESTARTABLE_EXIT_CODES, agent=hardware == "tpu")
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": metadata,
        "spec": {
            "failurePolicy": {
                "maxRestarts": spec.max_restarts,
                "restartStrategy": strategy,
                "rules": [
                    {
                        "name": "failJobSetOnNonRetriableExit",
                        "action": "FailJobSet",
                        "onJobFailureReasons": ["PodFailurePolicy"],
                    },
                    {
                        "name": "restartJobSetOnHostFailure",
                        "action": "RestartJobSet",
                        "onJobFailureReasons": ["BackoffLimitExceeded"],
                    },
                ],
            },
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            **(
                {"ttlSecondsAfterFinished": spec.jobset_ttl_seconds}
                if hardware == "tpu" and spec.jobset_ttl_seconds is not None
                else {}
            ),
            "replicatedJobs": [
                {
                    "name": names.REPLICATED_JOB,
                    "replicas": spec.num_slices,
                    "template": {"metadata": {"labels": dict(labels)}, "spec": job_spec},
                }
            ],
        },
    }


#: The local Ray driver pod's program: a Ray head and the Jobs API submitter, as KubeRay runs a RayJob.
LOCAL_RAYJOB_MODULE = "multislice.trainer.ray_job"


def render_ray_driver_jobset(
    plan: Plan, stage: StagePlan, *, hardware: Hardware, pipeline_run_id: str
) -> dict[str, Any]:
    """The local backend's workload for a stage with ``launcher: ray``: one pod, the Ray driver's RayJob.

    The pod runs :data:`LOCAL_RAYJOB_MODULE` (:mod:`multislice.trainer.ray_job`), which plays what
    KubeRay does for a RayJob: a Ray head with the dashboard (``ray start --head --block``), ready once
    its dashboard agent's ``/api/healthz`` answers 200, and the driver
    (:mod:`multislice.trainer.ray_driver`, the same entrypoint as the RayJob's on GKE) submitted and
    followed through Ray's Jobs API. The driver's ``JaxTrainer`` runs one CPU worker per emulated host;
    Ray Train, not the JobSet, retries failed workers (``FailureConfig(max_failures=max_restarts)``),
    so the JobSet itself never restarts. On GKE a Ray stage is a RayJob instead
    (:func:`multislice.render.ray.render_rayjob`).

    Raises:
        ValueError: ``hardware`` is ``tpu`` (a TPU Ray stage is a RayJob), or a bad ``pipeline_run_id``.
    """
    from multislice.render import ray  # imports this module (and jsonschema): only for a Ray stage

    if hardware != "cpu":
        raise ValueError(f"stage {stage.name} has launcher ray: on TPU it is a RayJob (multislice.render.ray)")
    spec = plan.spec
    labels = run_labels(plan, pipeline_run_id, stage)
    entrypoint = ray.driver_command(plan, stage, "cpu")
    # the head's logical CPUs: one per Ray worker (one per emulated host), one for the driver's own actors
    head_cpus = spec.num_slices * plan.slice.hosts + 1
    container = {
        "name": names.TRAINER_CONTAINER,
        "image": spec.images.trainer,
        "imagePullPolicy": "IfNotPresent",
        "command": ["python", "-m", LOCAL_RAYJOB_MODULE],
        "args": [f"--name={stage.workload}", f"--num-cpus={head_cpus}", "--", *entrypoint],
        "env": [{"name": "JAX_PLATFORMS", "value": "cpu"}, unbuffered_env()],
        "volumeMounts": [{"name": "dshm", "mountPath": "/dev/shm"}],
    }
    pod_spec = {
        "restartPolicy": "Never",
        "terminationGracePeriodSeconds": 30,
        "containers": [container],
        "volumes": [{"name": "dshm", "emptyDir": {"medium": "Memory"}}],
    }
    return {
        "apiVersion": API_VERSION,
        "kind": "JobSet",
        "metadata": {
            "name": stage.workload,
            "namespace": spec.namespace,
            "labels": {names.KUEUE_QUEUE_LABEL: spec.queue, names.KUEUE_PRIORITY_LABEL: spec.priority, **labels},
        },
        "spec": {
            "failurePolicy": {"maxRestarts": 0, "restartStrategy": "Recreate"},
            "network": {"enableDNSHostnames": True, "publishNotReadyAddresses": True},
            "replicatedJobs": [
                {
                    "name": names.REPLICATED_JOB,
                    "replicas": 1,
                    "template": {
                        "metadata": {"labels": dict(labels)},
                        "spec": {
                            "parallelism": 1,
                            "completions": 1,
                            "completionMode": "Indexed",
                            "backoffLimit": 0,
                            "template": {"metadata": {"labels": dict(labels)}, "spec": pod_spec},
                        },
                    },
                }
            ],
        },
    }
