"""Trainer-side code, run in the trainer environment: MaxText facts and the emulated-slice DCN mesh."""

import json
import socket
import subprocess

from multislice import maxtext
from multislice.backends.local import trainer_process_env
from multislice.trainer import lean_imports
from tests.conftest import run_in_trainer

FACTS = (
    f"MODEL_DIMS = {list(maxtext.MODEL_DIMS)!r}\n"
    + """
import json, typing, yaml
from pathlib import Path
from maxtext import configs
from maxtext.configs import types
base = yaml.safe_load(Path(configs.__file__).with_name("base.yml").read_text())
print(json.dumps({
    "model_names": list(typing.get_args(types.ModelName)),
    "remat": [p.value for p in types.RematPolicy],
    "base": {k: v for k, v in base.items() if k.endswith("_parallelism")},
    "mesh_axes": base["mesh_axes"],
    "emergency_fields": list(types.EmergencyCheckpointing.model_fields),
    "models": {
        name: yaml.safe_load((Path(configs.__file__).parent / "models" / f"{name}.yml").read_text())
        for name in MODEL_DIMS
    },
}))
"""
)


def test_maxtext_facts_match_the_installed_maxtext(trainer_python):
    done = run_in_trainer(trainer_python, FACTS)
    assert done.returncode == 0, done.stderr[-2000:]
    facts = json.loads(done.stdout.strip().splitlines()[-1])
    assert tuple(facts["model_names"]) == maxtext.MODEL_NAMES
    assert tuple(facts["remat"]) == maxtext.REMAT_POLICIES
    for net, defaults in (("ici", maxtext.ICI_DEFAULTS), ("dcn", maxtext.DCN_DEFAULTS)):
        for axis in maxtext.PARALLELISM_AXES:
            assert facts["base"][f"{net}_{axis}_parallelism"] == defaults.get(axis, 1), (net, axis)
    assert tuple(facts["mesh_axes"]) == maxtext.MESH_AXES
    emergency = {*maxtext.EMERGENCY_CHECKPOINT_KEYS, *maxtext.MULTI_TIER_CHECKPOINT_KEYS}
    assert emergency == set(facts["emergency_fields"])
    for name, dims in maxtext.MODEL_DIMS.items():
        yml = facts["models"][name]
        for key, value in dims.items():
            assert yml.get(maxtext.MODEL_DIM_KEYS[key], 128 if key == "head_dim" else None) == value, (name, key)
        assert yml["mlp_activations"] == ["silu", "linear"] and not yml.get("logits_via_embedding", False), name


def test_committed_maxtext_config_schema_matches_the_installed_maxtext(trainer_python):
    # multislice/data/maxtext_config_schema.json is what validates maxtext_overrides in the pipeline environment.
    script = "import sys; from multislice.trainer import maxtext_schema; sys.stdout.write(maxtext_schema.render())"
    done = run_in_trainer(trainer_python, script)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout == maxtext.CONFIG_SCHEMA_FILE.read_text(encoding="utf-8"), (
        "regenerate it: PYTHONPATH=$PWD .venvs/trainer/bin/python -m multislice.trainer.maxtext_schema "
        "> multislice/data/maxtext_config_schema.json"
    )


FAKE_DEVICES = """
import json, sys
import numpy as np
from jax.experimental import mesh_utils
from multislice.trainer.emulated_slices import emulated_hybrid_device_mesh

class Device:
    platform = device_kind = "cpu"
    def __init__(self, id, process_index, slice_index=None):
        self.id, self.process_index = id, process_index
        if slice_index is not None:
            self.slice_index = slice_index

def one_slice_per_dcn_block(mesh, ici, dcn, per_slice):
    slices = np.vectorize(lambda d: d.process_index // per_slice)(mesh)
    for axis, (i, d) in enumerate(zip(ici, dcn)):
        for block in range(d if d > 1 else 0):
            if len(np.unique(np.take(slices, range(block * i, (block + 1) * i), axis=axis))) != 1:
                return False
    return True

results = []
for processes, per_slice, per_process, ici, dcn in json.loads(sys.argv[1]):
    plain = [Device(p * 100 + d, p) for p in range(processes) for d in range(per_process)]
    tagged = [Device(d.id, d.process_index, d.process_index // per_slice) for d in plain]
    ours = emulated_hybrid_device_mesh(ici, dcn, plain, per_slice)
    jaxs = mesh_utils.create_hybrid_device_mesh(ici, dcn, tagged)
    results.append({
        "ours": np.vectorize(lambda d: d.id)(ours).tolist(),
        "jax": np.vectorize(lambda d: d.id)(jaxs).tolist(),
        "shape": list(ours.shape),
        "one_slice_per_dcn_block": one_slice_per_dcn_block(ours, ici, dcn, per_slice),
    })
print(json.dumps(results))
"""

CASES = [
    # processes, processes per slice, devices per process, ICI shape, DCN shape
    (4, 2, 4, [4, 2], [2, 1]),  # the local profile: fsdp=4 x tensor=2 per slice, DCN FSDP 2
    (4, 2, 4, [1, 4, 2], [2, 1, 1]),  # DCN data parallelism 2 over the slices
    (8, 2, 2, [2, 2], [4, 1]),  # 4 slices
    (6, 3, 1, [3, 1], [1, 2]),  # DCN on the last axis
]


def test_emulated_mesh_equals_jax_mesh_for_devices_with_slice_indices(trainer_python):
    done = run_in_trainer(trainer_python, FAKE_DEVICES, json.dumps(CASES))
    assert done.returncode == 0, done.stderr[-2000:]
    for (_, _, _, ici, dcn), result in zip(CASES, json.loads(done.stdout), strict=True):
        assert result["ours"] == result["jax"]
        assert result["shape"] == [i * d for i, d in zip(ici, dcn, strict=True)]
        assert result["one_slice_per_dcn_block"]


MULTI_PROCESS = """
import json, sys
import jax
import numpy as np
from jax.experimental import mesh_utils
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=4, process_id=int(sys.argv[2]))
from multislice.trainer.emulated_slices import emulated_hybrid_device_mesh

class Tagged:  # a stand-in carrying the slice_index TPU devices have
    platform = device_kind = "cpu"
    def __init__(self, device):
        self.id, self.process_index, self.slice_index = device.id, device.process_index, device.process_index // 2

devices = jax.devices()
try:
    mesh_utils.create_hybrid_device_mesh([2, 2], [2, 1], devices)
    direct = "built"
except ValueError as error:
    direct = str(error)
mesh = emulated_hybrid_device_mesh([2, 2], [2, 1], devices, processes_per_slice=2)
reference = mesh_utils.create_hybrid_device_mesh([2, 2], [2, 1], [Tagged(d) for d in devices])
ids = np.vectorize(lambda d: d.id)
print(json.dumps({"direct": direct, "ids": ids(mesh).tolist(), "reference": ids(reference).tolist(),
                  "process": np.vectorize(lambda d: d.process_index)(mesh).tolist()}), flush=True)
jax.distributed.shutdown()
"""


def test_emulated_slices_across_real_jax_processes(trainer_python):
    """2 slices x 2 hosts x 2 CPU devices, four real JAX processes: slice s = processes 2s and 2s+1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = trainer_process_env(trainer_python.parent.parent)
    env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
    procs = [
        subprocess.Popen(
            [str(trainer_python), "-c", MULTI_PROCESS, f"127.0.0.1:{port}", str(i)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )  # fmt: skip
        for i in range(4)
    ]
    outputs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs[0][1][-2000:]
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outputs]
    assert all(r["ids"] == results[0]["ids"] for r in results)  # every process builds the same mesh
    # Without the grouping JAX sees a single slice: the gap the emulation fills.
    assert "Number of slices 1 must equal the product of dcn_mesh_shape" in results[0]["direct"]
    assert results[0]["ids"] == results[0]["reference"]
    assert {p for row in results[0]["process"][:2] for p in row} == {0, 1}
    assert {p for row in results[0]["process"][2:] for p in row} == {2, 3}


def test_tokenizer_vocab_sizes_match_maxtexts_tokenizers(trainer_python):
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "import maxtext\n"
        "from maxtext.input_pipeline.tokenizer import build_tokenizer\n"
        "root = Path(maxtext.__file__).parent\n"
        "sizes = {p: build_tokenizer(str(root / p), 'tiktoken', False, False, None).n_words for p in sys.argv[1:]}\n"
        "print(json.dumps(sizes))\n"
    )
    done = run_in_trainer(trainer_python, script, *maxtext.TOKENIZER_VOCAB_SIZES)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == maxtext.TOKENIZER_VOCAB_SIZES


#: What the train worker (``multislice.trainer.worker``) imports of this package, at module level and in ``main``
#: before MaxText's train module.
WORKER_OWN_IMPORTS = (
    "import sys, json\n"
    "import multislice.trainer.worker\n"
    "from multislice.trainer import digests, emulated_slices\n"
    "print(json.dumps(sorted(m for m in ('torch', 'transformers') if m in sys.modules)))\n"
)


def test_the_train_workers_own_imports_pull_in_no_torch_or_transformers(trainer_python):
    """The exporter and the HF loader need torch and transformers; the step loop does not (issue 28). This guards
    what the worker itself adds; that MaxText's train module, imported after ``lean_imports.install``, brings in
    neither is asserted on the shared end-to-end run's worker logs (tests/e2e/test_local_run.py)."""
    done = run_in_trainer(trainer_python, WORKER_OWN_IMPORTS)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []


VERTEX_TENSORBOARD_IMPORTS = (
    "import sys, json\n"
    "from multislice.trainer import lean_imports\n"
    "lean_imports.install(sys.argv[1:])\n"
    "from maxtext.trainers.pre_train import train\n"
    "print(json.dumps([train._vertex_tb_is_stub, 'google.cloud.aiplatform' in sys.modules]))\n"
)


def test_the_vertex_ai_sdk_is_imported_only_for_a_run_that_uploads_to_vertex_tensorboard(trainer_python):
    """MaxText's trainer imports the Vertex AI SDK at its import, for the TensorBoard uploader a run uses only with
    use_vertex_tensorboard; without it the worker gets MaxText's no-op stub and no SDK (a third of its imports'
    CPU time, multislice.trainer.lean_imports). The keys that turn it on are read as MaxText reads them."""
    done = run_in_trainer(trainer_python, VERTEX_TENSORBOARD_IMPORTS, "steps=3")
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == [True, False]
    assert lean_imports.uploads_to_vertex_tensorboard(["use_vertex_tensorboard=True"], environ={})
    assert lean_imports.uploads_to_vertex_tensorboard([], environ={"UPLOAD_DATA_TO_TENSORBOARD": "1"})
    assert not lean_imports.uploads_to_vertex_tensorboard(["use_vertex_tensorboard=false"], environ={})


def _print_then_wait_for_stdin():
    import sys

    print("halfway")  # no flush: the remote worker's line buffering must send it
    return 7 if sys.stdin.readline() == "go on\n" else -1


def test_a_remote_functions_print_reaches_the_pipe_while_it_runs(trainer_python, tmp_path):
    """The remote worker with its stdout a pipe and no PYTHONUNBUFFERED (trainer_process_env drops PYTHON*): the
    function's print arrives while the function waits on stdin, which the test feeds only once it read the line."""
    import queue
    import sys
    import threading

    import cloudpickle

    from multislice.remote_call import _pickle_payload
    from multislice.trainer.remote_worker import MARK, host_key

    (tmp_path / "payload.pkl").write_bytes(_pickle_payload(_print_then_wait_for_stdin, (), {}, [sys.modules[__name__]]))
    env = trainer_process_env(trainer_python.parent.parent)
    assert not any(k.startswith("PYTHON") for k in env)
    worker = subprocess.Popen(
        [str(trainer_python), "-m", "multislice.trainer.remote_worker", "--call-dir", str(tmp_path)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
    )  # fmt: skip
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in worker.stdout], daemon=True).start()
    try:
        seen = []
        while not seen or seen[-1] != "halfway\n":
            try:
                seen.append(lines.get(timeout=120))  # a failure bound: without line buffering it never comes
            except queue.Empty:
                raise AssertionError(f"the print did not arrive while the function ran; lines: {seen}") from None
        assert worker.poll() is None and not (tmp_path / "hosts" / f"{host_key(0, 0)}.result").exists()
        worker.stdin.write("go on\n")
        worker.stdin.close()
        assert worker.wait(timeout=120) == 0
    finally:
        worker.kill()
    outcome = cloudpickle.loads((tmp_path / "hosts" / f"{host_key(0, 0)}.result").read_bytes())
    assert outcome == {"ok": True, "value": 7}
    assert seen[0] == f"{MARK} slice-0-host-0: started\n"
