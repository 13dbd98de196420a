"""multislice.remote on the GKE backend, over HTTP against the suite's Kubernetes emulator (tests/kube_cluster.py).

A controller script plays Kueue, the JobSet controller and the kubelet, and
the hosts of the remote worker: each host's markers (``.ready``, ``.result``)
are written to the call's ``gs://`` directory as
:mod:`multislice.trainer.remote_worker` writes them. The script waits on what
the call tells (:class:`tests.backends.gke.harness.Told`) before each change.
"""

from __future__ import annotations

import hashlib
import io

import cloudpickle
import pytest

from multislice import storage
from multislice.backends.gke import GkeBackend
from multislice.errors import InputError
from multislice.remote_call import RemoteError, RemoteExit, ResultTimeout, attach, run_remote
from multislice.trainer.remote_worker import MARK, host_key, outcome_of
from tests.backends.gke.harness import POOLS, Background, Told

CALL = "c0ffee00"
JOBSET = f"remote-train-shard-{CALL}-remote"
CALL_DIR = f"gs://bucket/remote/remote-train-shard-{CALL}/remote"
HOSTS = [(0, h) for h in range(4)]  # 1 x v6e-16: 4 hosts of 4 chips


# The emulated cluster (served, play) and the call's storage: the GKE scenarios' fixtures
# (tests/backends/gke/conftest.py).
pytestmark = pytest.mark.usefixtures("crd_schemas", "run_storage")


def train_shard(rows):
    return sum(rows)


def _host_writes(host, outcome):
    hosts = storage.join(CALL_DIR, "hosts")
    storage.path(hosts).mkdir(parents=True, exist_ok=True)
    storage.path(storage.join(hosts, f"{host_key(*host)}.ready")).write_bytes(b"")
    if outcome is not None:
        storage.path(storage.join(hosts, f"{host_key(*host)}.result")).write_bytes(cloudpickle.dumps(outcome))


def _every_host_returns(play, pods, value):
    """Each host writes its result (the leader's is ``value``), its pod succeeds, and the JobSet completes."""
    for host in HOSTS:
        _host_writes(host, {"ok": True, "value": value if host == (0, 0) else None})
    for pod in pods:
        play.pod_status(pod, {"phase": "Succeeded"})
    play.jobset_done(JOBSET, "Completed", "AllJobsCompleted", "jobset completed successfully")


def _call(served, told, **options):
    return run_remote(train_shard, [1, 2, 3], tpu_type="v6e-16", num_slices=1, backend=GkeBackend(served.kube()),
                      output_dir="gs://bucket/remote", call_id=CALL, tell=told.add, **options)  # fmt: skip


def _admitted_and_running(play, told):
    play.kueue_queues(JOBSET, "waiting for quota")
    play.kueue_admits(JOBSET)
    told.wait_for("^admitted")
    return play.pods(JOBSET, 1, 4, pools=POOLS)


def test_admitted_ran_returned(served, play):
    told, out, seen = Told(), io.StringIO(), {}

    def cluster():
        seen["jobset"] = play.jobset(JOBSET)
        pods = _admitted_and_running(play, told)
        told.wait_for("pods scheduled: 4 of 4 running")
        for host in HOSTS:
            _host_writes(host, None)
        told.wait_for("JAX initialised on 4 of 4 hosts")
        play.log(pods[0], f"{MARK} slice-0-host-0: started\nshard sum is 6\n")
        _every_host_returns(play, pods, 6)

    with Background(cluster, told):
        assert _call(served, told, out=out) == 6
    assert out.getvalue() == "shard sum is 6\n"  # the leader's lines, without the worker's own
    assert served.kube().get_jobset(JOBSET) is None  # deleted once it finished
    js = seen["jobset"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "multislice-queue"
    [rj] = js["spec"]["replicatedJobs"]
    pod = rj["template"]["spec"]["template"]["spec"]
    assert pod["containers"][0]["command"] == ["python", "-m", "multislice.trainer.remote_worker"]
    assert pod["containers"][0]["args"] == ["--call-dir", CALL_DIR]
    assert js["spec"]["failurePolicy"]["maxRestarts"] == 0 and rj["replicas"] == 1
    assert pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "4x4"
    assert {"name": "PYTHONUNBUFFERED", "value": "1"} in pod["containers"][0]["env"]  # prints are not held back
    payload = storage.path(storage.join(CALL_DIR, "payload.pkl")).read_bytes()
    function, args, kwargs = cloudpickle.loads(payload)
    assert function([1, 2, 3]) == 6 and args == ([1, 2, 3],) and kwargs == {}


class Printed(Told):
    """The caller's ``out``: each line the call writes there, for the cluster script to wait on."""

    def write(self, text):
        for line in text.splitlines():
            self.add(line)

    def flush(self):
        pass


def test_the_leaders_prints_reach_the_caller_while_the_function_runs(served, play):
    """The leader prints two lines, one at a time; each must be in the caller's ``out`` before the host goes on
    (the script waits on ``out``, not on time), and no host has a result until both have arrived."""
    told, printed = Told(), Printed()

    def cluster():
        pods = _admitted_and_running(play, told)
        told.wait_for("pods scheduled: 4 of 4 running")
        for host in HOSTS:
            _host_writes(host, None)
        told.wait_for("JAX initialised on 4 of 4 hosts")
        play.log(pods[0], f"{MARK} slice-0-host-0: started\nepoch 1 of 2\n")
        printed.wait_for("^epoch 1 of 2$")  # the function is still running: no result, the pods are running
        assert not storage.path(storage.join(CALL_DIR, "hosts", f"{host_key(0, 0)}.result")).exists()
        play.log(pods[0], "epoch 2 of 2\n")
        printed.wait_for("^epoch 2 of 2$")
        _every_host_returns(play, pods, 6)

    with Background(cluster, told):
        try:
            assert _call(served, told, out=printed) == 6
        finally:
            printed.close()  # a script still waiting on a line the call never wrote fails at once
    assert printed.lines == ["epoch 1 of 2", "epoch 2 of 2"]


def test_a_host_failed(served, play):
    told = Told()

    def cluster():
        pods = _admitted_and_running(play, told)
        told.wait_for("pods scheduled")
        try:
            raise KeyError("row 7")
        except KeyError as error:
            failure = outcome_of(error)
        for host in HOSTS:
            _host_writes(host, failure if host == (0, 2) else {"ok": True, "value": None})
        play.pod_status(pods[2], {"phase": "Failed"})
        play.jobset_done(JOBSET, "Failed", "FailedJobs", "jobset failed")

    with Background(cluster, told):
        with pytest.raises(RemoteError) as raised:
            _call(served, told)
    assert raised.value.host == (0, 2) and "slice 0 host 2 raised builtins.KeyError: 'row 7'" in str(raised.value)
    assert "remote traceback (slice 0 host 2)" in str(raised.value) and isinstance(raised.value.__cause__, KeyError)
    assert served.kube().get_jobset(JOBSET) is None


def _terminated(code, at):
    return {"phase": "Failed", "containerStatuses": [
        {"name": "maxtext", "ready": False, "restartCount": 0, "image": "t", "imageID": "",
         "state": {"terminated": {"exitCode": code, "reason": "Error", "finishedAt": at}}}]}  # fmt: skip


def test_a_host_that_exited_is_named_with_its_code_not_the_hosts_that_raised_after_it(served, play):
    """Host 1 exits 7 without a result (os._exit); in the same second host 0, whose collective lost a peer,
    raises; the kubelet's exit codes and finishedAt (GkeBackend.pod_exits) name host 1."""
    told = Told()

    def cluster():
        pods = _admitted_and_running(play, told)
        told.wait_for("pods scheduled")
        try:
            raise RuntimeError("Unable to initialize backend 'cpu': coordination service lost a task")
        except RuntimeError as error:
            consequence = outcome_of(error)
        for host in HOSTS:
            outcome = None if host == (0, 1) else consequence if host == (0, 0) else {"ok": True, "value": None}
            _host_writes(host, outcome)
        play.pod_status(pods[1], _terminated(7, "2026-11-24T10:00:00Z"))
        play.pod_status(pods[0], _terminated(1, "2026-11-24T10:00:00Z"))
        play.jobset_done(JOBSET, "Failed", "FailedJobs", "jobset failed")

    with Background(cluster, told):
        with pytest.raises(RemoteExit) as raised:
            _call(served, told)
    assert (raised.value.host, raised.value.exit_code) == ((0, 1), 7)
    assert "slice 0 host 1 exited with code 7" in str(raised.value) and "slice 0 host 0 raised" in str(raised.value)
    assert served.kube().get_jobset(JOBSET) is None


def test_interrupted_while_queued_in_kueue_deletes_the_jobset(served, play):
    told = Told()

    def tell(line):
        told.add(line)
        if "waiting for admission" in line or "pending" in line.lower():
            raise KeyboardInterrupt

    def kueue():
        play.kueue_queues(JOBSET, "Insufficient quota")

    with Background(kueue):
        with pytest.raises(KeyboardInterrupt):
            run_remote(train_shard, [1], tpu_type="v6e-16", backend=GkeBackend(served.kube()),
                       output_dir="gs://bucket/remote", call_id=CALL, tell=tell)  # fmt: skip
    assert served.kube().get_jobset(JOBSET) is None
    assert any("stopping: deleting JobSet" in line for line in told.lines)


def test_an_unknown_slice_is_refused_before_anything_is_sent(served, play):
    from multislice.errors import ConfigError

    with pytest.raises(ConfigError, match="tpu_type"):
        run_remote(train_shard, [1], tpu_type="v6e-17", backend=GkeBackend(served.kube()),
                   output_dir="gs://bucket/remote", call_id=CALL, tell=lambda _: None)  # fmt: skip
    with pytest.raises(ConfigError, match="num_slices"):
        run_remote(train_shard, [1], tpu_type="v6e-16", num_slices=0, backend=GkeBackend(served.kube()),
                   output_dir="gs://bucket/remote", call_id=CALL, tell=lambda _: None)  # fmt: skip
    assert served.kube().get_jobset(JOBSET) is None
    assert not storage.path(storage.join(CALL_DIR, "payload.pkl")).exists()


def test_a_detached_call_is_attached_from_its_record_followed_and_another_is_cancelled_alone(served, play):
    """``wait=False`` returns once the JobSet is created; a handle made from the record alone (a new kernel)
    reads the leader's log, waits for the value, and after the JobSet is gone still has the leader's log;
    cancelling a second call deletes its JobSet and not the first's."""
    told, out = Told(), io.StringIO()
    job = _call(served, told, wait=False)
    assert job.id == f"remote-train-shard-{CALL}" and job.jobset == JOBSET and job.status() == "Queued"
    assert served.kube().get_jobset(JOBSET) is not None
    play.kueue_queues(JOBSET, "waiting for quota")  # nobody follows yet: Kueue admits it, its pods run
    assert job.status() == "Queued"
    with pytest.raises(ResultTimeout, match="not running yet after 1 s .*waiting for quota"):
        job.result(timeout=1)  # the wait gives up; the call does not
    assert served.kube().get_jobset(JOBSET) is not None and job.status() == "Queued"
    play.kueue_admits(JOBSET)
    pods = play.pods(JOBSET, 1, 4, pools=POOLS)
    assert job.status() == "Running"

    again = attach(job.id, output_dir="gs://bucket/remote", backend=GkeBackend(served.kube()), tell=told.add, out=out)
    record = again.record
    payload = storage.path(storage.join(CALL_DIR, "payload.pkl")).read_bytes()
    assert record["function"] == f"{__name__}.train_shard"
    assert record["args_sha256"] == hashlib.sha256(payload).hexdigest()
    assert (record["backend"], record["run_id"], record["hosts"]) == ("gke", f"remote-{CALL}", [list(h) for h in HOSTS])
    assert attach(CALL, output_dir="gs://bucket/remote", backend=GkeBackend(served.kube())).id == job.id  # short id
    play.log(pods[0], f"{MARK} slice-0-host-0: started\nshard sum is 6\n")
    play.log(pods[1], f"{MARK} slice-0-host-1: started\n")
    assert again.logs().endswith("shard sum is 6\n") and again.logs(host="0,1") == f"{MARK} slice-0-host-1: started\n"

    def cluster():
        told.wait_for("pods scheduled: 4 of 4 running")
        for host in HOSTS:
            _host_writes(host, None)
        told.wait_for("JAX initialised on 4 of 4 hosts")
        _every_host_returns(play, pods, 6)

    with Background(cluster, told):
        assert again.result() == 6
    assert out.getvalue() == "shard sum is 6\n"
    assert served.kube().get_jobset(JOBSET) is None  # deleted once it finished
    assert job.status() == "Succeeded" and job.result() == 6  # the first handle reads the record
    assert again.logs() == f"{MARK} slice-0-host-0: started\nshard sum is 6\n"  # kept in the call's directory
    with pytest.raises(InputError, match="JobSet .* was deleted.*only the leader's log is kept"):
        again.logs(host=(0, 1))

    other = run_remote(train_shard, [1], tpu_type="v6e-16", backend=GkeBackend(served.kube()), wait=False,
                       output_dir="gs://bucket/remote", call_id="c0ffee01", tell=lambda _: None)  # fmt: skip
    third = run_remote(train_shard, [2], tpu_type="v6e-16", backend=GkeBackend(served.kube()), wait=False,
                       output_dir="gs://bucket/remote", call_id="c0ffee02", tell=lambda _: None)  # fmt: skip
    assert other.cancel() is True and other.status() == "Cancelled"
    assert served.kube().get_jobset(other.jobset) is None and served.kube().get_jobset(third.jobset) is not None
    assert third.status() == "Queued" and job.status() == "Succeeded"
    assert third.cleanup() == [f"JobSet {third.jobset}"] and served.kube().get_jobset(third.jobset) is None
