"""Runs the local pipeline's components in order, in one process, up to a given step: the cancel tests' subject.

``python -m tests.cancel_driver OUTPUT_DIR STEP POD_MODE``: the plan component
for the local profile (run ``cancel``), then what STEP needs
before it (admit before launch, launch before train...), then STEP, each
through its KFP component function as a pipeline task would call it (so each
component's first statements, the cancel handler's installation, run too).
The environment's ``MULTISLICE_CANCEL_AT`` / ``MULTISLICE_CANCEL_FIFO``
(:func:`multislice.cancel.point`) stop it at a named state.

The JobSets are the real CPU JobSets with the container command replaced by
a tiny Python pod (no MaxText): it prints MaxText-style step lines, then
sleeps (POD_MODE ``sleep``) or exits 0 (``done``).

``python -m tests.cancel_driver --serve`` is the same driver pre-imported (a
zygote): importing the components (kfp, the Kubernetes client) takes about
5 s of CPU, which every case would otherwise pay again, and the zygote also
parses the CRDs and builds CEL's parser once (pure caches each case's plan
step would fill the same way). For each request it
reads on stdin (:func:`serve`) it forks a child that becomes what
``python -m tests.cancel_driver ...`` would have been at its first statement:
its own session, the request's environment and working directory, stdout and
stderr to the request's log file, the signal dispositions of a fresh
interpreter, and the same ending (the child returns from :func:`main` to the
interpreter's top level: an exception is printed and exits 1,
``KeyboardInterrupt`` ends it by SIGINT, atexit handlers run). The zygote
reports the child's pid, then its exit status.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import celpy

from components.admit import admit
from components.cleanup import cleanup
from components.launch import launch
from components.plan import plan
from components.preflight import preflight
from components.provision import provision
from components.train import train
from components.verify_checkpoint import verify_checkpoint
from multislice import cancel, config
from multislice.backends.local import backend as local_backend
from multislice.backends.local import environment
from multislice.config import parameters
from multislice.render import schema

RUN_ID = "cancel-run"
RUN_NAME = "cancel"

POD = """
import sys, time
for step in range(2):
    print(f"completed step: {step}, seconds: 0.100, TFLOP/s/device: 1.000, Tokens/s/device: 10.000, "
          f"loss: {5 - step}.000", flush=True)
if sys.argv[1] == "sleep":
    time.sleep(600)
"""

#: What runs before each step.
BEFORE = {
    "plan": [],
    "preflight": [],
    "provision": [],
    "admit": [],
    "launch": ["admit"],
    "train": ["admit", "launch"],
    "verify_checkpoint": ["admit", "launch", "train"],
    "cleanup": ["admit"],
}


class Artifact:
    """What a KFP ``Input``/``Output`` artifact is to a component: a path, metadata (Metrics: ``log_metric``)."""

    def __init__(self, path: str):
        self.path = path
        self.metadata: dict[str, Any] = {}

    def log_metric(self, key: str, value: float) -> None:
        print(f"metric {key} {value}")


class Status:
    """The fields of ``PipelineTaskFinalStatus`` the cleanup component reads."""

    state = "CANCELLED"
    error_message = ""
    pipeline_job_resource_name = ""


def fake_pods(mode: str) -> None:
    """Every JobSet the local backend renders runs :data:`POD` instead of MaxText."""
    render = local_backend.LocalBackend.workload_manifest

    def workload_manifest(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        manifest = render(self, *args, **kwargs)
        pod = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
        pod["containers"][0]["command"] = ["python", "-c", POD]
        pod["containers"][0]["args"] = [mode]
        pod["terminationGracePeriodSeconds"] = 5
        return manifest

    local_backend.LocalBackend.workload_manifest = workload_manifest
    # Not under test, and shared with other runs on this machine: free memory.
    environment.available_memory_bytes = lambda: 1 << 40


def main(output_dir: str, target: str, mode: str) -> None:
    fake_pods(mode)
    profile = config.read_profile("local")
    spec = config.load_profile("local", {"run_name": RUN_NAME, "output_dir": output_dir})
    values = {name: value for name, (_, value) in parameters.parameter_values(spec).items()}
    stage = spec.stages[0].name
    values = {k: v for k, v in values.items() if not k.startswith("stage")}
    per_stage = {"steps": spec.stages[0].steps, "per_device_batch_size": spec.stages[0].per_device_batch_size}
    plan_json = plan(profile, stage, **values, pipeline_run_id=RUN_ID, **per_stage)
    if target == "plan":
        return
    work = f"{output_dir}/artifacts"
    os.makedirs(work, exist_ok=True)
    admitted: dict[str, Any] = {}
    model = Artifact(f"{work}/model")  # train's Model output, verify_checkpoint's input
    for step in [*BEFORE[target], target]:
        if step == target:  # as in a fresh task process: no handler until the component installs one
            cancel._State.installed = 0
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            signal.signal(signal.SIGINT, signal.default_int_handler)
        if step == "preflight":
            preflight(plan_json, stage, RUN_ID, Artifact(f"{work}/hbm.html"))
        elif step == "provision":
            provision(plan_json, RUN_ID)
        elif step == "admit":
            admitted = admit(plan_json, stage, RUN_ID)
        elif step == "launch":
            launch(plan_json, stage, admitted)
        elif step == "train":
            names = ("dataset", "metrics", "curves", "summary")  # dataset: prepare_data's output (pods are fakes)
            train(plan_json, stage, admitted, *(Artifact(f"{work}/{n}") for n in names), model)
        elif step == "verify_checkpoint":
            verify_checkpoint(plan_json, stage, RUN_ID, model, Artifact(f"{work}/verification.md"))
        elif step == "cleanup":
            cleanup(
                "local", output_dir, RUN_NAME, RUN_ID, "default", {}, cluster_project="", cluster_location="",
                cluster_name="", cluster_access="", unique_run_name=False, notify_webhook_secret="", status=Status(),
            )  # fmt: skip
    print(json.dumps({"finished": target}))


def _become_driver(request: dict[str, Any], zygote: int) -> None:
    """In the forked child: become a fresh ``python -m tests.cancel_driver ARGV`` process (see the module
    docstring) and run :func:`main`. The caller returns to the interpreter's top level after it: an exception
    is printed and ends the process as it would with ``-m`` (1; SIGINT for ``KeyboardInterrupt``)."""
    os.setsid()  # as Popen(start_new_session=True): the test's signals reach it alone
    if cancel._prctl(cancel.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0 or os.getppid() != zygote:
        os._exit(127)  # the zygote (so the test) is gone: nobody waits for this case
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    # A fresh CPython's dispositions: SIGINT raises KeyboardInterrupt, SIGPIPE ignored, the rest default.
    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    main(*request["argv"])  # what follows (exit status, a traceback, atexit) is the interpreter's, as with -m


def serve() -> None:
    """The zygote: for each JSON request line on stdin (``argv``: :func:`main`'s arguments, ``env``, ``cwd``,
    ``log``: a file for the child's stdout and stderr), fork a driver, write its pid, wait for it, write its exit
    status (negative: the signal that ended it, as ``Popen.returncode``); one case at a time, until stdin ends."""
    zygote = os.getpid()
    # Caches every case's plan step would fill the same way from the same files, filled once: the CRDs parsed
    # (multislice/crds, about 1 s of CPU) and CEL's grammar built (lark's LALR tables, about 1 s).
    schema.crd_index(schema.CRDS_DIR)  # as the validators call it (functools.cache keys on the arguments given)
    celpy.Environment()
    for line in sys.stdin:
        request = json.loads(line)
        assert Path(request["cwd"]).is_dir(), request
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:
            _become_driver(request, zygote)
            return  # the child: to the interpreter's exit, never to the next request
        print(pid, flush=True)
        _, status = os.waitpid(pid, 0)
        print(os.waitstatus_to_exitcode(status), flush=True)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(*sys.argv[1:4])
