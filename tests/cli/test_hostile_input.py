"""Hostile input never ends in a traceback, and an invalid value is refused before anything is created.

Property-based (hypothesis) cases through the CLI, driven in-process
(:func:`multislice.cli.main`): profile files, ``--set`` values, the pipeline's
typed parameters and CLI paths. Each must exit 2 naming the field and the fix,
with nothing written, or be accepted when the value is valid. Explicit
regression tests follow for each class of input QA found accepted or crashing.
"""

from __future__ import annotations

import contextlib
import copy
import io
import os
import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from multislice import cli, config, names
from multislice.config import parameters, values, yaml_input
from multislice.errors import UserError
from tests import deployment


def cases(count: int) -> settings:
    """``count`` generated cases, reproducible (derandomized), with no deadline: slow machines pass too."""
    return settings(
        max_examples=count,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much],
    )


LOCAL = config.read_profile("local")

#: Pieces QA's corpus combined: control characters, expansion syntaxes, traversal, YAML specials.
FRAGMENTS = [
    "\n", "\t", "\r", "\x00", "\x7f", " ", "$(JOBSET_NAME)", "${oc.env:HOME}", "$$", "../../other-project", "..", "/",
    ":", "@", "%", "'", '"', "[", "]", "{", "}", "*", "&a", "!!python/object:os.system", ".inf", "-.inf", ".nan",
    "1e308", "1e12", "null", "~", "2024-01-01", "0x10", "1_000", "true", "-1", "0", "2147483648", "9" * 30, "A", "a",
    "é", "\u202e", "gs://", "gs://goog-bucket", "/proc/self", "x" * 70, "-", "_", ".", "llama2", "silu",
]  # fmt: skip


def run_cli(*argv: str) -> tuple[int, str, str]:
    """``multislice ARGV`` in this process: (exit status, stdout, stderr). Any exception escaping is a failure."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(argv))
        except SystemExit as exit_:  # argparse's own usage errors
            code = exit_.code if isinstance(exit_.code, int) else 2
    return code, out.getvalue(), err.getvalue()


def assert_refused(code: int, err: str, *fields: str) -> None:
    """Exit 2 with ``error:``, one of ``fields`` named, a fix, and no traceback."""
    assert code == 2, err
    assert "Traceback" not in err
    assert err.startswith("error: "), err
    assert "fix:" in err or "invalid run spec" in err, err
    if fields:
        assert any(field in err for field in fields), (fields, err)


def assert_refused_or_accepted(code: int, err: str, out_dir: Path, *fields: str) -> None:
    assert "Traceback" not in err
    assert code in (0, 2), err
    if code == 2:
        assert_refused(code, err, *fields)
        assert not out_dir.exists(), f"{out_dir} was created for a refused input"
    else:
        assert any(out_dir.iterdir())


text_values = st.one_of(
    st.sampled_from(FRAGMENTS),
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=4).map("".join),
    st.text(max_size=40),
    st.from_regex(r"[a-z][-a-z0-9]{0,20}[a-z0-9]", fullmatch=True),
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=3).map(lambda p: "run-" + "".join(p)),
)
number_values = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 4, 2**31 - 1, 2**31, 2**63, 2**64, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([0.5, 0.25, 0.1, 1e308, 1e-308, 1e12, 3.0]),
)


def _cli_value(value: object) -> str:
    return value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value)


# ---------------------------------------------------------------- profile files


def _mutated_profile(data: dict, key: str, value: object) -> str:
    return yaml.safe_dump({**data, key: value}, sort_keys=False)


profile_texts = st.one_of(
    st.binary(max_size=300),
    st.text(max_size=300),
    st.lists(st.sampled_from(FRAGMENTS + ["run_name: x\n", "stages:\n", "  - ", "---\n", "\t"]), max_size=20).map(
        "".join
    ),
    st.tuples(st.sampled_from(sorted(LOCAL)), st.one_of(text_values, number_values)).map(
        lambda kv: _mutated_profile(LOCAL, *kv)
    ),
    st.tuples(st.integers(0, 2000), st.sampled_from(FRAGMENTS)).map(
        lambda cut: (lambda text: text[: cut[0]] + cut[1] + text[cut[0] :])(yaml.safe_dump(LOCAL, sort_keys=False))
    ),
)


@cases(280)
@given(content=profile_texts)
def test_any_profile_file_is_refused_or_rendered(tmp_path_factory, content):
    tmp = tmp_path_factory.mktemp("profile")
    path = tmp / "profile.yaml"
    path.write_bytes(content if isinstance(content, bytes) else content.encode("utf-8", "surrogatepass"))
    code, _, err = run_cli("render", "--profile", str(path), "--output", str(tmp / "out"))
    assert_refused_or_accepted(code, err, tmp / "out")


# ---------------------------------------------------------------- --set values

NAME_FIELDS = {
    "run_name": names.DNS1035_LABEL,
    "namespace": names.DNS1123_LABEL,
    "queue": names.DNS1123_SUBDOMAIN,
    "cluster_queue": names.DNS1123_SUBDOMAIN,
    "priority": names.DNS1123_SUBDOMAIN,
    "stages.0.name": names.DNS1035_LABEL,
}
OTHER_FIELDS = [
    "num_slices", "stage1_steps", "stage1_per_device_batch_size", "stages.0.max_target_length", "priority_value",
    "max_restarts", "output_dir", "trainer_image", "images.pipeline", "cluster.project", "cluster.location",
    "cluster.name", "stages.0.model.decoder_block", "stages.0.checkpoint_period", "notify_webhook_secret",
    "stages.0.maxtext_overrides.weight_dtype", "stages.0.maxtext_overrides.optimizer_memory_host_offload",
    "stages.0.maxtext_overrides.no_such_maxtext_key", "stages.0.model.mlp_activations", "tpu_type", "backend",
    "stages.1.export_hub_repo", "stages.1.export_dtype", "exporter.hub_token_secret",
    "exporter.hub_token_kubernetes_secret",
]  # fmt: skip


@cases(380)
@given(
    key=st.sampled_from(sorted(NAME_FIELDS) + OTHER_FIELDS),
    value=st.one_of(text_values, number_values),
)
def test_any_set_value_is_refused_or_valid(tmp_path_factory, key, value):
    tmp = tmp_path_factory.mktemp("set")
    raw = _cli_value(value)
    assume("\x00" not in raw)  # argv cannot hold NUL; profile files and parameters carry it instead
    code, _, err = run_cli("render", "--profile", "local", "--set", f"{key}={raw}", "--output", str(tmp / "out"))
    path = parameters.path_for(key)
    last = path.rsplit(".", 1)[-1]
    assert_refused_or_accepted(code, err, tmp / "out", key, path, last, "--set")
    if code == 0 and key in NAME_FIELDS:
        assert NAME_FIELDS[key].fullmatch(raw) and len(raw) <= 63, raw
    if code == 0 and isinstance(value, str):
        assert "$(" not in raw and "${" not in raw and not re.search(r"[\x00-\x1f\x7f]", raw), raw


# ---------------------------------------------------------------- pipeline parameters


def _parameter_values(kind: type) -> st.SearchStrategy:
    if kind is bool:
        return st.booleans()
    if kind is int:
        return st.one_of(st.integers(-(2**70), 2**70), st.sampled_from([1, 2, 2**31 - 1, 2**31, 2**63]))
    if kind is float:
        return st.one_of(st.floats(), st.sampled_from([0.5, 1.0, 2.0, 1e308, float("inf")]))
    return st.one_of(text_values, st.text(max_size=30))


PARAMETERS = [(p.name, p.type) for p in parameters.RUN_PARAMETERS] + [
    (parameters.stage_parameter_name(0, field), kind) for field, kind, _ in parameters.STAGE_FIELDS
]
parameter_sets = st.lists(
    st.sampled_from(PARAMETERS).flatmap(lambda p: st.tuples(st.just(p[0]), _parameter_values(p[1]))),
    min_size=1,
    max_size=3,
).map(dict)


@cases(200)
@given(given_parameters=parameter_sets)
def test_any_pipeline_parameters_are_refused_or_planned(given_parameters):
    from multislice.backends import manifests
    from multislice.plan import make_plan

    try:
        spec = config.load_spec(LOCAL, given_parameters)
        plan = make_plan(spec)
        manifests.render_all(plan, "manual")
    except UserError as error:
        assert error.exit_code == 2
        fields = [parameters.path_for(k).rsplit(".", 1)[-1] for k in given_parameters] + list(given_parameters)
        assert any(field in str(error) for field in fields) or "stages[" in str(error), str(error)
        return
    for key, value in given_parameters.items():
        if isinstance(value, str):
            assert "$(" not in value and "${" not in value and not re.search(r"[\x00-\x1f\x7f]", value), (key, value)
        if isinstance(value, int) and not isinstance(value, bool):
            assert abs(value) <= values.INT32_MAX, (key, value)


# ---------------------------------------------------------------- CLI paths

path_parts = st.sampled_from(["", "a", "out", "x.yaml", "x.yml", "x.json", "..", ".", "\n", " ", "file.txt"])


@cases(180)
@given(
    root=st.sampled_from(["TMP", "TMP/file.txt", "/proc", "/sys/kernel", "/dev", ""]),
    parts=st.lists(path_parts, max_size=3),
    command=st.sampled_from(["render", "compile", "verify-checkpoint"]),
)
def test_any_output_path_is_refused_or_used(tmp_path_factory, root, parts, command):
    tmp = tmp_path_factory.mktemp("paths")
    (tmp / "file.txt").write_text("not a directory\n")
    target = "/".join([root.replace("TMP", str(tmp)), *parts]) if root or parts else ""
    before = _tree(tmp)
    if command == "render":
        code, _, err = run_cli("render", "--profile", "local", "--set", "run_name=bad\n", "--output", target)
        assert_refused(code, err, "--output", "run_name")
    elif command == "compile":
        # An invalid spec as well, so that a usable path is refused for the spec, never compiled (fast).
        code, _, err = run_cli("compile", "--profile", "local", "--set", "num_slices=0", "--output", target)
        assert_refused(code, err, "--output", "num_slices")
    else:
        code, _, err = run_cli("verify-checkpoint", target, "--report", str(tmp / "file.txt" / "r.json"))
        assert_refused(code, err, "checkpoint", "--report")
    assert _tree(tmp) == before


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


# ---------------------------------------------------------------- regressions: malformed profile files

MALFORMED = {
    "tabs": b"run_name: x\n\tbackend: local\n",
    "unclosed quote": b"run_name: 'x\nbackend: local\n",
    "unclosed bracket": b"run_name: x\nstages: [\n",
    "multiple documents": b"run_name: x\n---\nrun_name: y\n",
    "unhashable key": b"? [a, b]\n: 1\n",
    "non-UTF-8": b"run_name: \xff\xfe\n",
    "NUL": b"run_name: x\x00\n",
    "python tag": b"run_name: !!python/object/apply:os.system ['true']\n",
    "not a mapping": b"- a\n- b\n",
    "empty": b"",
}


@pytest.mark.parametrize("name", sorted(MALFORMED))
def test_malformed_profile_is_refused_naming_the_file(tmp_path, name):
    path = tmp_path / "bad.yaml"
    path.write_bytes(MALFORMED[name])
    code, _, err = run_cli("render", "--profile", str(path), "--output", str(tmp_path / "out"))
    assert_refused(code, err, str(path))
    assert not (tmp_path / "out").exists()
    if name in ("tabs", "unclosed quote", "unclosed bracket"):
        assert re.search(r"line \d+", err), err


def test_a_huge_profile_is_refused_by_size_before_parsing(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"[" * (config.profiles.MAX_PROFILE_BYTES + 10))  # parsing this would recurse, not refuse
    code, _, err = run_cli("render", "--profile", str(path), "--output", str(tmp_path / "out"))
    assert_refused(code, err, str(path))
    assert f"is {config.profiles.MAX_PROFILE_BYTES + 10:,} bytes, over the {config.profiles.MAX_PROFILE_BYTES:,}" in err


def _laughs(levels: int, width: int = 9) -> str:
    """A "billion laughs" flow list: anchor ``a0`` holds ``width`` scalars, each ``aN`` ``width`` aliases of
    ``a(N-1)``; it stands for about ``width ** levels`` values in a few hundred bytes."""
    parts = [f"&a0 [{', '.join(['lol'] * width)}]"]
    parts += [f"&a{n} [{', '.join([f'*a{n - 1}'] * width)}]" for n in range(1, levels)]
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize(
    "command", [["render", "--output", "out"], ["compile", "--output", "out.yaml"], ["plan"], ["run"]]
)
def test_a_profile_of_nested_aliases_is_refused_before_they_expand(tmp_path, command):
    """QA's 4.6 KB profile (``maxtext_overrides`` holding a nest of aliases, 9**11 values) hung every command,
    memory growing, while the overrides copied each alias apart; it is refused from the composed nodes."""
    path = tmp_path / "laughs.yaml"
    profile = LOCAL | {"x-laughs": "LAUGHS"}
    path.write_text(yaml.safe_dump(profile).replace("LAUGHS", _laughs(11)), encoding="utf-8")
    assert path.stat().st_size < 8192
    output = [command[1], str(tmp_path / command[2])] if len(command) > 1 else []
    code, _, err = run_cli(command[0], "--profile", str(path), *output)
    assert_refused(code, err, str(path))
    assert "over 100,000 values once its aliases (*name) are expanded" in err and "write the values out" in err
    assert _tree(tmp_path) == ["laughs.yaml"]


def test_an_alias_inside_its_own_anchor_is_refused(tmp_path):
    path = tmp_path / "cycle.yaml"
    path.write_text(yaml.safe_dump(LOCAL) + "x-cycle: &c [1, *c]\n", encoding="utf-8")
    code, _, err = run_cli("render", "--profile", str(path), "--output", str(tmp_path / "out"))
    assert_refused(code, err, str(path))
    assert "stands inside its own anchor" in err


def test_a_set_value_of_nested_aliases_is_refused_naming_its_key(tmp_path):
    key = "stages.0.maxtext_overrides.constant_bound_config"
    code, _, err = run_cli("render", "--profile", "local", "--set", f"{key}={_laughs(11)}", "--output", str(tmp_path))
    assert_refused(code, err, key)
    assert "once its aliases (*name) are expanded" in err
    code, _, err = run_cli("render", "--profile", "local", "--set", f"{key}=[&c [1, *c]]", "--output", str(tmp_path))
    assert_refused(code, err, key)


def test_small_aliases_are_still_read_and_counted_as_expanded():
    """An alias stands for its anchor's values again (``configs/local.yaml`` aliases one ``maxtext_overrides`` for
    both stages); the count on the composed nodes equals a walk of the loaded, expanded data."""

    def walked(value: object) -> int:
        return 1 + sum(walked(item) for item in value) if isinstance(value, list) else 1

    assert yaml_input.load("[&a x, *a]") == ["x", "x"]
    text = _laughs(4)
    assert yaml_input.expanded_values(yaml.compose(text, Loader=yaml.SafeLoader)) == walked(yaml.safe_load(text))
    assert LOCAL["stages"][0]["maxtext_overrides"] == LOCAL["stages"][1]["maxtext_overrides"]


# ---------------------------------------------------------------- regressions: values QA found accepted

REFUSED_SETS = {
    "namespace=default\n": "namespace",
    "queue=multislice-queue\n": "queue",
    "cluster_queue=q\n": "cluster_queue",
    "priority=p\n": "priority",
    "stages.0.name=tiny\n": "name",
    "run_name=demo\n": "run_name",
    "run_name=null": "run_name",
    "num_slices=2147483648": "num_slices",
    "stage1_steps=9223372036854775808": "steps",
    "stage1_per_device_batch_size=.inf": "per_device_batch_size",
    "stage1_per_device_batch_size=1e308": "per_device_batch_size",
    "stage1_per_device_batch_size=0.3": "per_device_batch_size",  # x 8 chips = 2.4 sequences
    "stages.0.max_target_length=1e12": "max_target_length",
    "stages.0.max_target_length=1000000000000": "max_target_length",
    "stages.0.model.decoder_block=llama9": "decoder_block",
    "stages.0.model.mlp_activations=[silu, lineer]": "mlp_activations",
    "stages.0.maxtext_overrides.optimizer_memroy_host_offload=true": "optimizer_memroy_host_offload",
    "stages.0.maxtext_overrides.weight_dtype=bf16": "weight_dtype",
    "priority_value=2147483648": "priority_value",
    "output_dir=$(JOBSET_NAME)": "output_dir",
    "output_dir=${oc.env:HOME}/x": "output_dir",
    "stages.0.maxtext_overrides.profiler=$(HOME)": "profiler",
    "trainer_image=UPPER/Case:1": "trainer",
    "trainer_image=img:tag with space": "trainer",
    "output_dir=gs://Bad_Bucket!/x": "output_dir",
    "output_dir=gs://bucket/../other": "output_dir",
    "output_dir=gs://googbucket/x": "output_dir",
    "output_dir=/proc/self/x": "output_dir",
    "cluster.project=../../other-project": "project",
    "cluster.name=Cluster_1": "name",
    "cluster.location=us-east5/../x": "location",
    "notify_webhook_secret=projects/p/secrets/s/versions/1\nb": "notify_webhook_secret",
    "timeouts.collectives=1e308": "collectives",
    "timeouts.train=31536001": "train",
    "node_pools.operation_timeout_seconds=.inf": "operation_timeout_seconds",
    "stages.0.data={kind: synthetic}": "stages.0.data.kind=synthetic",
    # issue 43: accepted though they could not work
    "exporter.node_selector.bad key!=x": "exporter.node_selector",
    "exporter.node_selector./gke-nodepool=x": "exporter.node_selector",
    "preflight.node_selector.a/b/c=x": "preflight.node_selector",
    "ray.head_node_selector.Bad_Prefix/pool=x": "ray.head_node_selector",
    "cluster.kubeconfig_context=--help": "kubeconfig_context",
    "cluster.kubeconfig_context=gke_p_l_c\u200b": "kubeconfig_context",
    "timeouts.verify=1e-300": "timeouts.verify",
    "timeouts.launch=0.5": "timeouts.launch",
    "node_pools.operation_timeout_seconds=1e-300": "operation_timeout_seconds",
    "output_dir=runs\u202e": "output_dir",
}


@pytest.mark.parametrize("pair", sorted(REFUSED_SETS))
def test_invalid_value_is_refused_naming_its_field(tmp_path, pair):
    code, _, err = run_cli("render", "--profile", "local", "--set", pair, "--output", str(tmp_path / "out"))
    assert_refused(code, err, REFUSED_SETS[pair])
    assert not (tmp_path / "out").exists()


def test_unknown_maxtext_key_suggests_the_close_one(tmp_path):
    pair = "stages.0.maxtext_overrides.optimizer_memroy_host_offload=true"
    code, _, err = run_cli("render", "--profile", "local", "--set", pair, "--output", str(tmp_path / "out"))
    assert_refused(code, err, "did you mean optimizer_memory_host_offload")


def test_output_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "f").write_text("x")
    code, _, err = run_cli("render", "--profile", "local", "--set", f"output_dir={tmp_path / 'f'}", "--output", "o")
    assert_refused(code, err, "output_dir")


def test_output_dir_that_reads_as_a_date_is_a_string(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = config.load_profile("local", config.parse_set_arguments(["output_dir=2024-01-01", "num_slices=2"]))
    assert spec.output_dir == "2024-01-01" and spec.num_slices == 2
    code, _, err = run_cli("render", "--profile", "local", "--set", "output_dir=2024-01-01", "--output", "out")
    assert code == 0, err


def test_valid_values_are_still_accepted(tmp_path):
    code, _, err = run_cli(
        "render", "--profile", "local", "--output", str(tmp_path / "out"),
        "--set", "stages.0.maxtext_overrides.weight_dtype=bfloat16", "--set", "stage1_per_device_batch_size=0.25",
        "--set", "trainer_image=us-docker.pkg.dev/my-project/images/maxtext:0.2.5@sha256:" + "a" * 64,
        "--set", "stages.0.model.mlp_activations=[gelu, linear]",
    )  # fmt: skip
    assert code == 0, err


# ---------------------------------------------------------------- regressions: CLI paths


def test_render_into_a_file_or_proc_or_nowhere_is_refused(tmp_path):
    (tmp_path / "file").write_text("x")
    for output in (str(tmp_path / "file"), str(tmp_path / "file" / "sub"), "/proc/self/out", "", " "):
        code, _, err = run_cli("render", "--profile", "local", "--output", output)
        assert_refused(code, err, "--output")
    assert _tree(tmp_path) == ["file"]


def test_compile_output_must_be_a_yaml_file(tmp_path):
    for output in (str(tmp_path / "pipeline.json"), str(tmp_path), str(tmp_path / "p")):
        code, _, err = run_cli("compile", "--profile", "local", "--output", output)
        assert_refused(code, err, "--output")
    assert _tree(tmp_path) == []


def test_compile_refuses_bad_node_selectors_and_images(tmp_path):
    out = str(tmp_path / "p.yaml")
    for extra in (["--node-selector", "bad key=x"], ["--node-selector", "pool=a\nb"], ["--base-image", "Bad Image"]):
        code, _, err = run_cli("compile", "--profile", "local", "--output", out, *extra)
        assert_refused(code, err, "--node-selector", "--base-image")
    assert _tree(tmp_path) == []


def test_invalid_pipeline_run_id_is_refused_and_nothing_is_written(tmp_path):
    for run_id in ("a b", "", "$(id)"):
        code, _, err = run_cli(
            "render", "--profile", "local", "--pipeline-run-id", run_id, "--output", str(tmp_path / "o")
        )
        assert_refused(code, err, "--pipeline-run-id")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("run_id", ["$(id)", "", "a b", "x-", "x" * 64, "ab\n", "../other"])
def test_cleanup_refuses_a_pipeline_run_id_that_no_workload_could_carry(tmp_path, run_id):
    """QA's ``cleanup --pipeline-run-id '$(id)'`` of a real run said "nothing left" (exit 0): no label value is
    ``$(id)``, so it matched nothing; ``''`` matched every run. Refused before the run is looked at."""
    (tmp_path / "demo").mkdir()
    code, out, err = run_cli("cleanup", "--run", "demo", "--output-dir", str(tmp_path), "--pipeline-run-id", run_id)
    assert_refused(code, err, "--pipeline-run-id")
    assert "label value" in err and "nothing left" not in out
    assert _tree(tmp_path) == ["demo"]
    assert values.pipeline_run_id_problem("run-1234.ab_C") is None and values.pipeline_run_id_problem("x" * 63) is None


def test_verify_checkpoint_refuses_hostile_paths(tmp_path):
    for path in ("a\nb", "gs://Bad!/x", "gs://bucket/../x", str(tmp_path / "none")):
        code, _, err = run_cli("verify-checkpoint", path)
        assert_refused(code, err, "checkpoint")


# ---------------------------------------------------------------- regressions: accepted though they could not work


@pytest.mark.parametrize("kind", ["dangling", "loop", "under a loop"])
def test_an_output_dir_through_a_link_that_leads_nowhere_is_refused(tmp_path, kind):
    """The directory could never be created through a dangling link or a loop of links: refused when the spec is
    loaded (CLI and Python API), naming output_dir, nothing written."""
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere" / "x")
    (tmp_path / "loop-a").symlink_to(tmp_path / "loop-b")
    (tmp_path / "loop-b").symlink_to(tmp_path / "loop-a")
    target = {"dangling": "dangling", "loop": "loop-a", "under a loop": "loop-a/runs"}[kind]
    overrides = {"output_dir": str(tmp_path / target)}
    code, _, err = run_cli("render", "--profile", "local", "--set", f"output_dir={tmp_path / target}", "--output",
                           str(tmp_path / "out"))  # fmt: skip
    assert_refused(code, err, "output_dir")
    assert "is a symbolic link that leads nowhere" in err
    with pytest.raises(config.ConfigError, match="leads nowhere"):
        config.load_profile("local", overrides)
    assert _tree(tmp_path) == ["dangling", "loop-a", "loop-b"]


@pytest.mark.parametrize(
    ("path", "words"),
    [("allenai/c4\u202e", "U+202E (RIGHT-TO-LEFT OVERRIDE)"), ("allenai/c4/en", "more than one '/'"),
     ("-c4", "not starting or ending with '-' or '.'")],
)  # fmt: skip
def test_an_hf_stage_needs_a_hub_name_without_invisible_characters(tmp_path, path, words):
    """An ``hf`` stage's dataset, when not a local directory, is a Hub repository id (huggingface_hub's rules):
    refused when the profile is read, naming data.hf.path, nothing written."""
    profile = copy.deepcopy(LOCAL)
    for stage in profile["stages"]:
        stage.update(data={"kind": "hf", "path": path}, eval_interval=-1)
    (tmp_path / "hf.yaml").write_text(yaml.safe_dump(profile, allow_unicode=True), encoding="utf-8")
    code, _, err = run_cli("render", "--profile", str(tmp_path / "hf.yaml"), "--output", str(tmp_path / "out"))
    assert_refused(code, err, "data.hf.path")
    assert words in err, err
    assert _tree(tmp_path) == ["hf.yaml"]


def test_calls_refuse_an_empty_or_bucketless_output_dir_instead_of_the_default(tmp_path, monkeypatch):
    """``calls list --output-dir ''`` used to list the local profile's output_dir silently."""
    from multislice import remote_call

    monkeypatch.chdir(tmp_path)
    for argv in (["list", "--output-dir", ""], ["list", "--output-dir", "gs://"], ["logs", "c0ffee00", "--output-dir",
                                                                                   " "]):  # fmt: skip
        code, out, err = run_cli("calls", *argv)
        assert_refused(code, err, "--output-dir")
        assert "no remote calls" not in out
    with pytest.raises(UserError, match="is empty"):
        remote_call.list_calls("")
    with pytest.raises(UserError, match="is empty"):
        remote_call.attach("c0ffee00", output_dir="")
    assert _tree(tmp_path) == []


def test_compile_refuses_an_empty_base_image_instead_of_the_default(tmp_path):
    from pipelines.multislice_training import compile_pipeline

    code, _, err = run_cli("compile", "--profile", "local", "--output", str(tmp_path / "p.yaml"), "--base-image", "")
    assert_refused(code, err, "--base-image")
    assert "'' is not a container image reference" in err
    with pytest.raises(config.ConfigError) as refused:
        compile_pipeline(LOCAL, str(tmp_path / "p.yaml"), base_image="")
    assert refused.value.issues[0][0] == "base_image"
    assert _tree(tmp_path) == []


@pytest.mark.parametrize("command", [["cleanup"], ["inject", "preempt-slice", "--stage", "tiny-8b-recipe"]])
def test_run_commands_refuse_an_overlong_run_or_an_output_dir_without_a_bucket(tmp_path, command):
    """A 200-character ``--run`` is no run name (a label value: at most 63); ``--output-dir gs://`` has no bucket and
    was joined as the local path ``gs:/demo``. Both refused before the run is looked for."""
    from multislice import storage

    (tmp_path / "demo").mkdir()
    code, _, err = run_cli(*command, "--run", "r" * 200, "--output-dir", str(tmp_path))
    assert_refused(code, err, "--run")
    assert "is 200 characters; a run name is at most 63" in err
    for output_dir in ("gs://", "", "gs://Bad_Bucket!"):
        code, out, err = run_cli(*command, "--run", "demo", "--output-dir", output_dir)
        assert_refused(code, err, "--output-dir")
        assert "gs:/demo" not in err + out
    assert _tree(tmp_path) == ["demo"]
    assert storage.join("gs://", "demo") == "gs:///demo" and storage.join("gs://b/", "demo") == "gs://b/demo"


def test_a_site_packages_corpus_is_refused_on_gke_before_anything(tmp_path):
    """The local profile's corpus lives in this machine's trainer environment (``site-packages:``), which no GKE pod
    has: refused when the spec is loaded with backend gke, naming the source and the fix."""
    code, _, err = run_cli("render", "--profile", "local", "--set", "backend=gke", "--set",
                           "output_dir=gs://team-bucket/runs", "--output", str(tmp_path / "out"))  # fmt: skip
    assert_refused(code, err, "data.files[0]")
    assert "'site-packages:*.dist-info/METADATA' points into the local trainer environment's Python install" in err
    assert "copy the corpus to a gs:// bucket" in err
    assert _tree(tmp_path) == []


# ---------------------------------------------------------------- regressions: schedule and plan


def test_a_schedule_checks_the_run_name_with_each_run_suffix():
    from multislice.delivery import schedule
    from tests import deployment

    gke = config.apply_overrides(config.read_profile("gke-v6e-16x2-seed"), deployment.VALUES)
    longest = names.max_jobset_name_length(2, 4) - max(len(s["name"]) for s in gke["stages"]) - 1
    fits_alone = "r" * (longest - 3)  # fits without the suffix, not with "-" + 8 characters
    config.load_spec(gke, {"run_name": fits_alone})
    with pytest.raises(config.ConfigError) as refused:
        schedule.schedule_parameters(gke, {"run_name": fits_alone}, "vertex", continue_run=False)
    assert "each scheduled run too) appends '-' and 8 characters" in str(refused.value)
    schedule.schedule_parameters(gke, {"run_name": fits_alone}, "vertex", continue_run=True)


def test_plan_validates_manifests_against_their_crds_before_preflight(tmp_path, monkeypatch):
    from multislice.render import jobset, schema
    from multislice.steps import plan as plan_step

    render = jobset.render_jobset

    def broken(*args, **kwargs):
        obj = render(*args, **kwargs)
        obj["spec"]["replicatedJobs"][0]["replicas"] = "many"
        return obj

    monkeypatch.setattr(jobset, "render_jobset", broken)
    with pytest.raises(schema.ManifestInvalid) as refused:
        plan_step.run(LOCAL, {"output_dir": str(tmp_path)})
    assert "replicas" in str(refused.value)
    assert not any(tmp_path.iterdir())  # not even the plan report


def test_maxtext_schema_file_names_its_source():
    from multislice import maxtext

    schema = maxtext.config_schema()
    assert schema["maxtext_version"] == maxtext.MAXTEXT_VERSION
    assert "optimizer_memory_host_offload" in schema["fields"] and "llama2" in maxtext.decoder_blocks()
    assert {"silu", "linear", "gelu"} <= set(maxtext.activations())
    assert os.path.getsize(maxtext.CONFIG_SCHEMA_FILE) < 1_000_000


# ---------------------------------------------------------------- plan and preflight options


class Reached(Exception):
    """Validation passed: the command went on to compile (plan, preflight) or to compile the pipeline (submit,
    schedule). Raised where that work starts, so an accepted input costs nothing."""


def _reach(*args, **kwargs):
    raise Reached()


def _cli_refused_or_reached(argv: list[str], cwd: Path) -> str | None:
    """Run the CLI: None when refused cleanly (exit 2, no traceback, nothing written in ``cwd``), the
    argv's values when it reached the work (then the caller checks they were valid)."""
    before = _tree(cwd)
    try:
        code, _, err = run_cli(*argv)
    except Reached:
        return "reached"
    assert code == 2, (argv, err)
    assert "Traceback" not in err
    assert err.startswith(("error: ", "usage: ")), err  # ours, or argparse's own for a non-number
    assert _tree(cwd) == before, argv
    return None


option_values = st.one_of(text_values, number_values.map(_cli_value), st.sampled_from(["0", "-1", "3", "16", "1e9"]))
PLAN_OPTIONS = ["--num-slices", "--max-slices", "--seq", "--global-batch", "--want", "--budget", "--fix", "--model",
                "--tpu-type", "--cache-dir", "--work-dir", "--report", "--stage"]  # fmt: skip
PREFLIGHT_OPTIONS = ["--cache-dir", "--report", "--stage"]


def _accepted_value_is_valid(option: str, value: str) -> None:
    """What an accepted plan or preflight option must be."""
    from multislice import tpu
    from multislice.config.values import FORBIDDEN_LOCAL_ROOTS, MAX_TIMEOUT_SECONDS

    if option in ("--num-slices", "--max-slices", "--global-batch"):
        assert 1 <= int(value) <= values.INT32_MAX, (option, value)
    elif option == "--seq":
        assert 1 <= int(value) <= 2**20, value
    elif option == "--want":
        assert 1 <= int(value) <= 1024, value
    elif option == "--budget":
        assert values.MIN_TIMEOUT_SECONDS <= float(value) <= MAX_TIMEOUT_SECONDS, value
    elif option == "--fix":
        assert value.partition("=")[0] in ("per_device_batch_size", "remat_policy", "optimizer_offload",
                                            "parameter_offload", "weight_dtype"), value  # fmt: skip
    elif option == "--model":
        config.ModelSpec(name=value)
    elif option == "--tpu-type":
        tpu.parse_tpu_type(value)
    elif option in ("--cache-dir", "--work-dir", "--report"):
        assert not re.search(r"[\x00-\x1f\x7f]", value) and value.strip(), value
        assert not any(os.path.abspath(value).startswith(root) for root in FORBIDDEN_LOCAL_ROOTS), value


@cases(150)
@given(
    command=st.sampled_from(["plan", "preflight"]),
    chosen=st.lists(st.tuples(st.sampled_from(PLAN_OPTIONS), option_values), min_size=1, max_size=3),
)
def test_any_plan_or_preflight_option_is_refused_or_valid(tmp_path_factory, monkeypatch, command, chosen):
    from multislice.backends.local import aot
    from multislice.steps import preflight

    monkeypatch.setattr(aot, "AotSession", _reach)
    monkeypatch.setattr(preflight, "run", _reach)
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    given_options = [(o, v) for o, v in chosen if command == "plan" or o in PREFLIGHT_OPTIONS]
    assume(given_options and not any("\x00" in v for _, v in given_options))
    argv = [command, "--profile", "local", *(x for pair in given_options for x in pair)]
    if _cli_refused_or_reached(argv, cwd):
        for option, value in given_options:
            _accepted_value_is_valid(option, value)


# ---------------------------------------------------------------- submit and schedule options

DELIVERY_OPTIONS = ["--name", "--max-concurrent-runs", "--max-runs", "--interval", "--cron", "--timezone",
                    "--start-time", "--end-time", "--kfp-namespace", "--service-account", "--host", "--experiment",
                    "--project", "--location", "--network", "--label", "--pipeline-root", "--continue"]  # fmt: skip
SCHEDULE_ONLY = {"--name", "--max-concurrent-runs", "--max-runs", "--interval", "--cron", "--timezone", "--start-time",
                 "--end-time"}  # fmt: skip
delivery_values = st.one_of(
    option_values,
    st.sampled_from(
        [
            "0 3 31 2 *",
            "0 3 * * *",
            "*/5 * * * *",
            "0 3 29 2 *",
            "Europe/Paris",
            "2026-12-01T03:00:00Z",
            "runner@team-project.iam.gserviceaccount.com",
            "pipeline-runner",
            "http://localhost:8888",
            "https://kfp.example",
            "file:///etc/passwd",
            "us-east5",
            "mars-1",
            "team-project",
            "kubeflow-user",
            "Bad NS",
            "$(id)",
            "projects/1/global/networks/n",
            "gs://bucket/root",
            "team=ml",
            "10",
            "11",
            "1000",
            "1001",
        ]
    ),  # fmt: skip
)


def _accepted_delivery_value(option: str, value: str, target: str) -> None:
    """What an accepted submit or schedule option must be (the rules of multislice.delivery.checks)."""
    from multislice.delivery import checks

    assert not re.search(r"[\x00-\x1f\x7f]", value), (option, value)
    rules = {
        "--max-concurrent-runs": lambda v: 1 <= int(v) <= (10 if target == "kfp" else 1000),
        "--kfp-namespace": lambda v: checks.kfp_namespace_problem(v) is None,
        "--host": lambda v: v.startswith(("http://", "https://")),
        "--project": lambda v: values.GCP_PROJECT.fullmatch(v),
        "--location": lambda v: v in checks.vertex_locations(),
        "--network": lambda v: checks.network_problem(v) is None,
        "--name": lambda v: 0 < len(v) <= 128,
        "--service-account": lambda v: (
            (checks.kubernetes_service_account_problem if target == "kfp" else checks.gcp_service_account_problem)(v)
            is None
        ),  # fmt: skip
    }
    if option in rules:
        assert rules[option](value), (option, value, target)


@cases(150)
@given(
    command=st.sampled_from(["submit", "schedule"]),
    target=st.sampled_from(["kfp", "vertex"]),
    chosen=st.lists(st.tuples(st.sampled_from(DELIVERY_OPTIONS), delivery_values), min_size=1, max_size=3),
)
def test_any_submit_or_schedule_option_is_refused_before_anything_is_sent(
    tmp_path_factory, monkeypatch, command, target, chosen
):
    from multislice.delivery import submission

    monkeypatch.setattr(submission, "compile_for", _reach)
    monkeypatch.setattr(submission, "connect", _reach)  # credentials and the endpoint, reached before the compile
    monkeypatch.setattr(submission.KfpTarget, "make_client", _reach)
    monkeypatch.delenv("KF_PIPELINES_ENDPOINT", raising=False)
    cwd = tmp_path_factory.mktemp("cwd")
    monkeypatch.chdir(cwd)
    given_options = [(o, v) for o, v in dict(chosen).items() if command == "schedule" or o not in SCHEDULE_ONLY]
    assume(given_options and not any("\x00" in v for _, v in given_options))
    if command == "schedule" and "--continue" in dict(given_options):
        given_options = [(o, v) for o, v in given_options if o != "--continue"] or [("--name", "n")]
    defaults = {"kfp": {"--host": "http://127.0.0.1:9"}, "vertex": {"--project": "team-project",
                                                                     "--location": "us-east5"}}[target]  # fmt: skip
    flags = {**defaults, **({"--cron": "0 3 * * *"} if command == "schedule" else {}), **dict(given_options)}
    head = ["schedule", "create"] if command == "schedule" else ["submit"]
    # The seed profile with a deployment's values: the packaged one's placeholders are refused (tests/deployment.py).
    argv = [*head, "--profile", deployment.profile_file("gke-v6e-16x2-seed"), "--target", target,
            *(x for pair in flags.items() for x in pair)]  # fmt: skip
    if _cli_refused_or_reached(argv, cwd):
        for option, value in given_options:
            _accepted_delivery_value(option, value, target)


# ---------------------------------------------------------------- multislice.remote arguments


def _shard(rows, keep=None):
    return rows, keep


remote_values = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**40), 2**40), st.floats(), st.text(max_size=12),
    st.sampled_from(["local", "gke", "aws", "v5litepod-8", "v6e-17", "2", "/proc/x", "c0ffee00", "A B", [], ["x"]]),
)  # fmt: skip
REMOTE_NAMES = sorted(
    [
        "tpu_type",
        "num_slices",
        "backend",
        "output_dir",
        "profile",
        "call_id",
        "collective_timeout",
        "tell",
        "out",
        "by_value",
        "keep",
        "wait",
        "rows",
        "not_an_option",
    ]  # fmt: skip
)


@cases(200)
@given(options=st.dictionaries(st.sampled_from(REMOTE_NAMES), remote_values, max_size=3))
@example(options={"backend": []})  # found by this test: an unhashable backend raised TypeError, not ConfigError
def test_any_remote_arguments_are_refused_naming_one_or_planned(monkeypatch, options):
    import threading

    from multislice import remote_call
    from multislice.errors import ConfigError

    monkeypatch.setattr(remote_call, "plan_call", _reach)
    as_decorator = "rows" in options  # one path per example: the decorator, else run_remote
    try:
        if as_decorator:
            rows = options.pop("rows")
            remote_call.remote(_shard, **options)(rows, keep=threading.Lock() if rows == [] else None)
        else:
            remote_call.run_remote(_shard, [1], **options)
    except ConfigError as refused:
        named = [field for field, _ in refused.issues]
        assert set(named) <= {*options, "function", "args[0]", "kwargs['keep']"}, (named, options)
        assert named, refused
        return
    except Reached:
        pass
    assert set(options) <= set(remote_call.OPTIONS), options
    kinds = {"num_slices": int, "keep": bool, "wait": bool, "tpu_type": str, "backend": str,
             "collective_timeout": (int, float)}  # fmt: skip
    for name, kind in kinds.items():
        if name in options:
            assert isinstance(options[name], kind) and (kind is bool or not isinstance(options[name], bool))
    assert options.get("num_slices", 1) >= 1 and options.get("backend", "local") in ("local", "gke")
    assert values.MIN_TIMEOUT_SECONDS <= options.get("collective_timeout", 1) <= values.MAX_TIMEOUT_SECONDS
    assert options.get("tell") is None and options.get("out") is None  # no generated value is callable/writable
    assert options.get("call_id") is None or re.fullmatch(r"[a-z0-9]{1,8}", options["call_id"])
    assert options.get("output_dir") is None or isinstance(options["output_dir"], str)
