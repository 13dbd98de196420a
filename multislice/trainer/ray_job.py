"""A RayJob on this machine: the local backend's Ray stage, run the way KubeRay runs a ``RayJob``.

Usage (the command of the local backend's Ray driver pod,
:func:`multislice.render.jobset.render_ray_driver_jobset`)::

    python -m multislice.trainer.ray_job --name=NAME --num-cpus=N -- python -m multislice.trainer.ray_driver ...

What it plays, in KubeRay's order (ray-project/kuberay v1.7.0):

1. **The head pod**: ``ray start --head --block`` with the dashboard, as KubeRay's head container runs it
   (``ray-operator/controllers/ray/common/pod.go``, ``generateRayStartCommand`` and
   ``setMissingRayStartParams``: ``--block``, ``--dashboard-agent-listen-port``, ``--metrics-export-port``).
   Several local runs share one machine, so every port with a fixed default (GCS 6379, dashboard 8265,
   dashboard agent 52365, Ray Client 10001, metrics 8080 in KubeRay) is a free port picked for this run,
   and the head keeps its session under its own ``--temp-dir``: the Jobs API's supervisor finds "its"
   cluster through ``<temp-dir>/ray_current_cluster`` (ray 2.60.0
   ``ray/dashboard/modules/job/job_supervisor.py``, ``_get_driver_env_vars``), which in the shared
   ``/tmp/ray`` would name whichever run started last.
2. **Readiness**: ``GET /api/healthz`` on the dashboard agent's listen port until it answers 200: the
   liveness and readiness probe KubeRay v1.7.0 gives head and worker pods for ``rayVersion`` >= 2.53
   (``pod.go``, ``initLivenessAndReadinessProbe``, ``supportsUnifiedHealthCheck``: an ``httpGet`` on
   ``utils.RayNodeHealthPath`` at ``dashboard-agent-listen-port``, default 52365). Ray serves it only with
   ``ray[default]`` (``ray/dashboard/modules/reporter/healthz_agent.py``, not a minimal module; without the
   dashboard's packages ``ray/_private/services.py`` starts the dashboard and agent with ``--minimal``).
3. **The K8sJobMode submitter** (``ray-operator/controllers/ray/common/job.go``, ``BuildJobSubmitCommand``):
   wait for the dashboard's ``/api/gcs_healthz``, submit the entrypoint with a submission id
   ``<name>-<5 characters>`` (``utils.GenerateRayJobId``), then follow its logs; here through
   :class:`ray.job_submission.JobSubmissionClient` (``submit_job``, ``tail_job_logs``, ``get_job_status``),
   the SDK behind ``ray job submit`` / ``ray job logs``. The entrypoint is the driver's argument list joined
   with :func:`shlex.join` (the RayJob's ``spec.entrypoint`` on GKE is the same string,
   :func:`multislice.render.ray.render_rayjob`).

The job's end is the pod's: exit 0 when the job ``SUCCEEDED``, 1 otherwise, after a last line naming the
submission id, the status and Ray's message (the driver's exit code is in it). The head stops when the job has
ended. On SIGTERM (a delete, a cancel: the local supervisor signals the pod's process group) the job is stopped
through the Jobs API and the head is stopped before this process exits; every Ray process (GCS, raylet,
dashboard, agent, the job's driver and workers) carries :data:`HEAD_ENV` = this head's temp dir, so a test can
check that none is left (:func:`head_processes`).

Local only: Ray's memory monitor is off (``RAY_memory_monitor_refresh_ms=0``, Ray's "Out-Of-Memory
Prevention" page): it kills workers when the whole machine passes 95 % memory, whoever uses it, and each kill
costs a ``FailureConfig`` retry; the local backend checks memory before a stage starts instead.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import shlex
import shutil
import signal
import socket
import string
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The address the head is reached at: one machine, so loopback. The dashboard binds it (``--dashboard-host``);
#: the agent binds the node's address and loopback (ray 2.60.0 ``dashboard/http_server_agent.py``); Ray takes
#: the node's address itself (``ray start`` turns a loopback ``--node-ip-address`` into it,
#: ``services.resolve_ip_for_localhost``).
HOST = "127.0.0.1"
#: KubeRay v1.7.0's probe path for rayVersion >= 2.53 (``utils.RayNodeHealthPath``), on the dashboard agent.
HEALTH_PATH = "/api/healthz"
#: The dashboard's GCS health path the K8sJobMode submitter waits on (``utils.RayDashboardGCSHealthPath``).
GCS_HEALTH_PATH = "/api/gcs_healthz"
#: Set in the head's environment (its value: the head's temp dir); every Ray process of the head inherits it.
HEAD_ENV = "MULTISLICE_RAY_HEAD"
#: How long the head may take to answer its health check, seconds. On two cores under a load average above
#: 15, the raylet's waits for its dashboard agent (RayConfig ``raylet_start_wait_time_s``, the agent's port
#: files, and ``agent_register_timeout_ms``) run out at their defaults (30 s, about 15 s); they get this long.
START_PATIENCE = 600.0
#: Tries at starting the head (fresh ports each time): a port picked free can be taken before Ray binds it.
START_TRIES = 3
#: Seconds between health checks (KubeRay's readiness ``periodSeconds`` is 5; a local head is polled faster).
PROBE_PERIOD = 1.0
#: Seconds one health request may take (KubeRay's head probe ``timeoutSeconds``).
PROBE_TIMEOUT = 5.0
#: How long the job may take to stop (Jobs API ``stop_job``), then the head (after SIGTERM, before SIGKILL),
#: seconds: together within the driver pod's 30 s ``terminationGracePeriodSeconds``.
JOB_STOP_TIMEOUT = 10.0
STOP_TIMEOUT = 15.0
#: Terminal Jobs API statuses (``ray.job_submission.JobStatus``).
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


class HeadFailed(RuntimeError):
    """The head did not become healthy: its ``ray start`` exited, or its health check never answered 200."""


class Terminated(Exception):  # noqa: N818 - a signal, not an error
    """SIGTERM (or SIGINT) arrived: stop the job and the head."""


@dataclass(frozen=True)
class HeadPorts:
    """The head's ports (TCP, on :data:`HOST`), picked free for one run."""

    gcs: int
    dashboard: int
    agent: int
    client: int
    metrics: int


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on every address now (the kernel's picks, held open together)."""
    sockets = []
    try:
        for _ in range(count):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            sockets.append(sock)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for sock in sockets:
            sock.close()


def head_command(ports: HeadPorts, num_cpus: int, temp_dir: Path) -> list[str]:
    """``ray start --head --block`` with the dashboard and this run's ports, as KubeRay's head container runs it."""
    return [
        sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
        f"--port={ports.gcs}",
        "--include-dashboard=true", f"--dashboard-host={HOST}", f"--dashboard-port={ports.dashboard}",
        f"--dashboard-agent-listen-port={ports.agent}", f"--ray-client-server-port={ports.client}",
        f"--metrics-export-port={ports.metrics}", f"--num-cpus={num_cpus}", f"--temp-dir={temp_dir}",
        "--disable-usage-stats",
    ]  # fmt: skip


def head_env(temp_dir: Path) -> dict[str, str]:
    """The head's environment: this one's, with the local instance's Ray settings (module docstring)."""
    env = dict(os.environ)
    env.setdefault("RAY_memory_monitor_refresh_ms", "0")
    env.setdefault("RAY_raylet_start_wait_time_s", f"{START_PATIENCE:.0f}")
    env.setdefault("RAY_agent_register_timeout_ms", f"{START_PATIENCE * 1000:.0f}")
    # A SIGTERMed `ray start --block` first drains the node for up to 30 s (ray 2.60.0 _private/node.py,
    # _drain_node_before_shutdown), for Ray Serve; a training head has nothing to drain and the pod's grace
    # period is 30 s.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    env[HEAD_ENV] = str(temp_dir)
    return env


def http_status(url: str, timeout: float = PROBE_TIMEOUT) -> int | None:
    """The HTTP status of ``GET url``; None when nothing answered (refused, reset, timed out)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - a loopback http URL
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, ValueError):
        return None


class Head:
    """A Ray head on this machine (``ray start --head --block``), healthy once :meth:`wait_healthy` returns.

    Args:
        num_cpus: The head's logical CPUs (``--num-cpus``).
    """

    def __init__(self, num_cpus: int):
        self.num_cpus = num_cpus
        # Short: Ray's Unix sockets live under it (a socket path is at most 107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
        self.ports = HeadPorts(*free_ports(5))
        self.process: subprocess.Popen | None = None

    @property
    def dashboard_url(self) -> str:
        """The dashboard's (and Jobs API's) address."""
        return f"http://{HOST}:{self.ports.dashboard}"

    @property
    def health_url(self) -> str:
        """KubeRay's probe URL: the dashboard agent's ``/api/healthz``."""
        return f"http://{HOST}:{self.ports.agent}{HEALTH_PATH}"

    def start(self) -> None:
        """Start ``ray start --head --block`` (it stays in this process group: a group signal reaches it)."""
        self.process = subprocess.Popen(
            head_command(self.ports, self.num_cpus, self.temp_dir), env=head_env(self.temp_dir),
            stdin=subprocess.DEVNULL,
        )  # fmt: skip

    def wait_healthy(self, timeout: float = START_PATIENCE) -> None:
        """Wait for 200 from the agent's ``/api/healthz`` and the dashboard's ``/api/gcs_healthz``.

        Raises:
            HeadFailed: ``ray start`` exited, or no 200 within ``timeout`` seconds.
        """
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout
        for url in (self.health_url, f"{self.dashboard_url}{GCS_HEALTH_PATH}"):
            while (status := http_status(url)) != 200:
                try:  # waits on the head's exit, at most one probe period
                    code = self.process.wait(timeout=PROBE_PERIOD)
                except subprocess.TimeoutExpired:
                    code = None
                if code is not None:
                    raise HeadFailed(f"ray start --head exited with status {code} before {url} answered 200")
                if time.monotonic() > deadline:
                    raise HeadFailed(f"{url} did not answer 200 within {timeout:.0f} s (last: {status})")
        print(f"multislice ray job: head healthy: GET {self.health_url} -> 200", flush=True)

    def stop(self) -> list[int]:
        """SIGTERM the head (``ray start`` stops the processes it started), SIGKILL after :data:`STOP_TIMEOUT`;
        then SIGKILL what is left of it (:func:`head_processes`) and remove its temp dir.

        What can be left: the job's driver and the shell that watches its supervisor actor (it kills the
        driver's process group within a second of the actor's end). The Jobs API runs both in sessions of
        their own (``subprocess.Popen(..., start_new_session=True)``, ray 2.60.0 ``job_supervisor.py``,
        ``_exec_entrypoint``), out of reach of a signal to the pod's process group and of ``ray start``'s
        stop. In a Kubernetes pod the container's end kills every process in it; this is that end.

        Returns:
            The process ids killed after the head's stop (empty when the head's own stop ended everything).
        """
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        left = head_processes(self.temp_dir)
        for pid in left:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if left:
            # the Jobs API's driver or the shell that watches it for its supervisor: sessions of their own
            print(f"multislice ray job: killed processes {left} of the job, left by the head's stop", flush=True)
        shutil.rmtree(self.temp_dir, ignore_errors=True)
        return left


def start_head(num_cpus: int, tries: int = START_TRIES, timeout: float = START_PATIENCE) -> Head:
    """A healthy head, up to ``tries`` times (fresh ports and temp dir each time).

    Raises:
        HeadFailed: The last try's.
    """
    for attempt in range(1, tries + 1):
        head = Head(num_cpus)
        command = shlex.join(head_command(head.ports, num_cpus, head.temp_dir))
        print(f"multislice ray job: starting the Ray head (try {attempt}): {command}", flush=True)
        head.start()
        try:
            head.wait_healthy(timeout)
            return head
        except HeadFailed as error:
            head.stop()
            if attempt == tries:
                raise
            print(f"multislice ray job: {error}; trying again", flush=True)
        except BaseException:
            head.stop()
            raise
    raise AssertionError("unreachable")


def submission_id(name: str) -> str:
    """``<name>-<5 lowercase letters or digits>``, as KubeRay's ``GenerateRayJobId``."""
    alphabet = string.ascii_lowercase + string.digits
    return f"{name}-{''.join(secrets.choice(alphabet) for _ in range(5))}"


def follow(client: Any, job_id: str, out: Any = None) -> str:
    """Write the job's logs to ``out`` (default stdout) as they come (``tail_job_logs``) and return its terminal
    status. If the log stream ends before the job does (a dropped connection), wait on ``get_job_status`` and
    write what the stream missed (``get_job_logs`` past what was written)."""
    out = out or sys.stdout
    written = 0

    async def tail() -> None:
        nonlocal written
        async for chunk in client.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()
            written += len(chunk)

    asyncio.run(tail())
    while (status := str(client.get_job_status(job_id))) not in TERMINAL:
        time.sleep(PROBE_PERIOD)  # the stream ended early: poll the status, as KubeRay's RayJob controller does
    rest = client.get_job_logs(job_id)[written:]
    if rest:
        out.write(rest)
        out.flush()
    return status


def stop_job(client: Any, job_id: str, timeout: float = JOB_STOP_TIMEOUT) -> None:
    """Stop the job through the Jobs API (``stop_job``: its supervisor SIGTERMs the driver's process group) and
    wait up to ``timeout`` seconds for a terminal status. Best effort: on a group signal the dashboard may be
    stopping too; the head's stop then ends the driver (its supervisor's watcher kills the driver's group when
    the supervisor actor dies, ray 2.60.0 ``job_supervisor.py``, ``_exec_entrypoint``)."""
    deadline = time.monotonic() + timeout
    try:
        client.stop_job(job_id)
        while str(client.get_job_status(job_id)) not in TERMINAL and time.monotonic() < deadline:
            time.sleep(PROBE_PERIOD / 4)
    except Exception as error:  # noqa: BLE001 - the SDK raises RuntimeError or a requests error
        print(f"multislice ray job: could not stop {job_id} through the Jobs API: {error}", flush=True)


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    """Split the options from the entrypoint after ``--``.

    Raises:
        SystemExit: (argparse) a missing option or an empty entrypoint.
    """
    split = argv.index("--") if "--" in argv else len(argv)
    parser = argparse.ArgumentParser(
        prog="python -m multislice.trainer.ray_job", description=(__doc__ or "").split("\n")[0]
    )
    parser.add_argument("--name", required=True, help="the workload's name: the submission id's prefix")
    parser.add_argument("--num-cpus", type=int, required=True, help="the head's logical CPUs (ray start --num-cpus)")
    options = parser.parse_args(argv[:split])
    entrypoint = argv[split + 1 :]
    if not entrypoint:
        parser.error("the job's entrypoint goes after --, e.g. -- python -m multislice.trainer.ray_driver ...")
    return options, entrypoint


def _terminated(signum: int, frame: Any) -> None:
    # once: a second signal must not cut the job's and the head's stop short
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise Terminated(signal.Signals(signum).name)


def main(argv: list[str] | None = None) -> int:
    """Start the head, submit and follow the job, stop the head; 0 when the job SUCCEEDED."""
    options, entrypoint = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _terminated)
    signal.signal(signal.SIGINT, _terminated)
    head: Head | None = None
    client: Any = None
    job_id = submission_id(options.name)
    try:
        head = start_head(options.num_cpus)
        from ray.job_submission import JobSubmissionClient  # ray imports in ~2 s: after the head is started

        client = JobSubmissionClient(head.dashboard_url)
        client.submit_job(entrypoint=shlex.join(entrypoint), submission_id=job_id)
        print(f"multislice ray job: submitted {job_id} through the Jobs API at {head.dashboard_url}", flush=True)
        status = follow(client, job_id)
        info = client.get_job_info(job_id)
        # the message's first line only: Ray appends the driver's last log lines, already passed on above
        message = info.message.splitlines()[0] if info.message else ""
        print(f"multislice ray job: {job_id} {status} (driver exit code {info.driver_exit_code}): {message}",
              flush=True)  # fmt: skip
        return 0 if status == "SUCCEEDED" else 1
    except Terminated as signal_name:
        print(f"multislice ray job: {signal_name}: stopping job {job_id} and the head", flush=True)
        if client is not None:
            stop_job(client, job_id)
        return 128 + signal.SIGTERM
    except HeadFailed as error:
        print(f"multislice ray job: the Ray head did not become healthy: {error}", flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second signal must not cut the head's stop short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        if head is not None:
            head.stop()


def head_processes(temp_dir: str | Path) -> list[int]:
    """Process ids of this machine whose environment has :data:`HEAD_ENV` = ``temp_dir``: the head's processes,
    its job's driver and workers. Processes whose environment cannot be read (another user's) are skipped."""
    wanted = f"{HEAD_ENV}={temp_dir}".encode()
    found = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            environ = (proc / "environ").read_bytes()
        except OSError:
            continue
        if wanted in environ.split(b"\0"):
            found.append(int(proc.name))
    return found


if __name__ == "__main__":
    sys.exit(main())
