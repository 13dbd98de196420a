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
  not arrive with their last log lines, within :data:`HANG_REPORT_SECONDS` of
  the timeout, the JobSet deleted with a :data:`HANG_GRACE_SECONDS` grace
  (see :meth:`RemoteJob.result`);
* KeyboardInterrupt (Ctrl-C, a kernel interrupt) deletes the JobSet (its pods,
  or processes) and is re-raised; a finished call's JobSet is deleted too.

The blocking call is a submit followed by :meth:`RemoteJob.result`. With
``wait=False`` (or ``RemoteFunction.submit``) the :class:`RemoteJob` comes back
once the JobSet is created: ``status()``, ``result(timeout)``,
``logs(follow, host)``, ``cancel()``, ``cleanup()``. The call's record
(``call.json`` in its directory) lets :func:`attach` rebuild the handle in
another process, and ``multislice calls list|logs`` (:mod:`multislice.cli.calls`)
read it from a shell.

Kinetic's advice holds here: checkpoint long functions at least every 10
minutes of wall time; a preempted or failed host fails the whole call.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import datetime
import functools
import hashlib
import json
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
from typing import Any, TypeGuard

import cloudpickle

from multislice import backends, config, storage
from multislice.backends.base import AdmissionTimeout, Backend, LaunchFailed
from multislice.config.values import INT32_MAX, MAX_TIMEOUT_SECONDS, MIN_TIMEOUT_SECONDS, output_dir_problem
from multislice.errors import ConfigError, InputError, RunFailed
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
    """Some hosts did not arrive (JAX initialisation or the function's end) within the collective timeout.

    Attributes: ``missing`` (slice, host index) of each host that did not arrive; ``logs``: each of those hosts'
    last :data:`HANG_LOG_LINES` log lines (one string per host; also in the message); ``timeout``: the
    ``collective_timeout``, seconds.
    """

    def __init__(
        self,
        message: str,
        fix: str,
        missing: list[tuple[int, int]],
        logs: dict[tuple[int, int], str] | None = None,
        timeout: float | None = None,
    ):
        super().__init__(message, fix)
        self.missing = missing
        self.logs = logs or {}
        self.timeout = timeout


class RemoteCancelled(RunFailed):
    """The call was cancelled (:meth:`RemoteJob.cancel`, or an interrupt of a blocking call) before it ended."""


class ResultTimeout(RunFailed, TimeoutError):
    """:meth:`RemoteJob.result` waited its ``timeout`` and the call has not ended; it runs on, untouched."""


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
        return self.plan.stages[0].workload


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
    if host not in results and code is not None:  # it exited (code) without writing a result
        others = f"; afterwards {', '.join(f'slice {s} host {h}' for s, h in raised)} raised" if raised else ""
        signal = f" (signal {code - 128})" if code and code > 128 else ""
        raise RemoteExit(
            f"slice {host[0]} host {host[1]} exited with code {code}{signal} without returning or raising "
            f"(os._exit, a crash in native code, or a kill such as the OOM killer){others}",
            "read that host's pod log; a function must return or raise on every host",
            host,
            code,
        )
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
    "wait": True,
}
_CALL_ID = re.compile(r"[a-z0-9]{1,8}")


def option_issues(options: dict[str, Any]) -> list[tuple[str, str]]:
    """``(option, message)`` for each unknown option or option of the wrong type or range; empty when all are fine.

    Types: ``tpu_type`` a string; ``num_slices`` a whole number 1 to 2^31-1 (JobSet replicas); ``backend``
    ``local``, ``gke`` or a :class:`~multislice.backends.base.Backend`; ``output_dir`` None or a path or
    ``gs://`` URL; ``profile`` None, a name or path, or a profile's content (a dict); ``call_id`` None or 1-8
    lower-case letters and digits; ``collective_timeout`` seconds, at least
    :data:`multislice.config.values.MIN_TIMEOUT_SECONDS` and at most
    :data:`~multislice.config.values.MAX_TIMEOUT_SECONDS`; ``tell`` None or a callable; ``out`` None or an object
    with ``write``; ``by_value`` modules; ``keep`` and ``wait`` true or false.
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
    if not isinstance(o["backend"], Backend) and not (
        isinstance(o["backend"], str) and o["backend"] in DEFAULT_PROFILES
    ):
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
    if not (number and math.isfinite(timeout) and MIN_TIMEOUT_SECONDS <= timeout <= MAX_TIMEOUT_SECONDS):
        bad("collective_timeout", f"seconds, at least {MIN_TIMEOUT_SECONDS:g} (jax.distributed takes whole seconds) "
                                  f"and at most {MAX_TIMEOUT_SECONDS:,}")  # fmt: skip
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
    if not isinstance(o["wait"], bool):
        bad("wait", "true (return the leader's value) or false (return a RemoteJob at once)")
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

    The same as ``submit`` then :meth:`RemoteJob.result` (with ``cancel_on_interrupt``): with ``wait=False`` the
    :class:`RemoteJob` is returned as soon as the JobSet is created, and the call runs on without the caller.

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
            * ``wait``: True (default): wait and return the leader's value; False: return a :class:`RemoteJob`
              once the JobSet is created (``.result()``, ``.logs()``, ``.cancel()``; :func:`attach` finds it
              again by its id from another process).

    Returns:
        The leader's (slice 0, host 0) return value; with ``wait=False`` the call's :class:`RemoteJob`.

    Raises:
        ConfigError: before anything is created: an unknown option (the fix says ``kwargs=``), an option of the
            wrong type or range, a function that is not callable, an argument that cannot be pickled (each
            named), an unknown slice, a bad count, name or output directory.
        RemoteError: a host raised (the first by time; all are named).
        RemoteExit: a host ended without returning or raising (``os._exit(N)``, a native crash, a kill):
            that host and its exit code.
        RemoteHang: hosts that did not arrive within ``collective_timeout`` (see :meth:`RemoteJob.result` for
            when it is raised and what is left running).
        KeyboardInterrupt: interrupted; the JobSet was deleted first.
        multislice.errors.RunFailed: the JobSet failed otherwise (its pods' report in the message).
    """
    job = _submit(function, args, kwargs, options)
    if not job._options["wait"]:
        return job
    return job.result(cancel_on_interrupt=True)


def _default_output_dir(backend: str, profile: str | dict[str, Any] | None) -> str:
    base = config.read_profile(profile or DEFAULT_PROFILES[backend]) if not isinstance(profile, dict) else profile
    output_dir = str(base.get("output_dir", "output"))
    return output_dir if storage.is_remote(output_dir) else os.path.abspath(output_dir)


def _submit(function: Callable[..., Any], args: tuple, kwargs: dict[str, Any] | None, options: dict) -> RemoteJob:
    """Check everything, write the payload and the call's record, create the JobSet: the call's handle."""
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
    backend = backend if isinstance(backend, str) else backend.name
    say = o["tell"] or _stderr
    name = getattr(function, "__name__", "fn")
    payload = _payload(function, args, kwargs, list(o["by_value"]))
    if output_dir is None:
        output_dir = _default_output_dir(backend, profile)
    elif not storage.is_remote(output_dir):
        output_dir = os.path.abspath(output_dir)
    profile_data = dict(config.read_profile(profile or DEFAULT_PROFILES[backend]) if not isinstance(profile, dict)
                        else profile)  # fmt: skip
    plan = plan_call(name, tpu_type=tpu_type, num_slices=num_slices, backend=backend, output_dir=output_dir,
                     profile=profile_data, run_id=o["call_id"])  # fmt: skip
    call_id = plan.spec.run_name.rsplit("-", 1)[-1]
    call = RemoteCall(plan, given, f"remote-{call_id}", storage.join(plan.run_dir, "remote"))
    call.hosts = [(s, h) for s in range(num_slices) for h in range(plan.slice.hosts)]
    record = {
        "call_id": plan.spec.run_name,
        "id": call_id,
        "name": name,
        "function": f"{getattr(function, '__module__', '?')}.{getattr(function, '__qualname__', name)}",
        "args_sha256": hashlib.sha256(payload).hexdigest(),
        "hosts": [list(h) for h in call.hosts],
        "backend": backend,
        "tpu_type": tpu_type,
        "num_slices": num_slices,
        "output_dir": output_dir,
        "profile": profile_data,
        "run_id": call.run_id,
        "jobset": call.jobset,
        "collective_timeout": o["collective_timeout"],
        "keep": o["keep"],
        "created": _now(),
        "state": "Submitted",
        "outcome": None,
    }
    target = storage.path(storage.join(call.call_dir, "payload.pkl"))
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(payload)
    job = RemoteJob(call, record, tell=o["tell"], out=o["out"])
    job._options = o
    job._write_record()
    try:
        chosen = job.backend  # connects (GKE) now: a cluster that cannot be reached fails before the JobSet is sent
    except BaseException as error:
        job._write_record(state="Failed", outcome=_outcome(error))
        raise
    manifest = _manifest(call)
    say(f"{name} on {num_slices} x {tpu_type} ({len(call.hosts)} hosts, backend {backend}): JobSet {call.jobset}")
    try:
        chosen.submit(manifest)
    except BaseException:
        say(f"stopping: deleting JobSet {call.jobset}")
        chosen.delete(call.jobset, owner=call.run_id)
        job._write_record(state="Failed", outcome={"error": "SubmitFailed", "message": "the JobSet was not created"})
        raise
    return job


def _stderr(line: str) -> None:
    print(f"[remote] {line}", file=sys.stderr, flush=True)


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")


#: Seconds a hung call's hosts get after SIGTERM before SIGKILL when :class:`RemoteHang` stops them (their
#: ``terminationGracePeriodSeconds``, 30, is for a training step's checkpoint; a host stuck in a collective
#: saves nothing, and JAX's preemption handler catching SIGTERM would otherwise hold the caller 30 s).
HANG_GRACE_SECONDS = 2.0
#: Last lines of each hung host's log quoted in :class:`RemoteHang`.
HANG_LOG_LINES = 20
#: :class:`RemoteHang` is raised at most this many seconds after ``collective_timeout`` ran out (measured from
#: when the caller saw the first host arrive): one read of the hosts' markers (at most 1 s apart), the hung
#: hosts' log tails, and their stop with :data:`HANG_GRACE_SECONDS` (locally: until their processes are gone;
#: on GKE: until the API server accepted the deletions).
HANG_REPORT_SECONDS = 15.0


class _Stopped(Exception):
    """Raised into the backend's follow thread by its line callback once the caller stopped waiting."""


def _follow(
    call: RemoteCall,
    say: Callable[[str], None],
    write: Any,
    collective_timeout: float,
    deadline: float | None = None,
    leader_lines: list[str] | None = None,
) -> Any:
    """Follow the JobSet in a thread; here: print the leader's lines, tell progress, watch for hangs.

    Every leader line (the worker's own included) is appended to ``leader_lines``. Past ``deadline``
    (monotonic seconds) :class:`ResultTimeout` is raised and the call is left running.
    """

    lines: queue.Queue[str | None] = queue.Queue()
    ended: dict[str, Any] = {}
    stopped = threading.Event()
    kept = leader_lines if leader_lines is not None else []

    def on_line(line: str) -> None:
        if stopped.is_set():
            raise _Stopped  # the caller gave up waiting: end the follow thread at its next line
        lines.put(line)

    def follow() -> None:
        try:
            ended["finished"] = call.backend.follow(call.plan, call.plan.stages[0], on_line, lambda _: None)
        except _Stopped:
            pass
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            ended["error"] = error
        finally:
            lines.put(None)

    thread = threading.Thread(target=follow, name=f"follow-{call.jobset}", daemon=True)
    thread.start()
    try:
        return _watch(call, say, write, collective_timeout, deadline, kept, lines, ended, thread)
    finally:
        stopped.set()


def _watch(call, say, write, collective_timeout, deadline, kept, lines, ended, thread) -> Any:  # noqa: ANN001
    told_ready = 0
    first_arrival: float | None = None
    timed_stage = ""
    poll = min(call.backend.timings.poll_seconds, 1.0)
    last_read = 0.0
    while True:
        try:
            line = lines.get(timeout=poll)
        except queue.Empty:
            line = ""
        if line is None:
            break
        if line:
            kept.append(line)
            if not line.startswith(MARK):
                write.write(line + "\n")
                write.flush()
        if deadline is not None and time.monotonic() > deadline:
            raise ResultTimeout(
                f"call {call.plan.spec.run_name} has not ended yet (still running; nothing was stopped)",
                "call result() again (with a longer timeout), or cancel() the call",
            )
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
        # Two rounds, each timed from the first host seen arriving: joining JAX, then returning.
        stage = "returned" if results else "joined JAX"
        arrived = set(results) if results else ready
        if stage != timed_stage:
            timed_stage, first_arrival = stage, None
        if not arrived or len(arrived) == len(call.hosts):
            first_arrival = None
            continue
        if first_arrival is None:
            first_arrival = time.monotonic()
            if stage == "returned":
                say(f"{len(arrived)} of {len(call.hosts)} hosts returned; waiting up to {collective_timeout:g} s "
                    "(collective_timeout) for the others")  # fmt: skip
        elif time.monotonic() - first_arrival > collective_timeout:
            _hang(call, say, sorted(set(call.hosts) - arrived), len(arrived), stage, collective_timeout)
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


def _hang(
    call: RemoteCall,
    say: Callable[[str], None],
    missing: list[tuple[int, int]],
    arrived: int,
    stage: str,
    collective_timeout: float,
) -> None:
    """Read the missing hosts' last log lines, stop the JobSet with a short grace, raise :class:`RemoteHang`."""
    tails: dict[tuple[int, int], str] = {}
    for host in missing:
        got: list[str] = []
        try:
            call.backend.host_log(call.jobset, *host, got.append, tail=HANG_LOG_LINES)
        except Exception as error:  # noqa: BLE001 - a log that cannot be read must not hide the hang
            got = [f"(its log could not be read: {error})"]
        tails[host] = "\n".join(got[-HANG_LOG_LINES:])
    where = ", ".join(f"slice {s} host {h}" for s, h in missing)
    say(f"hang: {where} did not arrive; stopping JobSet {call.jobset} ({HANG_GRACE_SECONDS:g} s grace)")
    call.backend.delete(call.jobset, owner=call.run_id, grace_seconds=HANG_GRACE_SECONDS)
    quoted = "".join(
        f"\n\nlast {HANG_LOG_LINES} log lines of slice {s} host {h}:\n{tails[(s, h)] or '(empty)'}" for s, h in missing
    )
    raise RemoteHang(
        f"{arrived} of {len(call.hosts)} hosts {stage} but {where} did not arrive within "
        f"{collective_timeout:g} s (a host hanging in a collective, or not started){quoted}",
        "read those hosts' lines above (and their full logs: RemoteJob.logs(host=...)); raise collective_timeout "
        "if they are only slow",
        missing,
        tails,
        collective_timeout,
    )


class RemoteFunction:
    """A function that runs on every host of a slice when called (what :func:`remote` returns).

    Calling it runs ``run_remote(function, *args, kwargs=kwargs, **options)``: every positional and keyword
    argument of the call goes to the function, none is taken as an option; with the option ``wait=False``, or
    with ``.submit(*args, **kwargs)``, the call's :class:`RemoteJob` is returned at once. ``.options(**changes)``
    returns a copy with some options changed; ``.local`` is the original function, called here.
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

    def submit(self, *args: Any, **kwargs: Any) -> RemoteJob:
        """Start the call and return its :class:`RemoteJob` at once (the ``wait=False`` form of calling it)."""
        return run_remote(self.local, *args, kwargs=kwargs, **{**self._options, "wait": False})

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


#: The call's record, in its directory: ``<output_dir>/<call id>/remote/call.json``.
RECORD = "call.json"
#: States a call ends in (the record's ``state``); before that it is ``Submitted`` (``status()``: ``Queued``,
#: ``Running``, or what the hosts' markers already say).
ENDED = ("Succeeded", "Failed", "Hung", "Cancelled")
_ERRORS: dict[str, type[RunFailed]] = {
    cls.__name__: cls for cls in (RemoteError, RemoteExit, RemoteHang, RemoteCancelled, RunFailed)
}


def _host_arg(host: Any, hosts: list[tuple[int, int]]) -> tuple[int, int]:
    """``(slice, host)`` from a pair or ``"S,H"``; InputError when it is not one of the call's."""
    if host is None:
        return (0, 0)
    try:
        pair = tuple(int(p) for p in (host.split(",") if isinstance(host, str) else host))
    except (TypeError, ValueError):
        pair = ()
    if len(pair) != 2 or pair not in hosts:
        last = hosts[-1] if hosts else (0, 0)
        raise InputError(f"host {host!r} is not a host of this call",
                         f"give (slice, host) or 'S,H', from 0,0 to {last[0]},{last[1]}")  # fmt: skip
    return pair  # type: ignore[return-value]


class RemoteJob:
    """The handle of one remote call: what ``multislice.remote(..., wait=False)`` (or ``.submit``) returns, and
    :func:`attach` finds again from another process.

    The call's record (:data:`RECORD`: the call id, the function's qualified name, ``args_sha256`` the SHA-256
    of the cloudpickled payload, the hosts, backend, slice, output directory, profile, the JobSet and its run id,
    the creation time, ``state`` and ``outcome``) is JSON in the call's directory,
    ``<output_dir>/<call id>/remote/``, beside the payload and the hosts' markers; :meth:`result`,
    :meth:`cancel` and :meth:`cleanup` keep it current.

    Attributes:
        id: The call id, ``remote-<function>-<id>`` (the run name; its JobSet is ``<id>-remote``).
        jobset: The JobSet's name.
        hosts: Every host, (slice, host index).
    """

    def __init__(self, call: RemoteCall, record: dict[str, Any], tell: Callable[[str], None] | None = None,
                 out: Any = None):  # fmt: skip
        self._call = call
        self._record = record
        self._say = tell or _stderr
        self._out = out
        self._options = {**OPTIONS, "collective_timeout": record["collective_timeout"], "keep": record["keep"]}
        self.id: str = record["call_id"]
        self.jobset: str = call.jobset
        self.hosts: list[tuple[int, int]] = list(call.hosts)

    def __repr__(self) -> str:
        return f"<RemoteJob {self.id} {self._record['function']} on {self._record['backend']}: {self._record['state']}>"

    # -- the record ------------------------------------------------------

    @property
    def record(self) -> dict[str, Any]:
        """The call's record as stored now (a copy)."""
        return json.loads(json.dumps(self._read_record()))

    def _record_path(self) -> Any:
        return storage.path(storage.join(self._call.call_dir, RECORD))

    def _read_record(self) -> dict[str, Any]:
        with contextlib.suppress(FileNotFoundError):
            self._record = json.loads(self._record_path().read_text())
        return self._record

    def _write_record(self, **changes: Any) -> None:
        self._record.update(changes)
        target = self._record_path()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(json.dumps(self._record, indent=1, default=str))

    @property
    def backend(self) -> Backend:
        """The call's backend (connected on first use: a GKE cluster from the recorded profile)."""
        if self._call.backend is None:
            self._call.backend = backends.backend_for(self._call.plan, self._say)
        return self._call.backend

    # -- what a user asks --------------------------------------------------

    def status(self) -> str:
        """The call's state now.

        ``Queued`` (created, not running yet: Kueue has not admitted it, or its pods are not created yet),
        ``Running`` (its pods exist), ``Succeeded`` (every host returned), ``Failed`` (a host raised or exited,
        or the JobSet failed), ``Hung`` (:class:`RemoteHang` was raised), ``Cancelled``, or ``Lost`` (its JobSet
        was deleted by someone else before every host returned). An ended state comes from the record;
        otherwise from the hosts' markers and the JobSet's phase.
        """
        record = self._read_record()
        if record["state"] in ENDED:
            return record["state"]
        _, results = _read_outcomes(self._call)
        if any(not r["ok"] for r in results.values()):
            return "Failed"
        if len(results) == len(self.hosts):
            return "Succeeded"
        phase = self.backend.workload_phase(self.jobset)
        if phase in (None, "Deleted"):
            return "Lost"
        if phase in ("Failed", "Completed"):
            return "Failed"  # ended without a result from every host
        return "Running" if phase == "Running" and self.backend.pod_exits(self.jobset) else "Queued"

    def result(self, timeout: float | None = None, *, cancel_on_interrupt: bool = False) -> Any:
        """Wait for the call to end and return the leader's value; its progress and the leader's output as it
        comes (to the ``tell`` and ``out`` of the call or of :func:`attach`).

        An ended call's outcome is given again from its record and the hosts' markers (the value, or the same
        error). Whoever sees the call end deletes its JobSet (unless ``keep``) and keeps the leader's log in the
        call's directory (``logs/slice-0-host-0.log``), so :meth:`logs` reads it after the pods are gone.

        Hangs: :class:`RemoteHang` is raised at most :data:`HANG_REPORT_SECONDS` after ``collective_timeout``
        ran out (counted from when this caller saw the first host join JAX, or return), whatever the hung hosts
        do with SIGTERM: their last log lines are read, then the JobSet is deleted with a
        :data:`HANG_GRACE_SECONDS` grace period (SIGKILL after it) in place of the pods' 30 s. When it is raised,
        on the local backend no process of the call is left; on GKE the JobSet and its pods are deleted (the
        kubelets kill the containers within that grace).

        Args:
            timeout: Seconds to wait at most (None: until it ends, bounded by the backend's timings); the
                admission and start-up waits count too.
            cancel_on_interrupt: On KeyboardInterrupt, delete the JobSet (what a blocking call does); by
                default a detached call runs on and only the waiting stops.

        Raises:
            ResultTimeout: ``timeout`` passed; the call runs on (nothing was stopped).
            RemoteError, RemoteExit, RemoteHang, multislice.errors.RunFailed: as :func:`run_remote`.
            RemoteCancelled: the call was cancelled.
            KeyboardInterrupt: interrupted.
        """
        record = self._read_record()
        if record["state"] in ENDED:
            return self._ended(record)
        deadline = None if timeout is None else time.monotonic() + timeout
        say, write = self._say, self._out or sys.stdout
        call, stage = self._call, self._call.plan.stages[0]
        leader_lines: list[str] = []
        chosen = self._bounded(self.backend, deadline)
        try:
            if self.backend.workload_phase(call.jobset) not in ("Completed", "Failed"):  # else: ended unwatched
                admission = chosen.wait_admitted(call.plan, stage, say)
                say(f"admitted (ClusterQueue {admission.cluster_queue}, waited {admission.wait_seconds:.0f} s)")
                running = chosen.wait_running(call.plan, stage, say)
                say(f"pods scheduled: {len(running.placement)} of {len(call.hosts)} running")
            value = _follow(call, say, write, self._options["collective_timeout"], deadline, leader_lines)
        except ResultTimeout:
            raise
        except KeyboardInterrupt:
            if cancel_on_interrupt:
                say(f"stopping: deleting JobSet {call.jobset}")
                self._write_record(state="Cancelled", outcome=_outcome(RemoteCancelled("interrupted", "")))
                self.backend.delete(call.jobset, owner=call.run_id)
            raise
        except BaseException as error:
            if deadline is not None and time.monotonic() >= deadline and _waiting_error(error):
                raise ResultTimeout(
                    f"call {self.id} is not running yet after {timeout:g} s ({error.message}); it waits on",
                    "call result() again (with a longer timeout), or cancel() the call",
                ) from None
            if self._read_record()["state"] == "Cancelled":
                raise RemoteCancelled(f"call {self.id} was cancelled", "submit it again") from error
            self._keep_leader_log(leader_lines)
            if not isinstance(error, RemoteHang):
                say(f"stopping: deleting JobSet {call.jobset}")
                self.backend.delete(call.jobset, owner=call.run_id)
            self._write_record(state="Hung" if isinstance(error, RemoteHang) else "Failed", outcome=_outcome(error))
            raise
        self._keep_leader_log(leader_lines)
        if not self._options["keep"]:
            self.backend.delete(call.jobset, owner=call.run_id)
        self._write_record(state="Succeeded", outcome={"ended": _now(), "hosts_returned": len(call.hosts)})
        return value

    def logs(self, follow: bool = False, host: Any = None, out: Any = None) -> str:
        """One host's log (default the leader, slice 0 host 0); its text, lines joined with newlines.

        Read from the pod while it exists (local: the pod's log file, kept after the JobSet ended; GKE: the API
        server, gone with the pod), else from the copy of the leader's log that :meth:`result` keeps in the
        call's directory. With ``follow``, each line is also written to ``out`` (default ``sys.stdout``) as it
        comes, until that host's pod ends; with ``out`` and no ``follow``, the text is written there too.

        Args:
            follow: Keep reading until the host's pod ends.
            host: ``(slice, host)`` or ``"S,H"``.
            out: A writable text stream.

        Raises:
            multislice.errors.InputError: ``host`` is not one of the call's hosts, or the log is not there: the
                JobSet (with its pods) is gone and only the leader's log is kept, or the pod has not started.
        """
        pair = _host_arg(host, self.hosts)
        got: list[str] = []
        sink = out if out is not None else (sys.stdout if follow else None)

        def on_line(line: str) -> None:
            got.append(line)
            if sink is not None:
                sink.write(line + "\n")
                sink.flush()

        phase = self.backend.workload_phase(self.jobset)
        if phase is not None and self.backend.host_log(self.jobset, *pair, on_line, follow=follow):
            return "".join(f"{line}\n" for line in got)
        kept = storage.path(storage.join(self._call.call_dir, "logs", f"{_host_key(*pair)}.log"))
        if kept.exists():
            for line in kept.read_text().splitlines():
                on_line(line)
            return "".join(f"{line}\n" for line in got)
        where = f"slice {pair[0]} host {pair[1]}"
        if phase is None:
            raise InputError(
                f"call {self.id}: the log of {where} is gone: JobSet {self.jobset} was deleted, and on the "
                f"{self._record['backend']} backend a pod's log goes with its pod; only the leader's log is kept in "
                f"the call's directory ({self._call.call_dir}/logs), once result() saw the call end",
                "read the leader's log (host 0,0), or pass keep=True to keep a call's JobSet (and its pods' logs) "
                "after it ends",
            )
        raise InputError(f"call {self.id}: {where} has no log yet (JobSet {self.jobset} is {phase})",
                         "wait for the call to run (status()), or follow the log: logs(follow=True)")  # fmt: skip

    def cancel(self) -> bool:
        """Stop the call: delete its JobSet (only the one carrying this call's run id) and record ``Cancelled``.

        A :meth:`result` waiting in another process raises :class:`RemoteCancelled`. Returns False when there
        was no JobSet of this call to delete (it had ended and was deleted, or never started); an ended call
        keeps its recorded state.
        """
        if self._read_record()["state"] not in ENDED:
            self._write_record(state="Cancelled", outcome=_outcome(RemoteCancelled("cancelled", "")))
        return self.backend.delete(self.jobset, owner=self._call.run_id)

    def cleanup(self, files: bool = False) -> list[str]:
        """Delete what the call left: its JobSet if it is still there (``keep=True``, or a detached call nobody
        waited on; only the one carrying this call's run id), and with ``files`` its payload and the hosts'
        markers (the record and the kept leader log stay, so ``multislice calls list`` and ``logs`` still show
        it; :meth:`result` of a call whose files are removed raises). Returns what was deleted."""
        done = []
        if self.backend.delete(self.jobset, owner=self._call.run_id):
            done.append(f"JobSet {self.jobset}")
            if self._read_record()["state"] not in ENDED:
                self._write_record(state="Cancelled", outcome=_outcome(RemoteCancelled("cleaned up", "")))
        if files:
            for part in ("payload.pkl", "hosts"):
                target = storage.path(storage.join(self._call.call_dir, part))
                if target.exists():
                    target.rmtree() if target.is_dir() else target.unlink()
                    done.append(str(target))
        return done

    # -- inside ----------------------------------------------------------

    def _bounded(self, backend: Backend, deadline: float | None) -> Backend:
        """The backend with its admission and start-up waits cut to what is left of ``deadline``."""
        if deadline is None:
            return backend
        left = max(0.0, deadline - time.monotonic())
        bounded = copy.copy(backend)
        t = backend.timings
        bounded.timings = dataclasses.replace(t, admit_timeout=min(t.admit_timeout, left),
                                              launch_timeout=min(t.launch_timeout, left))  # fmt: skip
        return bounded

    def _keep_leader_log(self, lines: list[str]) -> None:
        if not lines:
            return
        target = storage.path(storage.join(self._call.call_dir, "logs", f"{_host_key(0, 0)}.log"))
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text("".join(f"{line}\n" for line in lines))

    def _ended(self, record: dict[str, Any]) -> Any:
        """An ended call's outcome again: the leader's value, or its error rebuilt from the record."""
        outcome = record.get("outcome") or {}
        if record["state"] == "Succeeded":
            _, results = _read_outcomes(self._call)
            if (0, 0) not in results:
                raise InputError(
                    f"call {self.id} succeeded, but its leader's result is gone from {self._call.call_dir}/hosts "
                    "(cleanup(files=True))",
                    "run the call again",
                )
            return results[(0, 0)]["value"]
        cls = _ERRORS.get(outcome.get("error", ""), RunFailed)
        message, fix = outcome.get("message", f"call {self.id} {record['state']}"), outcome.get("fix", "")
        if cls is RemoteError:
            raise RemoteError(message, fix, tuple(outcome["host"]), outcome["remote_type"], outcome["traceback"])
        if cls is RemoteExit:
            raise RemoteExit(message, fix, tuple(outcome["host"]), outcome["exit_code"])
        if cls is RemoteHang:
            missing = [tuple(h) for h in outcome["missing"]]
            tails = {tuple(h): text for h, text in zip(missing, outcome["logs"], strict=True)}
            raise RemoteHang(message, fix, missing, tails, outcome["timeout"])
        raise cls(message, fix)


def _waiting_error(error: BaseException) -> TypeGuard[RunFailed]:
    return isinstance(error, (AdmissionTimeout, LaunchFailed))


def _outcome(error: BaseException) -> dict[str, Any]:
    """An error as the record keeps it (enough for :meth:`RemoteJob.result` to raise it again)."""
    outcome: dict[str, Any] = {
        "ended": _now(),
        "error": type(error).__name__,
        "message": getattr(error, "message", str(error)),
        "fix": getattr(error, "fix", ""),
    }
    if isinstance(error, RemoteError):
        outcome.update(host=list(error.host), remote_type=error.remote_type, traceback=error.remote_traceback)
    elif isinstance(error, RemoteExit):
        outcome.update(host=list(error.host), exit_code=error.exit_code)
    elif isinstance(error, RemoteHang):
        outcome.update(missing=[list(h) for h in error.missing], logs=[error.logs.get(h, "") for h in error.missing],
                       timeout=error.timeout)  # fmt: skip
    return outcome


def _check_output_dir(output_dir: Any) -> None:
    if output_dir is None:
        return
    problem = output_dir_problem(output_dir) if isinstance(output_dir, str) else "it is not a path or gs:// URL"
    if problem:
        raise InputError(f"output_dir {output_dir!r}: {problem}", "give the calls' output_dir (a path or gs:// URL)")


def _call_dirs(output_dir: str) -> list[Any]:
    root = storage.path(output_dir)
    if not root.exists():
        return []
    return sorted(p for p in root.glob(f"remote-*/remote/{RECORD}"))


def attach(
    call_id: str,
    *,
    output_dir: str | None = None,
    backend: Backend | None = None,
    tell: Callable[[str], None] | None = None,
    out: Any = None,
) -> RemoteJob:
    """The handle of a call made earlier, by its id, from any process (a new kernel, the CLI).

    Args:
        call_id: The call id (``remote-<function>-<id>``, :attr:`RemoteJob.id`), its JobSet's name, or its 8
            character id (the ``call_id`` option).
        output_dir: The call's ``output_dir`` (a path or ``gs://``); default the ``local`` profile's, resolved
            against the current directory, as a local call's default is. A call on GKE needs its bucket here.
        backend: A connected backend to use (default: the recorded backend and profile's cluster, connected on
            first use).
        tell: Where progress lines of :meth:`RemoteJob.result` go (default stderr).
        out: Where the leader's lines go while :meth:`RemoteJob.result` waits (default ``sys.stdout``).

    Raises:
        multislice.errors.InputError: ``call_id`` or ``output_dir`` is malformed, or there is no call of that id
            under ``output_dir`` (the fix names ``calls list``).
    """
    if not isinstance(call_id, str) or not re.fullmatch(r"[a-z0-9-]{1,63}", call_id):
        raise InputError(
            f"call_id {call_id!r} is not a call id",
            "give one such as 'remote-train-shard-c0ffee00' (`multislice calls list` shows them)",
        )
    _check_output_dir(output_dir)
    output_dir = _default_output_dir("local", None) if output_dir is None else output_dir
    if not storage.is_remote(output_dir):
        output_dir = os.path.abspath(output_dir)
    name = call_id.removesuffix("-remote")
    path = storage.path(storage.join(output_dir, name, "remote", RECORD))
    if not path.exists():
        found = [p for p in _call_dirs(output_dir) if p.parent.parent.name.rsplit("-", 1)[-1] == call_id]
        if len(found) != 1:
            raise InputError(
                f"no remote call {call_id} under {output_dir}",
                f"list the calls there with `multislice calls list --output-dir {output_dir}`, or give the call's "
                "output_dir",
            )
        path = found[0]
    return _job_from_record(json.loads(path.read_text()), backend, tell, out)


def _job_from_record(record: dict[str, Any], backend: Backend | None, tell: Any, out: Any) -> RemoteJob:
    plan = plan_call(record["name"], tpu_type=record["tpu_type"], num_slices=record["num_slices"],
                     backend=record["backend"], output_dir=record["output_dir"], profile=record["profile"],
                     run_id=record["id"])  # fmt: skip
    call = RemoteCall(plan, backend, record["run_id"], storage.join(plan.run_dir, "remote"))
    call.hosts = [tuple(h) for h in record["hosts"]]
    return RemoteJob(call, record, tell=tell, out=out)


def list_calls(output_dir: str | None = None, backend: Backend | None = None) -> list[RemoteJob]:
    """Every call recorded under ``output_dir`` (default as :func:`attach`), oldest first.

    Raises:
        multislice.errors.InputError: a malformed ``output_dir``.
    """
    _check_output_dir(output_dir)
    output_dir = _default_output_dir("local", None) if output_dir is None else output_dir
    jobs = [_job_from_record(json.loads(p.read_text()), backend, None, None) for p in _call_dirs(output_dir)]
    return sorted(jobs, key=lambda job: (job._record["created"], job.id))
