"""prepare_data's shard workers as one Indexed Job (batch/v1) of the trainer image on CPU nodes.

The Job runs ``python -m multislice.trainer.prepare_shards worker --request <json>``
(:func:`multislice.trainer.prepare_shards.worker_command`) with ``completionMode: Indexed``,
``completions`` = the number of source ranges and ``parallelism`` = ``data.parallelism`` (default all): the
Job controller (kubernetes ``pkg/controller/job/indexed_job_utils.go``) creates one pod per completion index,
named ``<job>-<index>-<random>`` (``podGenerateNameWithIndex``), with the index in its
``batch.kubernetes.io/job-completion-index`` annotation and label (``addCompletionIndexAnnotation``,
``addCompletionIndexLabel``) and in ``$JOB_COMPLETION_INDEX`` (``addCompletionIndexEnvVariable``), which the worker
reads as its range. Each index may fail once and be retried (``backoffLimitPerIndex: 1``; a retried worker reuses
a part it finished); a second failure of any index fails the Job (``maxFailedIndexes: 0``).

The workers read the sources and write their parts on ``gs://`` as the trainer's ServiceAccount (Workload
Identity, :mod:`multislice.render.rbac`); the step reads the parts back from storage, not from the pods' logs.
Their pods go to ``preflight.node_selector``'s nodes (the CPU node pool of the compile Jobs: docs/gke-setup.md),
each asking for :data:`CPU` and :data:`MEMORY` (request = limit: the scheduler places a worker only where it fits;
the measured peak is in benchmarks/results/prepare_data.json). Like the verifier and export Jobs, the Job carries
no Kueue queue label: Kueue's TPU quota is not the workers' to take.

What it does not do: follow the workers' logs as they run (the step tells the Job's progress from
``status.succeeded``; a failed index's log tail is quoted).
"""

from __future__ import annotations

from typing import Any, cast

from multislice import names
from multislice.backends.base import DataWorkersFailed, Tell, WorkerExit
from multislice.backends.gke import jobs
from multislice.backends.gke.client import Kube
from multislice.config.data import TextData
from multislice.plan import Plan, StagePlan
from multislice.render.trainer_job import render_trainer_job
from multislice.trainer import prepare_shards

#: CPUs one worker's pod asks for: tokenizing is one Python thread.
CPU = "1"
#: Memory one worker's pod asks for (and its limit); a worker's peak measured locally is about 0.6 GiB
#: (benchmarks/results/prepare_data.json: the tokenizer, the token buffers, one shard's writer).
MEMORY = "2Gi"
#: The pod annotation (and label) holding a pod's completion index (kubernetes ``batch/v1`` ``types.go``,
#: ``JobCompletionIndexAnnotation``).
INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"


def job_name(stage: StagePlan, request: dict[str, Any]) -> str:
    """``<jobset>-data-<fingerprint[:6]>``: one Job per source set (a retried step adopts it; another run on changed
    sources gets its own). The JobSet name leaves room: at most 47 characters (:func:`multislice.names.
    max_jobset_name_length`), so at most 59, and the Job controller shortens its pods' generated names itself."""
    return f"{stage.workload}-data-{request['fingerprint'][:6]}"


def render_job(plan: Plan, stage: StagePlan, request: dict[str, Any], pipeline_run_id: str) -> dict[str, Any]:
    """The shard workers' Indexed Job (batch/v1): ``request["workers"]`` completions, ``data.parallelism`` at once."""
    count = int(request["workers"])
    parallelism = getattr(plan.spec.stage(stage.name).data, "parallelism", None) or count
    job = render_trainer_job(
        plan, job_name(stage, request), prepare_shards.worker_command(request), pipeline_run_id, stage=stage,
        resources={"requests": {"cpu": CPU, "memory": MEMORY}, "limits": {"memory": MEMORY}},
        node_selector=plan.spec.preflight.node_selector,
    )  # fmt: skip
    spec = job["spec"]
    spec.pop("backoffLimit", None)  # per index instead
    spec.update(
        completionMode="Indexed", completions=count, parallelism=min(parallelism, count),
        backoffLimitPerIndex=1, maxFailedIndexes=0,
    )  # fmt: skip
    return job


#: The fingerprint of the Job ``multislice render`` shows (a dry run lists no source): the run's hashes the
#: sources it lists (:func:`multislice.trainer.prepare_shards.fingerprint_of`), which names its Job and parts.
PLACEHOLDER_FINGERPRINT = "0" * 64
#: The annotation saying which of a rendered Job's values the run sets (no run reads it).
PLACEHOLDER_ANNOTATION = "multislice-pipelines/placeholder"


def placeholder_job(plan: Plan, stage: StagePlan, pipeline_run_id: str) -> dict[str, Any] | None:
    """The shard workers' Job prepare_data creates for a ``text`` stage on GKE, as ``multislice render`` shows it
    (None for a stage with other data): :func:`render_job` of the request
    :func:`multislice.trainer.prepare_shards.work_request` makes, with what only the run knows put in. The run
    lists the sources first; here the fingerprint is :data:`PLACEHOLDER_FINGERPRINT` (the Job's name and the
    parts directory carry it) and ``completions`` is ``data.workers`` (the run's is at most that: one range per
    source file when there are fewer). :data:`PLACEHOLDER_ANNOTATION` says so on the object.
    """
    spec = plan.spec.stage(stage.name)
    data = spec.data
    if not isinstance(data, TextData) or stage.data_dir is None:
        return None
    fingerprint = PLACEHOLDER_FINGERPRINT
    request = {
        "data": data.model_dump(mode="json"), "tokenizer": spec.tokenizer.model_dump(mode="json"),
        "max_target_length": spec.max_target_length, "out_dir": stage.data_dir,
        "parts_dir": f"{stage.data_dir}.parts-{fingerprint[:16]}", "fingerprint": fingerprint, "workers": data.workers,
    }  # fmt: skip
    job = render_job(plan, stage, request, pipeline_run_id)
    job["metadata"]["annotations"] = {
        PLACEHOLDER_ANNOTATION: "rendered without listing data.files: at run time the name's and parts_dir's "
        f"{fingerprint[:6]}... is the sources' fingerprint and completions is min(data.workers, source files)"
    }
    return job


def _pods(kube: Kube, name: str) -> list[dict[str, Any]]:
    found = kube.call(
        kube.core.list_namespaced_pod, kube.namespace, label_selector=f"job-name={name}", what=f"list pods of {name}"
    )
    return [cast(dict[str, Any], kube.api.sanitize_for_serialization(p)) for p in found.items]


def _exit(pod: dict[str, Any]) -> WorkerExit:
    meta = pod.get("metadata", {})
    index = (meta.get("annotations") or {}).get(INDEX_ANNOTATION) or (meta.get("labels") or {}).get(INDEX_ANNOTATION)
    code = None
    for status in (pod.get("status") or {}).get("containerStatuses") or []:
        code = ((status.get("state") or {}).get("terminated") or {}).get("exitCode", code)
    return WorkerExit(index=int(index) if index is not None else -1, exit_code=code, pod=meta.get("name"))


def run(
    kube: Kube, plan: Plan, stage: StagePlan, request: dict[str, Any], pipeline_run_id: str, *, timeout: float,
    tell: Tell,
) -> list[WorkerExit]:  # fmt: skip
    """Create (or adopt) the Indexed Job, wait for its end; how each index's last pod ended.

    Raises:
        DataWorkersFailed: the Job failed (a failed index's exit code and log tail quoted), or ran past ``timeout``
            seconds (it was deleted).
        multislice.backends.gke.jobs.JobUnschedulable: no CPU node fits a worker's requests.
        multislice.backends.gke.jobset.JobSetConflict: a Job of that name with another spec exists.
    """
    body = render_job(plan, stage, request, pipeline_run_id)
    name = body["metadata"]["name"]
    try:
        state, _, _ = jobs.run_job(kube, body, timeout=timeout, on_progress=tell, what="shard workers' Indexed Job")
    except TimeoutError as error:
        raise DataWorkersFailed(
            str(error), "raise timeouts.prepare_data, or data.workers to split the sources further"
        ) from None
    last: dict[int, tuple[dict[str, Any], WorkerExit]] = {}
    for pod in _pods(kube, name):
        ended = _exit(pod)
        last[ended.index] = (pod, ended)  # the API lists by name; a retried index's later pod wins when it ended
    exits = sorted((e for _, e in last.values()), key=lambda e: e.index)
    if state != "Complete":
        failed = next((e for e in exits if e.exit_code not in (0, None)), exits[-1] if exits else None)
        tail = ""
        if failed is not None and failed.pod is not None:
            log = kube.call(
                kube.core.read_namespaced_pod_log, failed.pod, kube.namespace, container=names.TRAINER_CONTAINER,
                what=f"read log of {failed.pod}",
            )  # fmt: skip
            tail = "\n".join(str(log).splitlines()[-20:])
        which = f"index {failed.index} (pod {failed.pod}, exit code {failed.exit_code})" if failed else "no pod"
        raise DataWorkersFailed(
            f"the shard workers' Indexed Job {name} {state}: {which}; its last lines:\n{tail}",
            "fix the cause above (the data spec's files, their format, the tokenizer; that the trainer's "
            "ServiceAccount may read the sources and write the dataset directory), then rerun",
        )
    tell(f"{name}: {len(exits)} of {request['workers']} shard workers completed")
    return exits
