"""Preflight's AOT compiles on GKE: each request is a one-pod Job of the trainer image on a CPU node.

The pipeline's components run in the pipeline image, which has no MaxText
(its pins clash with kfp's), so on GKE the compile runs where MaxText is: a
Job of the trainer image running ``python -m multislice.trainer.aot
--request-json ...`` (:mod:`multislice.trainer.aot`), whose result line
(``AOT_RESULT {json}``) is read back from the pod's log. No TPU is requested:
libtpu compiles for the topology on the CPU. The Job runs as the trainer's
ServiceAccount, whose Workload Identity reads and writes the verdict cache in
Cloud Storage, so a rerun's Jobs answer from the cache in seconds. Its pod
asks for :data:`RESOURCES` and goes where ``preflight.node_selector`` says
(e.g. ``cloud.google.com/gke-nodepool: cpu-pool``); one the scheduler cannot
place fails the compile within ``timings.job_unschedulable_grace`` with the
scheduler's message (:class:`.jobs.JobUnschedulable`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from typing import Any

from multislice import libtpu_flags
from multislice.backends.gke import jobs
from multislice.backends.gke import pods as pod_state
from multislice.backends.gke.client import Kube
from multislice.plan import Plan
from multislice.preflight import RESULT_PREFIX, CompileTimeout, PreflightError, unknown_flag_fix
from multislice.render.trainer_job import render_trainer_job

#: What one compile asks of a CPU node: a 70B-class compile peaked at about 4 GiB resident here.
RESOURCES = {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "16Gi"}}


def job_name(plan: Plan, request: dict[str, Any]) -> str:
    """``<run_name>-aot-<10 hex of the request>``: one Job per distinct request of a run."""
    digest = hashlib.sha256(json.dumps(request, sort_keys=True).encode()).hexdigest()[:10]
    return f"{plan.spec.run_name}-aot-{digest}"


def render_job(plan: Plan, request: dict[str, Any], cache_dir: str | None, pipeline_run_id: str) -> dict[str, Any]:
    """The AOT compile Job (batch/v1): one pod, no retries, the trainer image, CPU only.

    Its container's ``LIBTPU_INIT_ARGS`` is the request's ``libtpu_flags`` as the TPU pods get them
    (:mod:`multislice.libtpu_flags`); :mod:`multislice.trainer.aot` sets the same value before compiling.
    """
    command = ["python", "-m", "multislice.trainer.aot", "--request-json", json.dumps(request)]
    if cache_dir:
        command += ["--cache-dir", cache_dir]
    env = {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    if request.get("libtpu_flags"):
        env[libtpu_flags.ENV] = libtpu_flags.init_args(request["libtpu_flags"])
    return render_trainer_job(
        plan, job_name(plan, request), command, pipeline_run_id,
        env=env, resources=RESOURCES,
        node_selector=plan.spec.preflight.node_selector,
    )  # fmt: skip


def parse_result(log: str) -> dict[str, Any] | None:
    """The last ``AOT_RESULT {json}`` line of a log, or None."""
    for line in reversed(log.splitlines()):
        if line.startswith(RESULT_PREFIX):
            return json.loads(line[len(RESULT_PREFIX) :])
    return None


class JobAotSession:
    """The GKE counterpart of :class:`multislice.preflight.AotSession`: ``compile(request)`` runs a Job.

    Args:
        kube: The API client.
        plan: The run (namespace, trainer image and ServiceAccount, labels).
        cache_dir: The verdict cache the Jobs use (``gs://``), or None.
        pipeline_run_id: Labels the Jobs, so cleanup deletes them if the run is cancelled.
        on_progress: Called with progress lines.
    """

    def __init__(
        self,
        kube: Kube,
        plan: Plan,
        cache_dir: str | None,
        pipeline_run_id: str,
        on_progress: Callable[[str], None] = print,
    ):
        self.kube, self.plan, self.cache_dir = kube, plan, cache_dir
        self.pipeline_run_id, self.on_progress = pipeline_run_id, on_progress

    def __enter__(self) -> JobAotSession:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def compile(self, request: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Run one request as a Job and return its result.

        Raises:
            PreflightError: the Job left no result line (the message quotes its events and log tail), or its
                pod could not be scheduled (the message quotes the scheduler).
            CompileTimeout: the Job did not finish within ``timeout`` seconds.
        """
        body = render_job(self.plan, request, self.cache_dir, self.pipeline_run_id)
        try:
            state, log, pod = jobs.run_job(
                self.kube, body, timeout=timeout, on_progress=self.on_progress, what="AOT compile Job"
            )
        except TimeoutError as error:
            raise CompileTimeout(str(error), "raise timeouts.compile, or check the Job's pod events") from None
        except jobs.JobUnschedulable as error:
            wanted = ", ".join(f"{k} {v}" for k, v in RESOURCES["requests"].items())
            raise PreflightError(
                error.message,
                f"set preflight.node_selector to a CPU node pool with {wanted} free per compile (now "
                f"{self.plan.spec.preflight.node_selector or 'none'}), or add such a pool or autoscaling",
            ) from None
        result = parse_result(log)
        if result is None:
            detail = pod_state.events(self.kube, pod) if pod else "no pod found"
            raise PreflightError(
                f"AOT compile Job {body['metadata']['name']} {state} without a result; events:\n{detail}\n"
                "last log lines:\n" + "\n".join(log.splitlines()[-20:]),
                unknown_flag_fix(log),
            )
        return result
