"""Golden files: rendered manifests and compiled pipelines per profile, and the CLI's transcripts.

``make goldens`` (``python -m tests.golden``) regenerates them; the tests in
``tests/render/test_manifests.py``, ``tests/pipelines/test_pipeline.py`` and
``tests/cli/test_transcripts.py`` fail when the output differs, so every
change to what users apply, upload or read shows up in review as a diff of
these files.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from multislice import config
from multislice.backends import manifests
from multislice.plan import make_plan

GOLDEN_DIR = Path(__file__).resolve().parent
#: ``gke-v6e-16x2``: the production stages (MaxText's measured v6e recipes); ``gke-v6e-16x2-seed``: the seed's
#: commands, whose files are those ``gke-v6e-16x2`` rendered before the production stages took that name.
PROFILES = ("local", "gke-v6e-16x2", "gke-v6e-16x2-seed")
#: Manifest-only goldens of a profile with changes: name -> (profile, top-level spec fields replaced).
#: ``gke-v6e-16x2-seed-ray``: every stage launched by Ray (RayJobs) on node pools with an extra network for
#: DCN traffic (DRANET ResourceClaimTemplates), its TPU workers off the host network (DRANET refuses hostNetwork
#: pods that claim a device) with Workload Identity.
#: The variants keep the seed's stages (and their files of before, as ``gke-v6e-16x2-ray`` and ``-emergency``).
MANIFEST_VARIANTS: dict[str, tuple[str, dict]] = {
    "gke-v6e-16x2-seed-ray": (
        "gke-v6e-16x2-seed",
        {
            "launcher": "ray",
            "node_pools.additional_node_networks": [{"network": "dcn-net", "subnetwork": "dcn-sub"}],
            # The workers claim DRANET devices, so they are off the host network (DRANET refuses hostNetwork pods)
            # and write gs:// through Workload Identity.
            "service_accounts.tpu_host_network": False,
            "service_accounts.tpu_workload_identity": True,
        },
    ),
    # ``gke-v6e-16x2-seed-emergency``: the 8B stage with emergency checkpoints (a local checkpoint every 10 steps on
    # each node's checkpoint ramdisk, the persistent one every 50 as before) instead of elastic, which they exclude.
    "gke-v6e-16x2-seed-emergency": (
        "gke-v6e-16x2-seed",
        {"stages.0.elastic": None, "stages.0.emergency_checkpoint": {"local_period": 10}},
    ),
}
#: The pipeline/runid label value in golden manifests.
GOLDEN_RUN_ID = "golden-run"


def rendered_manifests(profile: str) -> dict[str, str]:
    """Relative path -> text of every file ``multislice render`` writes for a profile or :data:`MANIFEST_VARIANTS`."""
    if profile in MANIFEST_VARIANTS:
        base, changes = MANIFEST_VARIANTS[profile]
        data = config.spec_to_data(config.load_profile(base))
        for path, value in changes.items():
            *parents, last = path.split(".")
            target = data
            for part in parents:  # a number indexes a list (stages.0)
                target = target[int(part)] if isinstance(target, list) else target.setdefault(part, {})
            target[last] = value
        plan = make_plan(config.load_spec(data))
    else:
        plan = make_plan(config.load_profile(profile))
    return manifests.render_files(plan, GOLDEN_RUN_ID)


def golden_files(profile: str) -> dict[str, Path]:
    """Relative path -> golden file of every rendered file of a profile (what is stored now)."""
    directory = GOLDEN_DIR / profile / "manifests"
    return {p.relative_to(directory).as_posix(): p for p in sorted(directory.rglob("*")) if p.is_file()}


#: Golden file name of each compile target's pipeline.
PIPELINE_GOLDENS = {"kfp": "pipeline.yaml", "vertex": "pipeline.vertex.yaml"}


def compiled_pipeline(profile: str, target: str = "kfp") -> str:
    """The compiled pipeline YAML of a profile for a target, as ``make compile`` writes it."""
    from pipelines.multislice_training import compile_pipeline

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "pipeline.yaml"
        compile_pipeline(config.read_profile(profile), str(path), target=target)
        return path.read_text(encoding="utf-8")


def regenerate() -> list[Path]:
    """Rewrite every golden file; returns the paths written."""
    written = []
    for profile in (*PROFILES, *MANIFEST_VARIANTS):
        directory = GOLDEN_DIR / profile / "manifests"
        directory.mkdir(parents=True, exist_ok=True)
        for stale in golden_files(profile).values():
            stale.unlink()
        for name, text in rendered_manifests(profile).items():
            (directory / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / name).write_text(text, encoding="utf-8")
            written.append(directory / name)
        if profile in MANIFEST_VARIANTS:
            continue
        for target, name in PIPELINE_GOLDENS.items():
            pipeline = GOLDEN_DIR / profile / name
            pipeline.write_text(compiled_pipeline(profile, target), encoding="utf-8")
            written.append(pipeline)
    CLI_DIR.mkdir(exist_ok=True)
    for name in CLI_COMMANDS:
        cli_golden(name).write_text(cli_transcript(name), encoding="utf-8")
        written.append(cli_golden(name))
    return written


# ---------------------------------------------------------------------------
# CLI transcripts: what a user sees, as xpk keeps its recipes/*.md.

CLI_DIR = GOLDEN_DIR / "cli"
ROOT = GOLDEN_DIR.parents[1]
#: Transcript name -> the CLI's arguments. ``{out}`` and ``{cache}`` are scratch directories, shown as
#: ``<OUT>`` and ``<CACHE>``. No cloud credentials and no kubeconfig are to be found (see :func:`no_cloud_env`).
CLI_COMMANDS: dict[str, list[str]] = {
    "render": ["render", "--profile", "gke-v6e-16x2", "--output", "{out}/manifests"],
    "compile": ["compile", "--profile", "gke-v6e-16x2", "--target", "vertex", "--output", "{out}/pipeline.yaml"],
    "preflight-does-not-fit": [
        "preflight", "--profile", "gke-v6e-16x2-seed", "--stage", "seed-llama3-70b", "--no-alternative",
        "--cache-dir", "{cache}",
    ],
    "bad-config": ["render", "--profile", "local", "--output", "{out}", "--set", "stages.0.ici.fsdp=8"],
    "unknown-profile": ["compile", "--profile", "gke-v6e-16", "--output", "{out}/pipeline.yaml"],
    "missing-checkpoint": ["verify-checkpoint", "{out}/runs/llama3-multislice/llama3-8b"],
    "cleanup-unknown-run": ["cleanup", "--run", "llama3-multislice", "--output-dir", "{out}/runs"],
    "no-credentials": ["preflight", "--profile", "gke-v6e-16x2", "--on-cluster"],
    "unreachable-cluster": [
        "preflight", "--profile", "gke-v6e-16x2", "--on-cluster", "--set", "cluster.access=kubeconfig",
    ],
    "run-help": ["run", "--help"],
    "submit-dry-run": [
        "submit", "--profile", "gke-v6e-16x2", "--target", "vertex", "--project", "my-project", "--location",
        "us-east5", "--label", "team=ml-platform", "--set", "output_dir=gs://my-bucket/runs", "--set",
        "cluster_project=my-project", "--set", "cluster_name=my-cluster", "--set",
        "trainer_image=us-east5-docker.pkg.dev/my-project/multislice/multislice-trainer:0.1.0-3f2a9c1d0b7e", "--set",
        "images.pipeline=us-east5-docker.pkg.dev/my-project/multislice/multislice-pipeline:0.1.0-3f2a9c1d0b7e",
        "--set", "service_accounts.trainer_gcp_service_account=multislice-trainer@my-project.iam.gserviceaccount.com",
        "--set", "run_name=nightly", "--set", "stage1_steps=4", "--dry-run",
    ],
    # The packaged profile as it ships: its placeholders are refused, each named with its fix (issue 44).
    "submit-placeholders": [
        "submit", "--profile", "gke-v6e-16x2", "--target", "kfp", "--host", "http://localhost:8888", "--dry-run",
    ],
    "schedule-create-help": ["schedule", "create", "--help"],
}  # fmt: skip
#: The terminal width the transcripts are written for (argparse wraps ``--help`` to ``$COLUMNS``).
COLUMNS = 100

#: The seed 70B command's verdict on 2 x v6e-16 as the compiler gave it here, with the v6e libtpu flags
#: the run's pods get (libtpu 0.0.52; tests/data/oom_messages.json): what the transcript's verdict cache
#: holds, so the transcript shows the CLI's output without a 30 s compile.
SEED_VERDICT_MESSAGE = "v6e-16 x 2, llama3-70b, per_device_batch_size 2 (the seed command, with the v6e libtpu flags)"


def no_cloud_env(home: Path) -> dict[str, str]:
    """This process's environment without any way to cloud credentials or a cluster."""
    import os

    env = {k: v for k, v in os.environ.items() if not k.startswith(("GOOGLE_", "CLOUDSDK_", "KUBECONFIG"))}
    return {
        **env,
        "PYTHONUNBUFFERED": "1",
        "COLUMNS": str(COLUMNS),
        "HOME": str(home),  # no ~/.kube/config, no ~/.config/gcloud credentials
        "GOOGLE_APPLICATION_CREDENTIALS": str(home / "no-such-key.json"),
        "KUBECONFIG": str(home / "no-such-kubeconfig"),
        "CLOUDSDK_CONFIG": str(home / "gcloud"),
    }


def seed_verdict_cache(cache: Path) -> None:
    """Store the recorded verdict of the seed 70B stage under its cache key (the trainer environment's versions)."""
    import json
    import subprocess

    from multislice.backends.local import trainer_env, trainer_process_env
    from multislice.preflight import request_for
    from multislice.trainer import aot

    env = trainer_env()
    code = "import json; from multislice.trainer import aot; print(json.dumps(aot.versions()))"
    found = json.loads(
        subprocess.run(
            [str(env / "bin" / "python"), "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env=trainer_process_env(env),
        ).stdout  # fmt: skip
    )
    spec = config.load_profile("gke-v6e-16x2-seed")
    plan = make_plan(config.load_spec(config.spec_to_data(spec.with_stages(spec.stage("seed-llama3-70b")))))
    request = request_for(plan, plan.stages[0])
    messages = json.loads((GOLDEN_DIR.parent / "data" / "oom_messages.json").read_text())["messages"]
    result = {
        "verdict": "does_not_fit", "oom": aot.parse_oom(messages[SEED_VERDICT_MESSAGE]), "compile_seconds": 13.6,
        "model_tflops_per_step_per_device": 3548.09, "tokens_per_step_per_device": 8192.0, "versions": found,
        "maxtext_args": request["maxtext_args"],
    }  # fmt: skip
    key = aot.cache_key(
        request["compile_topology"], request["num_slices"], request["maxtext_args"], found, request["libtpu_flags"]
    )
    aot.cache_write(str(cache), key, result)


def cli_transcript(name: str) -> str:
    """Run ``multislice`` with the arguments of ``name`` and return what it printed, as a transcript.

    Both streams, in order, then the exit status; scratch paths replaced by ``<OUT>`` and ``<CACHE>``.
    """
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        out, cache, home = Path(tmp) / "out", Path(tmp) / "cache", Path(tmp) / "home"
        for directory in (out, home):
            directory.mkdir()
        if name == "preflight-does-not-fit":
            seed_verdict_cache(cache)
        argv = [a.format(out=out, cache=cache) for a in CLI_COMMANDS[name]]
        done = subprocess.run(
            [sys.executable, "-m", "multislice.cli", *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
            text=True, cwd=ROOT, env=no_cloud_env(home), timeout=600,
        )  # fmt: skip
        text = done.stdout.replace(str(out), "<OUT>").replace(str(cache), "<CACHE>").replace(str(home), "<HOME>")
        shown = " ".join(a.replace(str(out), "<OUT>").replace(str(cache), "<CACHE>") for a in argv)
        return f"$ multislice {shown}\n{text}(exit {done.returncode})\n"


def cli_golden(name: str) -> Path:
    """The golden transcript file of a CLI command."""
    return CLI_DIR / f"{name}.txt"
