"""Kubernetes object names and the labels this project puts on objects.

JobSet names child Jobs ``<jobset>-<replicatedJob>-<jobIndex>`` and pods
``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>-<5 random chars>``; the pod
hostname (without the random suffix) is also its DNS name under the JobSet's
headless service, ``<hostname>.<subdomain>`` with subdomain defaulting to the
JobSet name. Source: JobSet ``api/jobset/v1alpha2/jobset_types.go``
(``ReplicatedJob.Replicas``, ``Network.EnableDNSHostnames``).
"""

from __future__ import annotations

import re

#: Kubernetes DNS-1035 label: names of JobSets, Services and our stages.
DNS1035_LABEL = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
#: Kubernetes DNS-1123 label: namespaces.
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Kubernetes DNS-1123 subdomain: names of cluster-scoped and most namespaced objects.
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: Label values: at most 63 characters, alphanumeric at both ends.
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")

MAX_LABEL_LENGTH = 63
#: The random suffix the Job controller appends to pod names: ``-`` + 5 characters.
POD_SUFFIX_LENGTH = 6

#: The one replicated job of a multislice JobSet: one child Job per slice.
REPLICATED_JOB = "slice"
#: The main container of every training pod.
TRAINER_CONTAINER = "maxtext"

# Labels this project sets on every object it creates for a pipeline run.
LABEL_PIPELINE_RUN_ID = "pipeline/runid"  # the label KFP itself puts on its pods
LABEL_RUN_NAME = "multislice-pipelines/run-name"
LABEL_STAGE = "multislice-pipelines/stage"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "multislice-pipelines"

# Labels and annotations set by others that this project reads or writes.
KUEUE_QUEUE_LABEL = "kueue.x-k8s.io/queue-name"
KUEUE_PRIORITY_LABEL = "kueue.x-k8s.io/priority-class"
EXCLUSIVE_TOPOLOGY_ANNOTATION = "alpha.jobset.sigs.k8s.io/exclusive-topology"
JOBSET_NAME_KEY = "jobset.sigs.k8s.io/jobset-name"
REPLICATED_JOB_NAME_KEY = "jobset.sigs.k8s.io/replicatedjob-name"
REPLICATED_JOB_REPLICAS_KEY = "jobset.sigs.k8s.io/replicatedjob-replicas"
JOB_INDEX_KEY = "jobset.sigs.k8s.io/job-index"
JOB_GLOBAL_INDEX_KEY = "jobset.sigs.k8s.io/job-global-index"
RESTART_ATTEMPT_KEY = "jobset.sigs.k8s.io/restart-attempt"
JOB_COMPLETION_INDEX_KEY = "batch.kubernetes.io/job-completion-index"


def jobset_name(run_name: str, stage_name: str) -> str:
    """The JobSet of one stage of one run: ``<run_name>-<stage_name>``."""
    return f"{run_name}-{stage_name}"


def job_name(jobset: str, job_index: int, replicated_job: str = REPLICATED_JOB) -> str:
    """Child Job name, one per slice: ``<jobset>-<replicatedJob>-<jobIndex>``."""
    return f"{jobset}-{replicated_job}-{job_index}"


def pod_hostname(jobset: str, job_index: int, pod_index: int, replicated_job: str = REPLICATED_JOB) -> str:
    """Pod hostname: ``<jobset>-<replicatedJob>-<jobIndex>-<podIndex>``."""
    return f"{job_name(jobset, job_index, replicated_job)}-{pod_index}"


def longest_pod_name_length(jobset: str, slices: int, hosts_per_slice: int) -> int:
    """Length in characters of the longest pod name JobSet will generate, suffix included."""
    return len(pod_hostname(jobset, slices - 1, hosts_per_slice - 1)) + POD_SUFFIX_LENGTH


def max_jobset_name_length(slices: int, hosts_per_slice: int) -> int:
    """Longest JobSet name whose pod names stay within 63 characters."""
    overhead = longest_pod_name_length("", slices, hosts_per_slice)
    return MAX_LABEL_LENGTH - overhead
