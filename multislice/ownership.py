"""Ownership of a run directory: one live run at a time writes into ``<output_dir>/<run_name>``.

Two runs of one ``run_name`` into one output directory at once would share
JobSet names, reports and logs; the second is refused before it writes
anything, naming the run that owns the directory and the fix. Ownership is
recorded in ``<run_dir>/owner.json`` (:class:`Owner`) and is *live*:

- **A local run directory, held by a process** (``multislice run``): the
  owner holds an exclusive ``flock(2)`` on ``<run_dir>/.owner.lock`` for as
  long as it runs. The kernel releases the lock when the process ends, however
  it ends (SIGKILL included), so a crashed owner is never mistaken for a live
  one and its directory is taken over by the next run (the rerun that resumes
  a finished or crashed run). Linux ``flock(2)``: a lock belongs to the open
  file description and is released when its last descriptor closes.
- **A lease** (a ``gs://`` run directory, or a pipeline run whose steps are
  separate pods, e.g. on KFP): ``expires`` (Unix seconds) is renewed by the
  run's steps (:class:`Renewal`, every ``lease / 3``) and the record is
  removed by its cleanup step; a record past ``expires`` is stale and taken
  over. The Kubernetes Lease convention (``renewTime + leaseDurationSeconds``,
  :mod:`multislice.backends.gke.lease`), applied to a file of the run storage.

``multislice run`` claims the directory before it compiles or logs anything
(:func:`claim`) and passes its run id to the pipeline's steps in
``MULTISLICE_RUN_CLAIM``; the plan step then records the pipeline run id
(kfp.local's or KFP's ``{{$.pipeline_job_uuid}}``) in the owner record
(:func:`join`), so the directory's owner is one pipeline run id. A pipeline
run not started by ``multislice run`` claims the directory with a lease in
its plan step.

Not atomic on Cloud Storage: gcsfs exposes only ``ifGenerationMatch=0``
(create-if-absent), so taking over a stale ``gs://`` record is a
read-compare-write; two runs taking over the same stale record in the same
second could both proceed (their JobSets then conflict at admit, and no
cleanup deletes the other's: :mod:`multislice.steps`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import os
import socket
import threading
import time
import uuid

from multislice import storage
from multislice.errors import InputError

#: The owner record of a run directory.
OWNER_FILE = "owner.json"
#: The file a local owner holds ``flock``'d for as long as it runs.
LOCK_FILE = ".owner.lock"
#: How long a lease-held directory stays owned without a renewal, seconds.
LEASE_SECONDS = 3600
#: Environment variable carrying ``multislice run``'s run id to the pipeline's step processes.
ENV_CLAIM = "MULTISLICE_RUN_CLAIM"


@dataclasses.dataclass
class Owner:
    """Who owns a run directory.

    Attributes:
        run_id: The id of the claim: ``multislice run``'s own run id (8 hex characters), or the pipeline run id
            of a pipeline run that claimed the directory in its plan step.
        pipeline_run_id: The pipeline run id its workloads carry (label ``pipeline/runid``); '' until the plan
            step has recorded it.
        pid: The owning process (``multislice run``, or the plan step's process for a lease).
        host: The owner's host name.
        started: When the claim was made, Unix seconds.
        expires: End of the lease, Unix seconds; None when a process holds the directory's lock instead.
    """

    run_id: str
    pipeline_run_id: str = ""
    pid: int = 0
    host: str = ""
    started: float = 0.0
    expires: float | None = None

    def describe(self) -> str:
        """``run 1a2b3c4d (pipeline run 78462902, pid 4242 on host)``."""
        pipeline = f"pipeline run {self.pipeline_run_id}, " if self.pipeline_run_id else ""
        return f"run {self.run_id} ({pipeline}pid {self.pid} on {self.host})"


class RunDirOwned(InputError):
    """The run directory is owned by another live run; nothing was written."""

    def __init__(self, run_dir: str, owner: Owner):
        self.owner = owner
        super().__init__(
            f"run directory {run_dir} is owned by {owner.describe()}, which is still running; nothing was written",
            "set unique_run_name: true (each run gets its own name), or choose another run_name "
            "(--set run_name=...) or output_dir; or wait for that run to end",
        )


def new_run_id() -> str:
    """A fresh run id for ``multislice run``: 8 hexadecimal characters."""
    return uuid.uuid4().hex[:8]


def _owner_path(run_dir: str) -> str:
    return storage.join(run_dir, OWNER_FILE)


def read_owner(run_dir: str) -> Owner | None:
    """The owner record of ``run_dir`` (live or not), or None when there is none (or it is unreadable)."""
    try:
        found = storage.read_json(_owner_path(run_dir))
    except (ValueError, OSError):
        return None
    if not isinstance(found, dict):
        return None
    known = {f.name for f in dataclasses.fields(Owner)}
    try:
        return Owner(**{k: v for k, v in found.items() if k in known})
    except TypeError:
        return None


def _write_owner(run_dir: str, owner: Owner) -> None:
    storage.write_json(_owner_path(run_dir), dataclasses.asdict(owner))


def _lock_held(run_dir: str) -> bool:
    """True when a process holds ``run_dir``'s lock (probed with a non-blocking shared lock, released at once)."""
    try:
        fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def alive(run_dir: str, owner: Owner, now: float | None = None) -> bool:
    """Whether ``owner`` still owns ``run_dir``: its lease has not expired, or (no lease) its lock is held."""
    if owner.expires is not None:
        return (now or time.time()) < owner.expires
    return not storage.is_remote(run_dir) and _lock_held(run_dir)


def live_owner(run_dir: str) -> Owner | None:
    """The live owner of ``run_dir``, or None."""
    owner = read_owner(run_dir)
    return owner if owner is not None and alive(run_dir, owner) else None


class Claim:
    """A held claim on a run directory: the lock's descriptor (local) or a lease renewal (``gs://``).

    Use as a context manager, or call :meth:`release`. ``owner`` is the record written.
    """

    def __init__(self, run_dir: str, owner: Owner, fd: int | None, renewal: Renewal | None):
        self.run_dir, self.owner, self._fd, self._renewal = run_dir, owner, fd, renewal

    @property
    def pipeline_run_id(self) -> str:
        """The pipeline run id recorded by the plan step ('' before it ran)."""
        found = read_owner(self.run_dir)
        return found.pipeline_run_id if found is not None and found.run_id == self.owner.run_id else ""

    def release(self) -> None:
        """Give the directory up: stop renewing, remove the record (a lease), close the lock."""
        if self._renewal is not None:
            self._renewal.stop()
            self._renewal = None
            release(self.run_dir, self.owner.run_id)
        if self._fd is not None:
            os.close(self._fd)  # the record stays: a closed lock is a stale owner, taken over by the next run
            self._fd = None

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def claim(run_dir: str, run_id: str, lease_seconds: float = LEASE_SECONDS) -> Claim:
    """Claim ``run_dir`` for run ``run_id`` before anything of the run is written there.

    Locally the directory (and its parents) is created if missing, then its
    lock is taken without waiting: held by another process, the claim is
    refused having written nothing. On ``gs://`` a live lease of another run
    refuses it; else a lease is written and renewed every ``lease_seconds / 3``
    until :meth:`Claim.release`.

    Raises:
        RunDirOwned: another live run owns the directory (names it and the fix).
    """
    now = time.time()
    owner = Owner(run_id=run_id, pid=os.getpid(), host=socket.gethostname(), started=now)
    if storage.is_remote(run_dir):
        found = read_owner(run_dir)
        if found is not None and found.run_id != run_id and alive(run_dir, found, now):
            raise RunDirOwned(run_dir, found)
        owner.expires = now + lease_seconds
        _write_owner(run_dir, owner)
        renewal = Renewal(run_dir, run_id, lease_seconds)
        renewal.start()
        return Claim(run_dir, owner, None, renewal)
    os.makedirs(run_dir, exist_ok=True)
    fd = os.open(os.path.join(run_dir, LOCK_FILE), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        found = read_owner(run_dir) or Owner(run_id="?", pid=0, host="?")
        raise RunDirOwned(run_dir, found) from None
    found = read_owner(run_dir)  # a lock-held record is stale now (its lock is ours); a pipeline run's lease may live
    if found is not None and found.run_id != run_id and found.expires is not None and now < found.expires:
        os.close(fd)
        raise RunDirOwned(run_dir, found)
    _write_owner(run_dir, owner)
    return Claim(run_dir, owner, fd, None)


def join(run_dir: str, pipeline_run_id: str, lease_seconds: float = LEASE_SECONDS) -> Owner:
    """The plan step: record ``pipeline_run_id`` as the directory's owner, or refuse another live run's directory.

    Within ``multislice run`` (``MULTISLICE_RUN_CLAIM`` names the claim in the owner record) the pipeline run id
    is added to that record. Otherwise (a pipeline run on KFP or Vertex AI) the pipeline run takes the directory
    with a lease, unless another live run owns it; a record of the same pipeline run (a retried plan task, the
    second stage's plan task) is renewed.

    Raises:
        RunDirOwned: another live run owns the directory; the step writes nothing.
    """
    found = read_owner(run_dir)
    claimed = os.environ.get(ENV_CLAIM, "")
    now = time.time()
    if found is not None and claimed and found.run_id == claimed:
        if found.pipeline_run_id != pipeline_run_id:
            found.pipeline_run_id = pipeline_run_id
            _write_owner(run_dir, found)
        return found
    if found is not None and found.pipeline_run_id == pipeline_run_id and found.expires is not None:
        found.expires = now + lease_seconds
        _write_owner(run_dir, found)
        return found
    if found is not None and alive(run_dir, found, now):
        raise RunDirOwned(run_dir, found)
    if not storage.is_remote(run_dir) and _lock_held(run_dir):  # a claim being made this instant
        raise RunDirOwned(run_dir, read_owner(run_dir) or Owner(run_id="?", host="?"))
    owner = Owner(
        run_id=pipeline_run_id, pipeline_run_id=pipeline_run_id, pid=os.getpid(), host=socket.gethostname(),
        started=now, expires=now + lease_seconds,
    )  # fmt: skip
    _write_owner(run_dir, owner)
    return owner


def writable_by(run_dir: str, pipeline_run_id: str) -> bool:
    """Whether pipeline run ``pipeline_run_id`` may write into ``run_dir``: it owns it (or the ``multislice run`` that
    started it does: ``MULTISLICE_RUN_CLAIM``), or no live run does."""
    owner = read_owner(run_dir)
    if owner is None or owner.pipeline_run_id == pipeline_run_id:
        return True
    claimed = os.environ.get(ENV_CLAIM, "")
    return bool(claimed and owner.run_id == claimed) or not alive(run_dir, owner)


def _names_run(owner: Owner, run_id: str, pipeline_run_id: str) -> bool:
    """Whether the owner record is this run's: by ``run_id`` or by ``pipeline_run_id`` (an empty one never matches)."""
    return bool(run_id and owner.run_id == run_id) or bool(pipeline_run_id and owner.pipeline_run_id == pipeline_run_id)


def renew(run_dir: str, run_id: str = "", pipeline_run_id: str = "", lease_seconds: float = LEASE_SECONDS) -> bool:
    """Extend the lease of ``run_dir`` when its record is this run's (by ``run_id`` or ``pipeline_run_id``).

    Returns:
        True when renewed; False when the record is another run's, not a lease, or missing.
    """
    found = read_owner(run_dir)
    if found is None or not _names_run(found, run_id, pipeline_run_id) or found.expires is None:
        return False
    found.expires = time.time() + lease_seconds
    _write_owner(run_dir, found)
    return True


def release(run_dir: str, run_id: str = "", pipeline_run_id: str = "") -> bool:
    """Remove the owner record of ``run_dir`` when it is this run's lease (the cleanup step, a claim's end).

    A lock-held record (``multislice run``) is left: its lock closes with the process. Returns True when removed.
    """
    found = read_owner(run_dir)
    if found is None or not _names_run(found, run_id, pipeline_run_id) or found.expires is None:
        return False
    with contextlib.suppress(FileNotFoundError):
        storage.path(_owner_path(run_dir)).unlink()
    return True


class Renewal:
    """Renews a run directory's lease every ``lease_seconds / 3`` in a daemon thread (errors are ignored: the
    next renewal tries again, and a lease is only lost after ``lease_seconds`` without one)."""

    def __init__(self, run_dir: str, run_id: str = "", lease_seconds: float = LEASE_SECONDS, pipeline_run_id: str = ""):
        self.run_dir, self.run_id, self.pipeline_run_id = run_dir, run_id, pipeline_run_id
        self.lease_seconds = lease_seconds
        self.stopped = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"owner lease {run_dir}", daemon=True)

    def _run(self) -> None:
        while not self.stopped.wait(self.lease_seconds / 3):
            with contextlib.suppress(Exception):
                renew(self.run_dir, self.run_id, self.pipeline_run_id, self.lease_seconds)

    def start(self) -> Renewal:
        """Start renewing (the record was just written)."""
        self.thread.start()
        return self

    def stop(self) -> None:
        """Stop renewing."""
        self.stopped.set()
