"""Run a Python function on every host of one or more slices, from a notebook or a script.

    import multislice

    @multislice.remote(tpu_type="v6e-16", num_slices=1, output_dir="gs://bucket/remote")
    def devices():
        import jax
        return jax.device_count()

    devices()            # 16, from the leader (slice 0, host 0)

or, without the decorator, ``multislice.run_remote(devices, tpu_type=..., ...)``.

The call's own options and the function's arguments never mix: with the decorator the options go to
``remote(...)`` (or ``.options(...)``, which returns a copy with some changed) and every argument of the
call, keyword arguments included, goes to the function, so a function may take ``keep=`` or
``tpu_type=`` itself. ``run_remote(function, *args, kwargs={...}, <options>)`` passes ``args`` and the
``kwargs`` mapping to the function; its other keywords are its options, and a keyword that is none of
them is refused with the fix (before this, unknown keywords went to the function and a keyword named
like an option was silently taken by the call). Every option's type, the function's callability and
the picklability of the function and each argument are checked before anything is created, each
refusal a :class:`~multislice.errors.ConfigError` naming the argument.

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
  remote traceback, chained to the original exception when it unpickles; a
  host that ended without a result (``os._exit(N)``, a crash in native code,
  a kill) is :class:`RemoteExit`, naming that host and its exit code, ahead of
  the errors the other hosts raise because it left (see :func:`blamed_host`);
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
import math
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

from multislice import backends, config, storage
from multislice.backends.base import Backend
from multislice.config.values import INT32_MAX, MAX_TIMEOUT_SECONDS, output_dir_problem
from multislice.errors import ConfigError, RunFailed
from multislice.plan import make_plan
from multislice.trainer.remote_worker import MARK

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


class RemoteExit(RunFailed):
    """A host ended without returning or raising: ``host`` (slice, host index) and its ``exit_code``."""

    def __init__(self, message: str, fix: str, host: tuple[int, int], exit_code: int):
        super().__init__(message, fix)
        self.host = host
        self.exit_code = exit_code


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


#: Within this many seconds of the first failure, failures are taken as simultaneous (the local supervisor
#: records exits when it polls; the kubelet's ``finishedAt`` has whole seconds).
SIMULTANEOUS_SECONDS = 1.0


def blamed_host(
    results: dict[tuple[int, int], dict[str, Any]], exits: list[Any]
) -> tuple[tuple[int, int], int | None] | None:
    """The host whose failure ended the call, and its exit code when it left no result; None when none failed.

    A host that failed is one that raised (its result says so) or one whose pod ended with a non-zero code, or
    with 0, without a result. The first by time is blamed (``finished_at`` of :class:`PodExit`; failures
    within :data:`SIMULTANEOUS_SECONDS` of the first count as simultaneous); among simultaneous ones, a host
    that ended by itself without a result (exit code 0-128: ``os._exit``, a native crash) comes before a host
    that raised, which comes before one killed by a signal (129-255: the supervisor or kubelet stopping the
    others, or the OOM killer): when one host leaves, the others' collectives fail and they raise
    ("Unable to initialize backend", a coordination error), which is a consequence, not the cause.
    """
    by_host = {(e.slice_index, e.host): e for e in exits}
    failed: list[tuple[float, int, tuple[int, int], int | None]] = []
    for host in set(results) | set(by_host):
        outcome, ended = results.get(host), by_host.get(host)
        code = ended.exit_code if ended else None
        when = ended.finished_at if ended and ended.finished_at is not None else float("inf")
        if outcome is not None and not outcome["ok"]:
            failed.append((when, 1, host, None))
        elif outcome is None and code is not None:
            failed.append((when, 0 if code <= 128 else 2, host, code))
    if not failed:
        return None
    first = min(when for when, *_ in failed)
    simultaneous = [f for f in failed if f[0] <= first + SIMULTANEOUS_SECONDS or first == float("inf")]
    _, _, host, code = min(simultaneous, key=lambda f: (f[1], f[0], f[2]))
    return host, code


def _raise_failure(results: dict[tuple[int, int], dict[str, Any]], exits: list[Any] | None = None) -> None:
    blamed = blamed_host(results, exits or [])
    if blamed is None:
        return
    host, code = blamed
    raised = sorted(h for h, r in results.items() if not r["ok"])
    if host not in results:
        others = f"; afterwards {', '.join(f'slice {s} host {h}' for s, h in raised)} raised" if raised else ""
        signal = f" (signal {code - 128})" if code and code > 128 else ""
        raise RemoteExit(
            f"slice {host[0]} host {host[1]} exited with code {code}{signal} without returning or raising "
            f"(os._exit, a crash in native code, or a kill such as the OOM killer){others}",
            "read that host's pod log; a function must return or raise on every host",
            host,
            code,
        )
    import cloudpickle

    failed = [host, *(h for h in raised if h != host)]
    first = results[host]
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


#: The options of a call (:func:`run_remote`'s keywords besides ``kwargs``) and their defaults.
OPTIONS: dict[str, Any] = {
    "tpu_type": "v6e-16",
    "num_slices": 1,
    "backend": "local",
    "output_dir": None,
    "profile": None,
    "call_id": None,
    "collective_timeout": 300.0,
    "tell": None,
    "out": None,
    "by_value": (),
    "keep": False,
}
_CALL_ID = re.compile(r"[a-z0-9]{1,8}")


def option_issues(options: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, message)`` for each unknown option or option of the wrong type or range; empty when all are fine.

    Types: ``tpu_type`` a string; ``num_slices`` a whole number 1 to 2^31-1 (JobSet replicas); ``backend``
    ``local``, ``gke`` or a :class:`~multislice.backends.base.Backend`; ``output_dir`` None or a path or
    ``gs://`` URL; ``profile`` None, a name or path, or a profile's content (a dict); ``call_id`` None or 1-8
    lower-case letters and digits; ``collective_timeout`` seconds, more than 0 and at most
    :data:`multislice.config.values.MAX_TIMEOUT_SECONDS`; ``tell`` None or a callable; ``out`` None or an
    object with ``write``; ``by_value`` modules; ``keep`` true or false.
    """
    issues: list[tuple[str, str]] = []
    for name in options:
        if name not in OPTIONS:
            issues.append(
                (name, f"{name!r} is not an option of the call ({', '.join(OPTIONS)}); give the function's own "
                       f"keyword arguments as kwargs={{{name!r}: ...}} to run_remote, or call the function "
                       "made by multislice.remote(...), which passes every keyword argument to it")
            )  # fmt: skip
    o = {**OPTIONS, **{k: v for k, v in options.items() if k in OPTIONS}}

    def bad(name: str, what: str) -> None:
        issues.append((name, f"{o[name]!r} ({type(o[name]).__name__}) is not {what}"))

    if not isinstance(o["tpu_type"], str):
        bad("tpu_type", "a TPU type name such as 'v6e-16'")
    if isinstance(o["num_slices"], bool) or not isinstance(o["num_slices"], int):
        bad("num_slices", "a whole number of slices, e.g. num_slices=2")
    elif not 1 <= o["num_slices"] <= INT32_MAX:
        issues.append(("num_slices", f"{o['num_slices']} is outside 1 to {INT32_MAX:,}; give 1 or more slices"))
    if not isinstance(o["backend"], Backend) and o["backend"] not in DEFAULT_PROFILES:
        bad("backend", f"a backend: {' or '.join(repr(b) for b in DEFAULT_PROFILES)}, or a connected Backend")
    if o["output_dir"] is not None:
        if not isinstance(o["output_dir"], str):
            bad("output_dir", "a directory path or gs:// URL")
        elif problem := output_dir_problem(o["output_dir"]):
            issues.append(("output_dir", problem))
    if o["profile"] is not None and not isinstance(o["profile"], (str, dict)):
        bad("profile", "a profile name, a path to a .yaml, or a profile's content (a dict)")
    if o["call_id"] is not None and not (isinstance(o["call_id"], str) and _CALL_ID.fullmatch(o["call_id"])):
        bad("call_id", "1 to 8 lower-case letters and digits")
    timeout = o["collective_timeout"]
    number = isinstance(timeout, (int, float)) and not isinstance(timeout, bool)
    if not (number and math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_SECONDS):
        bad("collective_timeout", f"seconds, more than 0 and at most {MAX_TIMEOUT_SECONDS:,}")
    if o["tell"] is not None and not callable(o["tell"]):
        bad("tell", "a callable taking one line (or None for stderr)")
    if o["out"] is not None and not callable(getattr(o["out"], "write", None)):
        bad("out", "a writable text stream (or None for sys.stdout)")
    try:
        modules = list(o["by_value"])
    except TypeError:
        modules = None
    if modules is None or not all(isinstance(m, ModuleType) for m in modules):
        bad("by_value", "an iterable of modules")
    if not isinstance(o["keep"], bool):
        bad("keep", "true or false")
    return issues


def _payload(function: Callable[..., Any], args: tuple, kwargs: dict, by_value: Iterable[ModuleType]) -> bytes:
    """The cloudpickled call; an unpicklable part is named (the function, ``args[i]`` or ``kwargs[name]``).

    Raises:
        ConfigError: the part that cannot be pickled and why.
    """
    module = sys.modules.get(getattr(function, "__module__", "") or "")
    modules = [*by_value, *([module] if module else [])]
    try:
        return _pickle_payload(function, args, kwargs, modules)
    except Exception as whole:  # noqa: BLE001 - find the part, then refuse naming it
        parts = [("function", function), *((f"args[{i}]", a) for i, a in enumerate(args)),
                 *((f"kwargs[{k!r}]", v) for k, v in kwargs.items())]  # fmt: skip
        name, cause = "arguments", whole
        for part_name, part in parts:
            try:
                _pickle_payload(part, (), {}, modules)
            except Exception as error:  # noqa: BLE001
                name, cause = part_name, error
                break
        raise ConfigError(
            [
                (
                    name,
                    f"cannot be pickled (cloudpickle: {type(cause).__name__}: {cause}); pass something that "
                    "pickles (plain data, arrays, importable objects), or create the object inside the function",
                )
            ]
        ) from None


def run_remote(
    function: Callable[..., Any],
    /,
    *args: Any,
    kwargs: dict[str, Any] | None = None,
    **options: Any,
) -> Any:
    """Run ``function(*args, **kwargs)`` on every host of ``num_slices`` x ``tpu_type``; the leader's value.

    Args:
        function: Any picklable callable (cloudpickle).
        args: The function's positional arguments.
        kwargs: The function's keyword arguments (a mapping); every other keyword is an option below.
        options: Keyword-only, each checked (:func:`option_issues`) before anything is created:

            * ``tpu_type``: a slice type of the catalog (:mod:`multislice.tpu`), default ``v6e-16``; the local
              backend emulates it (one process per host, one CPU device per chip).
            * ``num_slices``: slices (JobSet replicas), joined over DCN; default 1.
            * ``backend``: ``local`` (default) or ``gke`` (the cluster of ``profile``), or a connected
              :class:`~multislice.backends.base.Backend`.
            * ``output_dir``: where the call's directory goes (local path or ``gs://``); default the profile's.
            * ``profile``: profile the call is planned from (namespace, queue, images, cluster); default per
              backend.
            * ``call_id``: 1-8 lower-case letters and digits naming the call (run ``remote-<function>-<id>``);
              default random.
            * ``collective_timeout``: seconds after the first host joined JAX (or returned) that the others may
              take before :class:`RemoteHang` names them; default 300.
            * ``tell``: where progress lines go; default ``print`` to stderr.
            * ``out``: where the leader's output lines go; default ``sys.stdout`` at call time.
            * ``by_value``: modules whose functions are pickled by value (not importable in the trainer image).
            * ``keep``: keep the JobSet after it finished (local: its pods' logs stay on disk in any case).

    Returns:
        The leader's (slice 0, host 0) return value.

    Raises:
        ConfigError: before anything is created: an unknown option (the fix says ``kwargs=``), an option of the
            wrong type or range, a function that is not callable, an argument that cannot be pickled (each
            named), an unknown slice, a bad count, name or output directory.
        RemoteError: a host raised (the first by time; all are named).
        RemoteExit: a host ended without returning or raising (``os._exit(N)``, a native crash, a kill):
            that host and its exit code.
        RemoteHang: hosts that did not arrive within ``collective_timeout``.
        KeyboardInterrupt: interrupted; the JobSet was deleted first.
        multislice.errors.RunFailed: the JobSet failed otherwise (its pods' report in the message).
    """

    if not callable(function):
        raise ConfigError([("function", f"{function!r} ({type(function).__name__}) is not callable; give a function")])
    if kwargs is not None and not (isinstance(kwargs, dict) and all(isinstance(k, str) for k in kwargs)):
        raise ConfigError([("kwargs", f"{kwargs!r} is not a dict of the function's keyword arguments by name")])
    if issues := option_issues(options):
        raise ConfigError(issues)
    o = {**OPTIONS, **options}
    kwargs = dict(kwargs or {})
    tpu_type, num_slices, backend, output_dir = o["tpu_type"], o["num_slices"], o["backend"], o["output_dir"]
    profile = o["profile"]
    given = None if isinstance(backend, str) else backend
    backend = backend if isinstance(backend, str) else given.name
    say = o["tell"] or (lambda line: print(f"[remote] {line}", file=sys.stderr, flush=True))
    write = o["out"] or sys.stdout
    name = getattr(function, "__name__", "fn")
    payload = _payload(function, args, kwargs, list(o["by_value"]))
    if output_dir is None:
        base = config.read_profile(profile or DEFAULT_PROFILES[backend]) if not isinstance(profile, dict) else profile
        output_dir = str(base.get("output_dir", "output"))
    if not storage.is_remote(output_dir):
        output_dir = os.path.abspath(output_dir)
    plan = plan_call(name, tpu_type=tpu_type, num_slices=num_slices, backend=backend, output_dir=output_dir,
                     profile=profile, run_id=o["call_id"])  # fmt: skip
    chosen = given or backends.backend_for(plan, say)
    run_id = plan.spec.run_name.rsplit("-", 1)[-1]
    call = RemoteCall(plan, chosen, f"remote-{run_id}", storage.join(plan.run_dir, "remote"))
    call.hosts = [(s, h) for s in range(num_slices) for h in range(plan.slice.hosts)]
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
        value = _follow(call, say, write, o["collective_timeout"])
    except BaseException:
        say(f"stopping: deleting JobSet {call.jobset}")
        chosen.delete(call.jobset)
        raise
    if not o["keep"]:
        chosen.delete(call.jobset)
    return value


def _follow(call: RemoteCall, say: Callable[[str], None], write: Any, collective_timeout: float) -> Any:
    """Follow the JobSet in a thread; here: print the leader's lines, tell progress, watch for hangs."""

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
    ready, results = _read_outcomes(call)
    if len(ready) > told_ready:  # hosts that joined and returned between two reads: still told, in order
        say(f"JAX initialised on {len(ready)} of {len(call.hosts)} hosts")
    finished = ended.get("finished")
    if any(not r["ok"] for r in results.values()) or finished is None or finished.phase != "Completed":
        _raise_failure(results, call.backend.pod_exits(call.jobset))
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


class RemoteFunction:
    """A function that runs on every host of a slice when called (what :func:`remote` returns).

    Calling it runs ``run_remote(function, *args, kwargs=kwargs, **options)``: every positional and keyword
    argument of the call goes to the function, none is taken as an option. ``.options(**changes)`` returns a
    copy with some options changed; ``.local`` is the original function, called here.
    """

    def __init__(self, function: Callable[..., Any], options: dict[str, Any]):
        if not callable(function):
            raise ConfigError([("function", f"{function!r} ({type(function).__name__}) is not callable")])
        if issues := option_issues(options):
            raise ConfigError(issues)
        functools.update_wrapper(self, function)
        self.local = function
        self._options = dict(options)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return run_remote(self.local, *args, kwargs=kwargs, **self._options)

    def options(self, **changes: Any) -> RemoteFunction:
        """A copy of this remote function with ``changes`` to its options (checked now)."""
        return RemoteFunction(self.local, {**self._options, **changes})

    def __repr__(self) -> str:
        shown = ", ".join(f"{k}={v!r}" for k, v in self._options.items())
        return f"<remote {getattr(self.local, '__qualname__', self.local)!s} ({shown})>"


def remote(function: Callable[..., Any] | None = None, /, **options: Any) -> Any:
    """Decorator form of :func:`run_remote`: ``@remote(tpu_type=..., num_slices=..., ...)`` or ``@remote``.

    The options (those of :func:`run_remote`) are given here, checked at once; the decorated function,
    called, passes all its arguments to the function on every host and returns the leader's value
    (:class:`RemoteFunction`: ``.options(...)`` changes options, ``.local(*args)`` calls the original here).

    Raises:
        ConfigError: an unknown option, or one of the wrong type (named), or a function that is not callable.
    """
    if function is not None:
        return RemoteFunction(function, options)
    if issues := option_issues(options):
        raise ConfigError(issues)
    return lambda fn: RemoteFunction(fn, options)
