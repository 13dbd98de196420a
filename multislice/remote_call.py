"""Run a Python function on every host of one or more slices, from a notebook or a script.

    import multislice

    @multislice.remote(tpu_type="v6e-16", num_slices=1, output_dir="gs://bucket/remote")
    def devices():
        import jax
        return jax.device_count()

    devices()            # 16, from the leader (slice 0, host 0)

or, without the decorator, ``multislice.run_remote(devices, tpu_type=..., ...)``.

How (the same on every backend, through :class:`multislice.backends.base.Backend`):

* the function and its arguments travel as a cloudpickle payload in the call's
  directory, ``<output_dir>/<run_name>/remote/`` (local or ``gs://``,
  :mod:`multislice.storage`); a function of ``__main__`` (a notebook) or of a
  module given in ``by_value`` is pickled by value, others by reference (their
  module must be importable in the trainer image);
* the call is planned like a run (:func:`multislice.plan.make_plan` of the
  profile with ``tpu_type``, ``num_slices``, ``run_name``: the slice must be in
  the catalog, names must be valid), and its JobSet is the stage JobSet of the
  trainer image whose container runs :mod:`multislice.trainer.remote_worker`
  instead of MaxText, with ``maxRestarts: 0`` (a failed host fails the call);
  on GKE it is queued in Kueue like any stage, locally each pod is a process
  with the emulated slices of the training worker;
* progress is told as it happens: JobSet submitted, admitted (queued in Kueue
  until then), every pod running, JAX initialised on N of M hosts, so a
  5-10 minute multi-host start-up does not look like a hang;
* the leader's stdout is printed into the caller's stdout as it comes;
* the leader's return value is returned; when any host raised,
  :class:`RemoteError` is raised naming the host (slice, host index) with its
  remote traceback, chained to the original exception when it unpickles;
* when some hosts finished (or joined JAX) and the others did not within
  ``collective_timeout`` seconds, :class:`RemoteHang` names the hosts that did
  not arrive, and the JobSet is deleted;
* KeyboardInterrupt (Ctrl-C, a kernel interrupt) deletes the JobSet (its pods,
  or processes) and is re-raised; a finished call's JobSet is deleted too.

Kinetic's advice holds here: checkpoint long functions at least every 10
minutes of wall time; a preempted or failed host fails the whole call.
"""

from __future__ import annotations

import functools
import os
import queue
import re
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

from multislice import config, storage
from multislice.errors import ConfigError, RunFailed

#: The worker's module (the container command of each pod).
WORKER_MODULE = "multislice.trainer.remote_worker"
#: Profiles a remote call is planned from, per backend (namespace, queue, images, cluster).
DEFAULT_PROFILES = {"local": "local", "gke": "gke-v6e-16x2"}
#: The one stage a remote call is planned with: only its name and JobSet are used.
_STAGE = {
    "name": "remote",
    "model": {"preset": "llama3-tiny"},
    "steps": 1,
    "per_device_batch_size": 1,
    "max_target_length": 128,
    "checkpoint_period": 1,
    "ici": {"fsdp": -1},
    "dcn": {"data": -1},
}


class RemoteError(RunFailed):
    """A host raised. Attributes: ``host`` (slice, host index), ``remote_type``, ``remote_traceback``."""

    def __init__(self, message: str, fix: str, host: tuple[int, int], remote_type: str, remote_traceback: str):
        super().__init__(message, fix)
        self.host = host
        self.remote_type = remote_type
        self.remote_traceback = remote_traceback


class RemoteHang(RunFailed):
    """Some hosts did not arrive (JAX initialisation or the function's end) within the collective timeout."""

    def __init__(self, message: str, fix: str, missing: list[tuple[int, int]]):
        super().__init__(message, fix)
        self.missing = missing


@dataclass
class RemoteCall:
    """One call's plan, backend and directory (what :func:`run_remote` holds while it waits)."""

    plan: Any
    backend: Any
    run_id: str
    call_dir: str
    hosts: list[tuple[int, int]] = field(default_factory=list)

    @property
    def jobset(self) -> str:
        """The call's JobSet name."""
        return self.plan.stages[0].jobset


def _host_key(slice_index: int, host: int) -> str:
    return f"slice-{slice_index}-host-{host}"


def plan_call(
    function_name: str,
    *,
    tpu_type: str,
    num_slices: int,
    backend: str,
    output_dir: str,
    profile: str | dict[str, Any] | None = None,
    run_id: str | None = None,
) -> Any:
    """The plan of a remote call: the profile (default per backend) with this slice and one stage.

    Raises:
        ConfigError: an unknown TPU type, a bad slice count, output directory or name (as any run).
    """
    data = dict(config.read_profile(profile or DEFAULT_PROFILES[backend]) if not isinstance(profile, dict) else profile)
    data.update(stages=[dict(_STAGE)], backend=backend, preflight={"skip": True})
    data["max_restarts"] = 0
    run_id = run_id or uuid.uuid4().hex[:8]
    stem = re.sub(r"[^a-z0-9]+", "-", function_name.lower()).strip("-")[:20].strip("-") or "fn"
    values = {"run_name": f"remote-{stem}-{run_id}", "output_dir": output_dir, "tpu_type": tpu_type,
              "num_slices": num_slices}  # fmt: skip
    spec = config.load_spec(data, values)
    from multislice.plan import make_plan

    return make_plan(spec)


def _manifest(call: RemoteCall) -> dict[str, Any]:
    """The call's JobSet: the stage JobSet with the remote worker as its container command."""
    plan, stage = call.plan, call.plan.stages[0]
    manifest = call.backend.workload_manifest(plan, stage, call.run_id)
    container = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0]
    args = ["--call-dir", call.call_dir]
    if call.backend.hardware == "cpu":
        args += ["--emulate-slices", f"--distributed-timeout={call.backend.timings.collectives_timeout:g}"]
    container["command"] = ["python", "-m", WORKER_MODULE]
    container["args"] = args
    return manifest


def _pickle_payload(function: Callable[..., Any], args: tuple, kwargs: dict, by_value: Iterable[ModuleType]) -> bytes:
    import cloudpickle

    modules = [m for m in by_value if m.__name__ != "__main__"]
    for module in modules:
        cloudpickle.register_pickle_by_value(module)
    try:
        return cloudpickle.dumps((function, args, kwargs))
    finally:
        for module in modules:
            cloudpickle.unregister_pickle_by_value(module)


def _read_outcomes(call: RemoteCall) -> tuple[set[tuple[int, int]], dict[tuple[int, int], dict[str, Any]]]:
    """Hosts that joined JAX, and each finished host's outcome (from ``hosts/`` in the call directory)."""
    import cloudpickle

    ready, results = set(), {}
    for host in call.hosts:
        key = _host_key(*host)
        if storage.path(storage.join(call.call_dir, "hosts", f"{key}.ready")).exists():
            ready.add(host)
        result = storage.path(storage.join(call.call_dir, "hosts", f"{key}.result"))
        if result.exists():
            try:
                results[host] = cloudpickle.loads(result.read_bytes())
            except Exception as error:  # the value's class is not importable here
                results[host] = {"ok": False, "type": type(error).__name__, "message": f"result unreadable: {error}",
                                 "traceback": "", "exception": None}  # fmt: skip
    return ready, results


def _raise_failure(results: dict[tuple[int, int], dict[str, Any]]) -> None:
    failed = sorted(h for h, r in results.items() if not r["ok"])
    if not failed:
        return
    import cloudpickle

    first = results[failed[0]]
    original = None
    if first.get("exception"):
        try:
            original = cloudpickle.loads(first["exception"])
        except Exception:
            original = None
    where = ", ".join(f"slice {s} host {h}" for s, h in failed)
    message = (
        f"slice {failed[0][0]} host {failed[0][1]} raised {first['type']}: {first['message']}"
        + (f" (hosts that raised: {where})" if len(failed) > 1 else "")
        + f"\n\nremote traceback (slice {failed[0][0]} host {failed[0][1]}):\n{first['traceback'].rstrip()}"
    )
    error = RemoteError(message, "fix the function; the traceback above is the host's", failed[0], first["type"],
                        first["traceback"])  # fmt: skip
    raise error from original


def run_remote(
    function: Callable[..., Any],
    *args: Any,
    tpu_type: str = "v6e-16",
    num_slices: int = 1,
    backend: Any = "local",
    output_dir: str | None = None,
    profile: str | dict[str, Any] | None = None,
    call_id: str | None = None,
    collective_timeout: float = 300.0,
    tell: Callable[[str], None] | None = None,
    out: Any = None,
    by_value: Iterable[ModuleType] = (),
    keep: bool = False,
    **kwargs: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` on every host of ``num_slices`` x ``tpu_type``; the leader's value.

    Args:
        function: Any picklable callable (cloudpickle).
        tpu_type: A slice type of the catalog (:mod:`multislice.tpu`), e.g. ``v6e-16``; the local
            backend emulates it (one process per host, one CPU device per chip).
        num_slices: Slices (JobSet replicas), joined over DCN.
        backend: ``local`` or ``gke`` (the cluster of ``profile``), or a connected
            :class:`~multislice.backends.base.Backend`.
        output_dir: Where the call's directory goes (local path or ``gs://``); default the profile's.
        profile: Profile the call is planned from (namespace, queue, images, cluster); default per backend.
        call_id: 8 characters naming the call (run ``remote-<function>-<id>``); default random.
        collective_timeout: Seconds after the first host joined JAX (or returned) that the others may take
            before :class:`RemoteHang` names them.
        tell: Where progress lines go; default ``print`` to stderr.
        out: Where the leader's output lines go; default ``sys.stdout`` at call time.
        by_value: Modules whose functions are pickled by value (not importable in the trainer image).
        keep: Keep the JobSet after it finished (local: its pods' logs stay on disk in any case).

    Returns:
        The leader's (slice 0, host 0) return value.

    Raises:
        RemoteError: a host raised (the first by slice and host; all are named).
        RemoteHang: hosts that did not arrive within ``collective_timeout``.
        ConfigError: an unknown slice, bad count, name or output directory; nothing was started.
        KeyboardInterrupt: interrupted; the JobSet was deleted first.
        multislice.errors.RunFailed: the JobSet failed otherwise (its pods' report in the message).
    """
    from multislice import backends

    given = None if isinstance(backend, str) else backend
    backend = backend if isinstance(backend, str) else given.name
    say = tell or (lambda line: print(f"[remote] {line}", file=sys.stderr, flush=True))
    write = out or sys.stdout
    name = getattr(function, "__name__", "fn")
    data = profile
    if output_dir is None:
        base = config.read_profile(profile or DEFAULT_PROFILES[backend]) if not isinstance(profile, dict) else profile
        output_dir = str(base.get("output_dir", "output"))
    if not storage.is_remote(output_dir):
        output_dir = os.path.abspath(output_dir)
    if num_slices < 1:
        raise ConfigError([("num_slices", f"{num_slices} is below 1; give 1 or more")])
    plan = plan_call(name, tpu_type=tpu_type, num_slices=num_slices, backend=backend, output_dir=output_dir,
                     profile=data, run_id=call_id)  # fmt: skip
    chosen = given or backends.backend_for(plan, say)
    run_id = plan.spec.run_name.rsplit("-", 1)[-1]
    call = RemoteCall(plan, chosen, f"remote-{run_id}", storage.join(plan.run_dir, "remote"))
    call.hosts = [(s, h) for s in range(num_slices) for h in range(plan.slice.hosts)]
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    payload = _pickle_payload(function, args, kwargs, [*by_value, *([module] if module else [])])
    target = storage.path(storage.join(call.call_dir, "payload.pkl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(payload)
    manifest = _manifest(call)
    stage = plan.stages[0]
    say(f"{name} on {num_slices} x {tpu_type} ({len(call.hosts)} hosts, backend {backend}): JobSet {call.jobset}")
    try:
        chosen.submit(manifest)
        admission = chosen.wait_admitted(plan, stage, say)
        say(f"admitted (ClusterQueue {admission.cluster_queue}, waited {admission.wait_seconds:.0f} s)")
        running = chosen.wait_running(plan, stage, say)
        say(f"pods scheduled: {len(running.placement)} of {len(call.hosts)} running")
        value = _follow(call, say, write, collective_timeout)
    except BaseException:
        say(f"stopping: deleting JobSet {call.jobset}")
        chosen.delete(call.jobset)
        raise
    if not keep:
        chosen.delete(call.jobset)
    return value


def _follow(call: RemoteCall, say: Callable[[str], None], write: Any, collective_timeout: float) -> Any:
    """Follow the JobSet in a thread; here: print the leader's lines, tell progress, watch for hangs."""
    from multislice.trainer.remote_worker import MARK

    lines: queue.Queue[str | None] = queue.Queue()
    ended: dict[str, Any] = {}

    def follow() -> None:
        try:
            ended["finished"] = call.backend.follow(call.plan, call.plan.stages[0], lines.put, lambda _: None)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            ended["error"] = error
        finally:
            lines.put(None)

    thread = threading.Thread(target=follow, name=f"follow-{call.jobset}", daemon=True)
    thread.start()
    told_ready = 0
    first_arrival: float | None = None
    poll = min(call.backend.timings.poll_seconds, 1.0)
    last_read = 0.0
    while True:
        try:
            line = lines.get(timeout=poll)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line and not line.startswith(MARK):
            write.write(line + "\n")
            write.flush()
        if time.monotonic() - last_read < poll:
            continue
        last_read = time.monotonic()
        ready, results = _read_outcomes(call)
        if len(ready) > told_ready:
            told_ready = len(ready)
            say(f"JAX initialised on {told_ready} of {len(call.hosts)} hosts")
        failed = [h for h, r in results.items() if not r["ok"]]
        if failed:
            continue  # the JobSet fails and is stopped; its end is reported below
        arrived = set(results) if results else ready
        if arrived and first_arrival is None:
            first_arrival = time.monotonic()
        if first_arrival is not None and len(arrived) < len(call.hosts):
            if time.monotonic() - first_arrival > collective_timeout:
                missing = sorted(set(call.hosts) - arrived)
                stage = "returned" if results else "joined JAX"
                where = ", ".join(f"slice {s} host {h}" for s, h in missing)
                raise RemoteHang(
                    f"{len(arrived)} of {len(call.hosts)} hosts {stage} but {where} did not arrive within "
                    f"{collective_timeout:g} s (a host hanging in a collective, or not started)",
                    "read those hosts' logs; raise collective_timeout if they are only slow",
                    missing,
                )
        elif results and len(results) == len(call.hosts):
            first_arrival = None
    thread.join()
    _, results = _read_outcomes(call)
    _raise_failure(results)
    if "error" in ended:
        raise ended["error"]
    finished = ended["finished"]
    leader = results.get((0, 0))
    if finished.phase != "Completed" or leader is None:
        raise RunFailed(
            f"JobSet {call.jobset} {finished.phase} without a result from every host:\n"
            f"{call.backend.failure_report(call.jobset)}",
            "read the pods' logs",
        )
    say(f"done: {len(results)} hosts returned")
    return leader["value"]


def remote(
    function: Callable[..., Any] | None = None,
    *,
    tpu_type: str = "v6e-16",
    num_slices: int = 1,
    **options: Any,
) -> Any:
    """Decorator form of :func:`run_remote`: ``@remote(tpu_type=..., num_slices=..., ...)`` or ``@remote``.

    The decorated function, called, runs on every host and returns the leader's value;
    ``.local(*args)`` calls the original here.
    """

    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            return run_remote(fn, *args, tpu_type=tpu_type, num_slices=num_slices, **options, **kwargs)

        call.local = fn  # type: ignore[attr-defined]
        return call

    return wrap(function) if function is not None else wrap
