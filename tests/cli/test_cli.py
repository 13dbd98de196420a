"""The CLI's run command reports a failed pipeline with the failing step's own error."""

import os
import re
import subprocess
import sys

from tests.gcs import FakeGcs


def test_failed_run_names_the_step_and_its_cause(tmp_path):
    # backend gke through a kubeconfig that does not exist: the plan step, which holds the run's Lease on the cluster
    # (the reaper's proof that the run is alive), cannot reach it, so the run stops there, before preflight compiles
    # anything. (local-synthetic: no corpus to prepare into the fake gs:// bucket first.)
    with FakeGcs() as gcs:
        env = {**os.environ, **gcs.env, "KUBECONFIG": str(tmp_path / "no-such-kubeconfig")}
        done = subprocess.run(
            [sys.executable, "-m", "multislice.cli", "run", "--profile", "local-synthetic", "--set", "backend=gke",
             "--set", "output_dir=gs://bucket/runs", "--set", "run_name=fails", "--set", "cluster.project=my-project",
             "--set", "cluster.location=us-east5-b", "--set", "cluster.name=tpu-cluster",
             "--set", "skip_preflight=true", "--set", "cluster.access=kubeconfig"],
            capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env,
        )  # fmt: skip
        written = gcs.names(prefix="runs/fails/")
    assert done.returncode == 1
    assert re.search(r"Inner task failed: 'plan(-2)?'", done.stderr), done.stderr  # either stage's plan task
    assert (
        "cause: multislice.backends.gke.access.ClusterAccessError: access kubeconfig: cannot load context"
        in done.stderr
    )
    assert "[cleanup] cannot reach the gke backend, so nothing was deleted" in done.stdout
    assert "run fails: FAILED" in done.stdout and "[cleanup]" in done.stdout
    local = tmp_path / "build" / "runs" / "fails"
    # This run's compiled pipeline and full log, named by its run id (a rerun of the name keeps them).
    compiled, logs = sorted(local.glob("pipeline.*.yaml")), sorted(local.glob("pipeline.*.log"))
    assert len(compiled) == len(logs) == 1 and compiled[0].name.removesuffix(".yaml") == logs[0].name[:-4]
    assert f"see {logs[0]}" in done.stderr
    assert not (tmp_path / "gs:").exists()
    # Nothing after the plan step ran; the exit handler's report is in the gs:// run directory, read from there.
    assert not any(name.endswith(("preflight.json", "provision.json")) for name in written), written
    assert "runs/fails/reports/cleanup.json" in written
    assert "preflight     " not in done.stdout  # no stage reached preflight: its summary line is absent


def _subcommands(parser, prefix=""):
    """Every sub-command parser of ``parser`` by its full name (``schedule create``), nested ones included."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield f"{prefix}{name}", sub
                yield from _subcommands(sub, f"{prefix}{name} ")


def test_run_help_lists_every_parameter_with_the_profiles_value_and_how_to_set_it(capsys):
    import pytest

    from multislice import cli, config
    from multislice.config import parameters

    with pytest.raises(SystemExit) as done:
        cli.main(["run", "--profile", "gke-v6e-16x2-seed", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0
    assert "run parameters: --set NAME=VALUE (repeatable); profile gke-v6e-16x2-seed's values" in out
    spec = config.load_profile("gke-v6e-16x2-seed")
    listed = [line.split("=")[0].strip() for line in out.splitlines() if line.startswith("  ") and "=" in line
              and line[2] != " " and not line.lstrip().startswith(("--set", "multislice"))]  # fmt: skip
    assert listed == list(parameters.parameter_values(spec))  # every parameter, in the pipeline's order
    steps = spec.stages[0].steps
    assert f"\n  stage1_steps={steps} (int; sets stages.0.steps)\n      Stage 1 (llama3-8b): Training steps\n" in out
    assert "\n  trainer_image=multislice-trainer:0.1.0 (str; sets images.trainer)\n" in out
    assert "\n  cluster_project=your-project (str; sets cluster.project; '' for none)\n" in out
    assert "--set stages.0.ici.fsdp=4" in out  # dotted keys, stages by index or name
    # Without --profile: the values of `make run`'s profile, local.
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    local_steps = config.load_profile("local").stages[0].steps
    assert f"\n  stage1_steps={local_steps} (int; sets stages.0.steps)\n" in capsys.readouterr().out


def test_every_subcommand_help_ends_with_an_example_of_itself():
    from multislice import cli

    names = []
    for name, sub in _subcommands(cli.build_parser([])):
        text = sub.format_help()
        names.append(name)
        assert "\nexamples:\n" in text, name
        examples = text.split("\nexamples:\n")[1]
        assert f"  multislice {name} " in examples, name
    assert {"run", "submit", "schedule create", "schedule update", "inject"} <= set(names)


def test_compile_without_built_images_warns_naming_the_images_and_the_fix(tmp_path, capsys):
    """A compile with no ``build/images`` record and the profile's registry-less image names still writes the
    pipeline (compiling offline keeps working) but says on stderr which images no cluster could pull and how to
    build or name pushed ones; pushed references, given, compile without the warning."""
    from multislice.cli import app

    out, no_builds = tmp_path / "p.yaml", tmp_path / "no-builds"
    args = ["compile", "--profile", "gke-v6e-16x2", "--target", "vertex", "--images", str(no_builds), "--output"]
    assert app.main([*args, str(out)]) == 0 and out.is_file()
    err = capsys.readouterr().err
    assert "warning: the compiled pipeline's pipeline image multislice-pipeline:0.1.0 names no registry" in err
    assert "warning: the compiled pipeline's trainer image multislice-trainer:0.1.0 names no registry" in err
    assert "make images PUSH=1" in err and "--base-image" in err and "--set images.trainer=" in err
    repo = "us-east5-docker.pkg.dev/my-proj/ml"
    pushed = ["--base-image", f"{repo}/multislice-pipeline:0.1.0-abc", "--set",
              f"images.trainer={repo}/multislice-trainer:0.1.0-abc", "--set",
              f"images.in_place_restart_agent={repo}/in-place-restart-agent:v0.12.0"]  # fmt: skip
    assert app.main([*args, str(tmp_path / "q.yaml"), *pushed]) == 0
    assert "warning" not in capsys.readouterr().err
