"""prepare_data on GKE: a ``text`` stage's sources on Cloud Storage tokenized by an Indexed Job's shard workers.

The emulated API (kmock) holds the Job; the Job controller and the kubelet are played by
:meth:`tests.kube_controllers.Play.indexed_job_runs`, which runs each index's pod for real: its container's
command in the trainer environment, with the env the pod spec gives (``$JOB_COMPLETION_INDEX`` from the index
label, as the Job controller adds it) and the loopback Cloud Storage. So the workers tokenize, the step (the
coordinator, under the rendered RBAC) assembles from what they wrote, and what train reads is checked.
"""

from __future__ import annotations

import copy
import json
import subprocess
from pathlib import Path

import pytest
from etils import epath
from kubernetes import client as k8s

from multislice import config, names, storage
from multislice.backends.base import DataWorkersFailed
from multislice.backends.gke import GkeBackend
from multislice.backends.gke import data_workers as gke_workers
from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.errors import InputError
from multislice.plan import make_plan
from multislice.render import schema
from multislice.steps import prepare_data
from tests.backends.gke.harness import RUN_ID, Background, stage_of
from tests.conftest import run_in_trainer

pytestmark = pytest.mark.usefixtures("least_privilege", "run_storage")

ROOT = Path(__file__).resolve().parents[3]
CORPUS = "gs://bucket/corpus"


@pytest.fixture
def plan(tmp_path):
    """The GKE profile's first stage on ``text`` data in ``gs://bucket/corpus``, 2 shard workers, short."""
    profile = copy.deepcopy(config.read_profile("gke-v6e-16x2"))
    profile.update(run_name="r1", output_dir="gs://bucket/runs")
    profile.setdefault("service_accounts", {})["kueue_cluster_objects"] = True
    stage = profile["stages"][0]
    stage.update(steps=2, checkpoint_period=2, per_device_batch_size=1, max_target_length=128, eval_interval=1)
    stage["data"] = {"kind": "text", "files": [f"{CORPUS}/*.txt"], "eval_fraction": 0.2, "workers": 2}
    return make_plan(config.load_spec(profile))


def upload_corpus(count: int = 60) -> None:
    for i in range(count):
        epath.Path(f"{CORPUS}/doc{i:02d}.txt").write_text(
            f"Document {i}. " + "The quick brown fox jumps over the lazy dog. " * 30
        )


def kubelet(gcs):
    """Runs a pod's one container: its command with ``python`` the trainer environment's, its env (values, and
    ``fieldRef``s resolved from the pod's labels as the kubelet does), the loopback Cloud Storage and this
    checkout on the path (the image's ``multislice``)."""

    def run(pod):
        container = pod["spec"]["containers"][0]
        env = {**trainer_process_env(trainer_env()), **gcs.env, "PYTHONPATH": str(ROOT)}
        for var in container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
            else:
                path = var["valueFrom"]["fieldRef"]["fieldPath"]
                label = path.removeprefix("metadata.labels['").removesuffix("']")
                env[var["name"]] = pod["metadata"]["labels"][label]
        argv = [str(trainer_env() / "bin" / "python"), *container["command"][1:]]
        assert container["command"][0] == "python"
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    return run


def round_trip(job):
    """The Job as the Kubernetes client's models read it, written back: a field the batch/v1 API does not have (or
    of the wrong shape) is dropped or fails, so equality means the manifest is in the API's schema."""
    api = k8s.ApiClient()
    return api.sanitize_for_serialization(api._ApiClient__deserialize(job, "V1Job"))  # noqa: SLF001


def test_a_text_stage_is_prepared_by_an_indexed_job_and_train_reads_it(
    served, play, plan, gcs, told, trainer_python, tmp_path
):
    upload_corpus()
    stage = stage_of(plan)
    kube = served.kube()
    seen = {}

    def controllers():
        seen["job"] = play.indexed_job_runs(f"{stage.workload}-data-", kubelet(gcs))

    with Background(controllers, told):
        report = prepare_data.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    job = seen["job"]
    # The Indexed Job: one completion index per source range, both at once, in the trainer image, no Kueue label.
    assert (job["spec"]["completionMode"], job["spec"]["completions"], job["spec"]["parallelism"]) == ("Indexed", 2, 2)
    assert (job["spec"]["backoffLimitPerIndex"], job["spec"]["maxFailedIndexes"]) == (1, 0)
    meta = {k: job["metadata"][k] for k in ("name", "namespace", "labels", "annotations")}
    rendered = {"apiVersion": job["apiVersion"], "kind": job["kind"], "metadata": meta, "spec": job["spec"]}
    assert schema.builtin_problems(rendered) == [] and round_trip(rendered) == rendered
    pod = job["spec"]["template"]["spec"]
    assert pod["containers"][0]["image"] == plan.spec.images.trainer
    assert pod["containers"][0]["command"][:4] == ["python", "-m", "multislice.trainer.prepare_shards", "worker"]
    assert pod["serviceAccountName"] == plan.spec.service_accounts.trainer
    assert pod["containers"][0]["resources"]["requests"] == {"cpu": gke_workers.CPU, "memory": gke_workers.MEMORY}
    assert job["metadata"]["labels"][names.LABEL_PIPELINE_RUN_ID] == RUN_ID
    assert names.KUEUE_QUEUE_LABEL not in job["metadata"]["labels"]
    # The coordinator assembled both workers' parts into the stage's data directory, manifest last, parts removed.
    manifest = report.manifest
    assert not report.reused and report.uri == stage.data_dir and manifest["workers"] == 2
    assert [e["index"] for e in manifest["worker_exits"]] == [0, 1]
    assert all(e["exit_code"] == 0 and e["pod"].startswith(f"{job['metadata']['name']}-{e['index']}-")
               for e in manifest["worker_exits"])  # fmt: skip
    assert [p["sources"] for p in manifest["parts"]] == [30, 30]
    assert all(s["crc32c"] and s["generation"] and "sha256" not in s for s in manifest["sources"])  # from the listing
    prefix = stage.data_dir.removeprefix("gs://bucket/") + "/"
    written = gcs.names(prefix=prefix)
    assert sorted(n.removeprefix(prefix) for n in written) == sorted([*manifest["shards"], "manifest.json"])
    assert not [n for n in gcs.names(prefix="runs/") if ".parts-" in n]
    train, held = manifest["splits"]["train"], manifest["splits"]["eval"]
    assert train["documents"] + held["documents"] == 60 and manifest["token_count"] == train["tokens"] + held["tokens"]
    # train consumes it: the stage's MaxText arguments read the assembled shards
    args = dict(a.split("=", 1) for a in stage.maxtext_args)
    assert args["grain_train_files"] == f"{stage.data_dir}/train-*.array_record"
    assert args["grain_eval_files"] == f"{stage.data_dir}/eval-*.array_record"
    # MaxText's grain parser reads an assembled shard as pre-tokenized sequences (a copy: grain opens local files)
    shard = tmp_path / "train-00000.array_record"
    shard.write_bytes(gcs.read(prefix + "train-00000.array_record"))
    script = (
        "import sys, grain.python as grain\n"
        "from maxtext.input_pipeline.input_pipeline_utils import ParseFeatures\n"
        "source = grain.ArrayRecordDataSource(sys.argv[1:])\n"
        "row = ParseFeatures(['text'], False).map(source[0])['text']\n"
        "print(len(source), len(row), row[0])\n"
    )
    done = run_in_trainer(trainer_python, script, str(shard))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split()[1:] == ["128", "128000"]  # full-length sequences, beginning with Llama 3's BOS
    stored = json.loads(gcs.read(prefix + "manifest.json"))
    assert stored["fingerprint"] == manifest["fingerprint"] and "worker_exits" not in stored

    # A second run on the same objects: reused from the listing (generation, CRC32C), no Job created.
    jobs_before = len(play.batch.list_namespaced_job("default").items)
    again = prepare_data.run(plan, stage, RUN_ID, backend=GkeBackend(kube))
    assert again.reused and again.manifest["fingerprint"] == manifest["fingerprint"]
    assert len(play.batch.list_namespaced_job("default").items) == jobs_before


def test_a_failed_shard_worker_fails_the_step_with_its_last_lines(served, play, plan, gcs, told):
    upload_corpus(10)
    epath.Path(f"{CORPUS}/doc05.txt").write_bytes(b"")  # still a document; the failure comes from the worker below
    stage = stage_of(plan)

    def fails(pod):
        index = pod["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"]
        script = f"import sys; print('range {index}'); print('boom: bad tokenizer', file=sys.stderr); sys.exit(3)"
        argv = [str(trainer_env() / "bin" / "python"), "-c", script]
        env = trainer_process_env(trainer_env())
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)

    with Background(lambda: play.indexed_job_runs(f"{stage.workload}-data-", fails), told):
        with pytest.raises(DataWorkersFailed) as caught:
            prepare_data.run(plan, stage, RUN_ID, backend=GkeBackend(served.kube()))
    said = str(caught.value)
    assert "index 0" in said and "exit code 3" in said and "boom: bad tokenizer" in said
    assert storage.read_text(f"{stage.data_dir}/manifest.json") is None  # nothing assembled


def test_sources_a_pod_cannot_read_are_refused_naming_the_field(served, play, plan):
    profile_stage = plan.spec.stages[0].model_copy(
        update={"data": plan.spec.stages[0].data.model_copy(update={"files": ("site-packages:*.dist-info/METADATA",)})}
    )
    spec = plan.spec.model_copy(update={"stages": [profile_stage, *plan.spec.stages[1:]]})
    bad = make_plan(spec)
    with pytest.raises(InputError) as caught:
        prepare_data.run(bad, stage_of(bad), RUN_ID, backend=GkeBackend(served.kube()))
    assert f"stages.{stage_of(bad).name}.data.files[0]" in str(caught.value) and "gs://" in caught.value.fix
    assert play.batch.list_namespaced_job("default").items == []
