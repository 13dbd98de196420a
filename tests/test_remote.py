"""multislice.remote on the local backend: 2 emulated slices x 2 hosts (v5litepod-8: 4 CPU devices per host).

Each call starts 4 real JAX processes in the trainer environment (about 30 s
on this machine), so these tests are in the ``e2e`` tier. Nothing waits on
time: progress lines drive the interrupt, and the hang test's function
blocks until the call's JobSet is deleted.
"""

from __future__ import annotations

import io

import pytest

import multislice
from multislice.backends.local.jobsets import LocalJobSets, pid_alive
from multislice.remote_call import RemoteError, RemoteExit, RemoteHang, run_remote

pytestmark = pytest.mark.e2e
SLICES = {"tpu_type": "v5litepod-8", "num_slices": 2}


def _devices(offset, keep=None):
    import jax

    print(f"leader says: process {jax.process_index()} sees {jax.device_count()} devices", flush=True)
    return {"process": jax.process_index(), "devices": jax.device_count() + offset, "slices": 2, "keep": keep}


def _raise_on_slice_1_host_0():
    import os

    if os.environ["JOB_INDEX"] == "1" and os.environ["JOB_COMPLETION_INDEX"] == "0":
        raise ValueError("bad shard on this host")
    return "fine"


def _exit_7_on_slice_1_host_1():
    import os

    if os.environ["JOB_INDEX"] == "1" and os.environ["JOB_COMPLETION_INDEX"] == "1":
        os._exit(7)  # no result, no exception: the pod ends with code 7
    return "fine"


def _block_forever_on_last_host():
    import threading

    import jax

    if jax.process_index() == 3:
        threading.Event().wait()  # never set: this host does not arrive; the call deletes the JobSet
    return jax.process_index()


def _wait_forever():
    import threading

    threading.Event().wait()


def test_remote_returns_the_leaders_value_and_streams_its_output(tmp_path):
    out, told = io.StringIO(), []
    devices = multislice.remote(_devices, **SLICES, output_dir=str(tmp_path), out=out, tell=told.append)
    # keep= is the function's argument here (the call's own keep option is the decorator's): it reaches the function.
    assert devices(0, keep="mine") == {"process": 0, "devices": 16, "slices": 2, "keep": "mine"}
    assert out.getvalue().splitlines() == ["leader says: process 0 sees 16 devices"]  # the leader's lines only
    assert any(t.startswith("pods scheduled: 4 of 4") for t in told)
    assert "JAX initialised on 4 of 4 hosts" in told and told[-1] == "done: 4 hosts returned"


def test_a_host_that_raises_is_named_with_its_traceback(tmp_path):
    with pytest.raises(RemoteError) as raised:
        run_remote(_raise_on_slice_1_host_0, **SLICES, output_dir=str(tmp_path), tell=lambda _: None)
    error = raised.value
    assert error.host == (1, 0) and "slice 1 host 0 raised builtins.ValueError: bad shard on this host" in str(error)
    assert "_raise_on_slice_1_host_0" in error.remote_traceback and 'raise ValueError("bad shard' in str(error)
    assert isinstance(error.__cause__, ValueError)


def test_a_host_that_exits_is_named_with_its_exit_code(tmp_path):
    """Not another host's error raised because it left (before: "Unable to initialize backend 'cpu'")."""
    with pytest.raises(RemoteExit) as raised:
        run_remote(_exit_7_on_slice_1_host_1, **SLICES, output_dir=str(tmp_path), tell=lambda _: None)
    assert (raised.value.host, raised.value.exit_code) == ((1, 1), 7)
    assert str(raised.value).startswith("slice 1 host 1 exited with code 7 without returning or raising")


def _pods_left(tmp_path):
    [run_dir] = [p for p in tmp_path.iterdir() if p.name.startswith("remote-")]
    jobsets = LocalJobSets(run_dir)
    [state] = [jobsets.get_jobset(d.name) for d in jobsets.jobsets_dir.iterdir()]
    return state, [p.pid for p in state.pods if pid_alive(p.pid)]


def test_an_interrupt_deletes_the_jobset_and_leaves_no_process(tmp_path):
    def tell(line):
        if line.startswith("JAX initialised"):
            raise KeyboardInterrupt  # what Ctrl-C / a kernel interrupt raises in the waiting caller

    with pytest.raises(KeyboardInterrupt):
        run_remote(_wait_forever, **SLICES, output_dir=str(tmp_path), tell=tell)
    state, alive = _pods_left(tmp_path)
    assert state.phase == "Deleted" and alive == []
    _reap(state.supervisor_pid)  # the supervisor (our child) exits after recording the deletion
    assert not pid_alive(state.supervisor_pid)


def _reap(pid):
    """Wait for our child process ``pid`` to exit (an event, not a delay); already reaped is fine."""
    import os

    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


def test_a_host_hanging_in_a_collective_is_named(tmp_path):
    with pytest.raises(RemoteHang) as raised:
        run_remote(_block_forever_on_last_host, **SLICES, output_dir=str(tmp_path), tell=lambda _: None,
                   collective_timeout=20)  # fmt: skip
    assert raised.value.missing == [(1, 1)] and "slice 1 host 1 did not arrive within 20 s" in str(raised.value)
    state, alive = _pods_left(tmp_path)
    assert state.phase == "Deleted" and alive == []
