"""Expand a JobSet into the pods its controllers would create, as local processes.

What the JobSet controller and the Job controller do on a cluster, done here
for the local backend: one child Job per replica of each replicated job, one
pod per completion index, with the labels and annotations those controllers
set (JobSet ``pkg/constants``: ``jobset.sigs.k8s.io/jobset-name``,
``replicatedjob-name``, ``job-index``, ``restart-attempt``...; the Job
controller's ``batch.kubernetes.io/job-completion-index``). The container's
environment is then resolved as the kubelet does: downward-API ``fieldRef``
values from the pod's metadata, and ``$(VAR)`` references to variables
defined earlier in the list.

All pods run on this machine, so the pod DNS names of the JobSet's headless
service (``<hostname>.<subdomain>``) resolve to 127.0.0.1: an environment
value that is exactly such a name is replaced by ``127.0.0.1``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from multislice import names
from multislice.errors import InputError

LOCALHOST = "127.0.0.1"
_FIELD_PATH = re.compile(r"^metadata\.(annotations|labels)\['(?P<key>[^']+)'\]$")
_VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)|\$\$")


class UnsupportedManifest(InputError, ValueError):
    """The local backend cannot run this JobSet as written; the message says which field."""


@dataclass
class LocalPod:
    """One pod of a JobSet, ready to run as a process.

    Attributes:
        hostname: ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``.
        job: Child Job name.
        replicated_job: Replicated job name.
        job_index: Index of the child Job (the slice, for multislice JobSets).
        completion_index: Index of the pod in its Job (the host within the slice).
        argv: Container command + args.
        env: Container environment after fieldRef and ``$(VAR)`` resolution.
        labels: Pod labels.
        annotations: Pod annotations.
    """

    hostname: str
    job: str
    replicated_job: str
    job_index: int
    completion_index: int
    argv: list[str]
    env: dict[str, str]
    labels: dict[str, str] = field(default_factory=dict)
    annotations: dict[str, str] = field(default_factory=dict)


def expand_vars(value: str, env: dict[str, str]) -> str:
    """Kubernetes ``$(VAR)`` expansion: defined variables expand, ``$$`` escapes, others stay."""

    def replace(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        return env.get(match.group(1), match.group(0))

    return _VAR_REF.sub(replace, value)


def _resolve_env(container: dict[str, Any], labels: dict[str, str], annotations: dict[str, str]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in container.get("env", []):
        name = item["name"]
        if "value" in item:
            env[name] = expand_vars(str(item["value"]), env)
            continue
        ref = item.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath", "")
        match = _FIELD_PATH.fullmatch(ref)
        if not match:
            raise UnsupportedManifest(
                f"env {name}: the local backend resolves only fieldRef metadata.annotations['...'] and "
                f"metadata.labels['...'], not {item.get('valueFrom')!r}"
            )
        source = annotations if match.group(1) == "annotations" else labels
        env[name] = source.get(match.group("key"), "")
    return env


def expand_jobset(
    manifest: dict[str, Any], restart_attempt: int = 0, annotated: dict[str, dict[str, str]] | None = None
) -> list[LocalPod]:
    """The pods of a JobSet at a restart attempt, in (replicated job, job index, pod index) order.

    ``annotated`` gives, by hostname, annotations set on a pod since its creation (the in-place restart agent's
    ``jobset.sigs.k8s.io/in-place-restart-attempt``): the environment is resolved with them, as the kubelet
    resolves a container's Downward API variables from the pod as it is when the container starts
    (``pkg/kubelet/kubelet_pods.go``, ``makeEnvironmentVariables``, at each container start).

    Raises:
        UnsupportedManifest: more than one container, or a fieldRef the local
            backend cannot resolve.
    """
    jobset = manifest["metadata"]["name"]
    subdomain = manifest["spec"].get("network", {}).get("subdomain") or jobset
    replicated_jobs = manifest["spec"]["replicatedJobs"]
    global_replicas = sum(rj.get("replicas", 1) for rj in replicated_jobs)
    pods: list[LocalPod] = []
    dns_names: set[str] = set()
    global_index = 0
    for rj in replicated_jobs:
        job_spec = rj["template"]["spec"]
        pod_template = job_spec["template"]
        containers = pod_template["spec"]["containers"]
        if len(containers) != 1:
            raise UnsupportedManifest(
                f"replicatedJobs[{rj['name']}]: the local backend runs exactly one container per pod"
            )
        completions = job_spec.get("completions", job_spec.get("parallelism", 1))
        for job_index in range(rj.get("replicas", 1)):
            job = names.job_name(jobset, job_index, rj["name"])
            jobset_meta = {
                names.JOBSET_NAME_KEY: jobset,
                names.REPLICATED_JOB_NAME_KEY: rj["name"],
                names.REPLICATED_JOB_REPLICAS_KEY: str(rj.get("replicas", 1)),
                names.JOB_INDEX_KEY: str(job_index),
                names.JOB_GLOBAL_INDEX_KEY: str(global_index),
                names.RESTART_ATTEMPT_KEY: str(restart_attempt),
                "jobset.sigs.k8s.io/global-replicas": str(global_replicas),
            }
            for pod_index in range(completions):
                hostname = names.pod_hostname(jobset, job_index, pod_index, rj["name"])
                meta = {**jobset_meta, names.JOB_COMPLETION_INDEX_KEY: str(pod_index), "job-name": job}
                labels = {**pod_template.get("metadata", {}).get("labels", {}), **meta}
                annotations = {
                    **pod_template.get("metadata", {}).get("annotations", {}),
                    **meta,
                    **(annotated or {}).get(hostname, {}),
                }
                container = containers[0]
                env = _resolve_env(container, labels, annotations)
                argv = [expand_vars(a, env) for a in [*container.get("command", []), *container.get("args", [])]]
                pods.append(LocalPod(hostname, job, rj["name"], job_index, pod_index, argv, env, labels, annotations))
                dns_names.add(f"{hostname}.{subdomain}")
            global_index += 1
    for pod in pods:
        pod.env = {k: (LOCALHOST if v in dns_names else v) for k, v in pod.env.items()}
    return pods
