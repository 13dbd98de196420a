"""Every value checked before it is sent (issue 31, items 3-5): regressions for each input QA found.

Delivery (``multislice submit``, ``multislice schedule``): each bad value exits 2 naming the option and
the fix, with no client built (``kfp.Client``, aiplatform's ``PipelineJob`` / ``PipelineJobSchedule``,
recorded here) and no request reaching the loopback KFP fake. ``plan`` and ``preflight``: exit 2
naming the option, nothing written (the working directory stays empty) and nothing compiled.
``multislice.remote``: the call's options apart from the function's arguments, each misuse a
``ConfigError`` naming the argument before anything is created.
"""

from __future__ import annotations

import http.server
import threading
import warnings

import cloudpickle
import pytest

from multislice import config, remote_call
from multislice.errors import ConfigError
from tests import deployment
from tests.cli.test_hostile_input import _tree, assert_refused, run_cli
from tests.fakes import FakeServer

warnings.filterwarnings("ignore", category=FutureWarning)
#: The packaged seed profile with a deployment's values in place of its placeholders (tests/deployment.py).
PROFILE = deployment.profile_file("gke-v6e-16x2-seed")
OUTPUT = "output_dir=gs://team-bucket/runs"


class ClientBuilt(Exception):
    """A client was built: the refusal came too late."""


@pytest.fixture
def clients(monkeypatch):
    """Record (and stop) any KFP or Vertex AI client built: ``kfp.Client``, ``PipelineJob``, ``PipelineJobSchedule``."""
    import kfp
    from google.cloud import aiplatform

    built: list[str] = []

    def recorder(name):
        def build(*args, **kwargs):
            built.append(name)
            raise ClientBuilt(name)

        return build

    monkeypatch.setattr(kfp, "Client", recorder("kfp.Client"))
    monkeypatch.setattr(aiplatform, "PipelineJob", recorder("aiplatform.PipelineJob"))
    monkeypatch.setattr(aiplatform, "PipelineJobSchedule", recorder("aiplatform.PipelineJobSchedule"))
    return built


@pytest.fixture
def fake():
    with FakeServer() as server:
        yield server


def _kfp(fake):
    return ["--target", "kfp", "--host", fake.url]


VERTEX = ["--target", "vertex", "--project", "team-project", "--location", "us-east5"]
SCHEDULE = ["schedule", "create", "--profile", PROFILE, "--set", OUTPUT]
SUBMIT = ["submit", "--profile", PROFILE, "--set", OUTPUT]

#: (name, argv after the target flags, target, the option the refusal names, words of its message)
DELIVERY_CASES = [
    ("never fires", [*SCHEDULE, "--cron", "0 3 31 2 *"], "kfp", "cron", "never fires"),
    ("never fires vertex", [*SCHEDULE, "--cron", "0 3 30 2 *"], "vertex", "cron", "never fires"),
    ("31 in a 30-day month", [*SCHEDULE, "--cron", "0 3 31 4,6,9,11 *"], "kfp", "cron", "never fires"),
    ("name with a newline", [*SCHEDULE, "--cron", "0 3 * * *", "--name", "bad name\n"], "kfp", "name", "control"),
    # issue 43: split() used to drop these silently and send the rest; nothing is stripped now
    ("cron with a trailing newline", [*SCHEDULE, "--cron", "0 3 * * *\n"], "kfp", "cron", "U+000A"),
    ("cron with a tab", [*SCHEDULE, "--cron", "0\t3 * * *"], "vertex", "cron", "U+0009"),
    ("cron with a right-to-left override", [*SCHEDULE, "--cron", "0 3 * * *\u202e"], "kfp", "cron", "U+202E"),
    ("name too long", [*SCHEDULE, "--cron", "0 3 * * *", "--name", "n" * 129], "vertex", "name", "at most 128"),
    ("KFP concurrency", [*SCHEDULE, "--cron", "0 3 * * *", "--max-concurrent-runs", "1000000"], "kfp",
     "--max-concurrent-runs", "1 to 10"),
    ("Vertex concurrency", [*SCHEDULE, "--cron", "0 3 * * *", "--max-concurrent-runs", "1000000"], "vertex",
     "--max-concurrent-runs", "1 to 1,000"),
    ("max runs", [*SCHEDULE, "--cron", "0 3 * * *", "--max-runs", str(2**63)], "vertex", "--max-runs", "1 to"),
    ("interval", [*SCHEDULE, "--interval", str(2**63)], "kfp", "--interval", "1 to"),
    ("KFP namespace", [*SUBMIT, "--kfp-namespace", "Bad NS"], "kfp", "--kfp-namespace", "DNS-1123"),
    ("KFP service account", [*SUBMIT, "--service-account", "$(id)"], "kfp", "--service-account", "ServiceAccount"),
    ("GCP service account", [*SUBMIT, "--service-account", "$(id)"], "vertex", "--service-account",
     "service account email"),
    ("GCP service account name only", [*SCHEDULE, "--cron", "0 3 * * *", "--service-account", "runner"], "vertex",
     "--service-account", "service account email"),
    ("file host", [*SUBMIT, "--host", "file:///etc/passwd"], "kfp", "--host", "only http:// and https://"),
    ("no host name", [*SUBMIT, "--host", "http://:8888"], "kfp", "--host", "no host name"),
    ("location", [*SUBMIT, "--location", "mars-1"], "vertex", "--location", "not a Vertex AI region"),
    ("project", [*SUBMIT, "--project", "Bad Project"], "vertex", "--project", "project ID"),
    ("project in a schedule", [*SCHEDULE, "--cron", "0 3 * * *", "--project", "p"], "vertex", "--project",
     "project ID"),
    ("network", [*SUBMIT, "--network", "default"], "vertex", "--network", "global/networks"),
    ("schedule id", ["schedule", "pause", "../../x"], "kfp", "SCHEDULE_ID", "not a recurring run ID"),
]  # fmt: skip


@pytest.mark.parametrize("case", DELIVERY_CASES, ids=[c[0] for c in DELIVERY_CASES])
def test_delivery_values_are_refused_before_any_client(case, fake, clients):
    _, argv, target, field, words = case
    target_flags = _kfp(fake) if target == "kfp" else list(VERTEX)
    given = {a for a in argv if a.startswith("--")}
    # A flag given by the case replaces the target's own (e.g. --host, --project, --location).
    for flag in ("--host", "--project", "--location"):
        if flag in given and flag in target_flags:
            i = target_flags.index(flag)
            del target_flags[i : i + 2]
    code, _, err = run_cli(*argv, *target_flags)
    assert_refused(code, err, field)
    assert words in err, err
    assert clients == [] and fake.state.requests == []


def test_kf_pipelines_endpoint_is_checked_as_the_host(monkeypatch, clients):
    monkeypatch.setenv("KF_PIPELINES_ENDPOINT", "ftp://pipelines.example")
    code, _, err = run_cli(*SUBMIT, "--target", "kfp")
    assert_refused(code, err, "$KF_PIPELINES_ENDPOINT")
    assert clients == []


def test_valid_delivery_values_still_reach_the_services(fake):
    """The checks do not refuse what the services take: a full KFP submission and schedule go through."""
    code, _, err = run_cli(*SUBMIT, *_kfp(fake), "--kfp-namespace", "kubeflow-user-example-com",
                           "--service-account", "default-editor")  # fmt: skip
    assert code == 0, err
    code, _, err = run_cli(*SCHEDULE, *_kfp(fake), "--cron", "0 3 29 2 *", "--max-concurrent-runs", "10",
                           "--name", "Nightly (leap days) ✓")  # fmt: skip
    assert code == 0, err
    [recurring] = fake.state.sent("POST", "/recurringruns")
    assert recurring.body["max_concurrency"] == 10 and recurring.body["display_name"] == "Nightly (leap days) ✓"


def test_service_account_and_location_rules():
    from multislice.delivery import checks

    ok = ["runner@team-project.iam.gserviceaccount.com", "123456789012-compute@developer.gserviceaccount.com",
          "team-project@appspot.gserviceaccount.com", "runner@my-proj.example.com.iam.gserviceaccount.com"]  # fmt: skip
    assert [checks.gcp_service_account_problem(v) for v in ok] == [None] * len(ok)
    for bad in ("runner", "ab@team-project.iam.gserviceaccount.com", "Runner@p.iam.gserviceaccount.com", "$(id)"):
        assert checks.gcp_service_account_problem(bad), bad
    assert checks.kubernetes_service_account_problem("pipeline-runner") is None
    assert checks.kubernetes_service_account_problem("Pipeline Runner")
    assert checks.vertex_location_problem("us-east5") is None and checks.vertex_location_problem("europe-west4") is None
    assert "us-east5" in checks.vertex_location_problem("us-east") and checks.vertex_location_problem("global")


def test_a_cron_that_ends_before_it_fires_is_refused(fake):
    from multislice.delivery import schedule, submission

    where = submission.KfpTarget(host=fake.url)
    with pytest.raises(ConfigError, match="after end_time"):
        schedule.create(PROFILE, {"output_dir": "gs://b/r"}, target="kfp", cron="0 3 29 2 *", kfp=where,
                        start_time="2027-03-01T00:00:00Z", end_time="2027-12-01T00:00:00Z")  # fmt: skip
    assert fake.state.requests == []


def test_a_cron_with_a_control_character_is_refused_through_the_python_api(fake):
    from multislice.delivery import schedule, submission

    for cron in ("0 3 * * *\n", "0 3 * * *\r", "\u200b0 3 * * *"):
        with pytest.raises(ConfigError) as refused:
            schedule.create(PROFILE, {"output_dir": "gs://b/r"}, target="kfp", cron=cron,
                            kfp=submission.KfpTarget(host=fake.url))  # fmt: skip
        assert refused.value.issues[0][0] == "cron" and "separate the 5 fields with spaces" in str(refused.value)
    assert fake.state.requests == []


# ---------------------------------------------------------------- plan and preflight


class Compiled(Exception):
    """A compile session was started: the refusal came too late."""


@pytest.fixture
def no_compile(monkeypatch, tmp_path):
    """An empty working directory (``build/plan`` would land here) and no AOT session or preflight compile."""
    from multislice.backends.local import aot
    from multislice.steps import preflight

    def refuse(*args, **kwargs):
        raise Compiled()

    monkeypatch.setattr(aot, "AotSession", refuse)
    monkeypatch.setattr(preflight, "run", refuse)
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize(
    ("argv", "field", "words"),
    [
        (["plan", "--global-batch", "3"], "--global-batch", "give a multiple of 16"),
        (["plan", "--global-batch", "0"], "--global-batch", "give 1 to"),
        (["plan", "--fix", "nosuchknob=1"], "--fix", "not a knob the planner varies"),
        (["plan", "--fix", "weight_dtype=float16"], "--fix", "float32, bfloat16"),
        (["plan", "--fix", "per_device_batch_size=-1"], "--fix", "a number > 0"),
        (["plan", "--model", "no-such-model"], "--model", "unknown MaxText model_name"),
        (["plan", "--num-slices", "0"], "--num-slices", "0 slices cannot train"),
        (["plan", "--seq", "0"], "--seq", "a sequence length"),
        (["plan", "--tpu-type", "v6e-17"], "--tpu-type", "v6e"),
        (["plan", "--budget", "nan"], "--budget", "at least 1"),
        (["plan", "--budget", "1e-300"], "--budget", "at least 1 (a shorter budget is spent before a single candidate"),
        (["plan", "--budget", "0.5"], "--budget", "at least 1"),
        (["plan", "--want", "100000"], "--want", "1 to 1,024"),
        (["plan", "--max-slices", "0"], "--max-slices", "a slice count"),
        (["plan", "--report", "/proc/self/plan.json"], "--report", "/proc"),
        (["plan", "--work-dir", "/sys/x"], "--work-dir", "/sys"),
        (["preflight", "--cache-dir", "/proc/1/cache"], "--cache-dir", "/proc"),
        (["preflight", "--cache-dir", "gs://bucket/cache"], "--cache-dir", "local disk"),
        (["preflight", "--report", "r.txt"], "--report", ".json"),
    ],
)
def test_plan_and_preflight_options_are_refused_before_anything_is_written(no_compile, argv, field, words):
    code, _, err = run_cli(*argv, "--profile", "local")
    assert_refused(code, err, field)
    assert words in err, err
    assert _tree(no_compile) == []  # no build/plan, no cache, no report


def test_plan_cache_dir_in_a_file_is_refused(no_compile):
    (no_compile / "file").write_text("x")
    code, _, err = run_cli("plan", "--profile", "local", "--cache-dir", str(no_compile / "file" / "cache"))
    assert_refused(code, err, "--cache-dir")
    assert _tree(no_compile) == ["file"]


def test_valid_plan_options_reach_the_search(no_compile):
    with pytest.raises(Compiled):
        run_cli("plan", "--profile", "local", "--global-batch", "32", "--fix", "weight_dtype=float32",
                "--fix", "per_device_batch_size=2", "--num-slices", "2", "--seq", "256")  # fmt: skip


def test_a_fixed_per_device_batch_is_the_only_one_tried():
    from multislice.preflight import planner

    spec = config.load_profile("local")
    found = planner.candidates(spec, spec.stages[0], 2, fixed={"per_device_batch_size": 3})
    assert found and {c.knobs.per_device_batch_size for c in found} == {3}


def test_unique_run_name_is_checked_with_its_suffix(tmp_path):
    name = "r" * 31  # fits alone (JobSet + pod names), not with "-" and 8 characters of each run's id
    code, _, err = run_cli("render", "--profile", "local", "--set", f"run_name={name}", "--output", str(tmp_path / "a"))
    assert code == 0, err
    code, _, err = run_cli("render", "--profile", "local", "--set", f"run_name={name}", "--set",
                           "unique_run_name=true", "--output", str(tmp_path / "b"))  # fmt: skip
    assert_refused(code, err, "run_name")
    assert "31 + 9 = 40 characters" in err and "at most 22" in err
    assert not (tmp_path / "b").exists()


def test_the_plan_step_checks_the_suffixed_name_once(tmp_path):
    from multislice.steps import plan as plan_step

    longest = "r" * 22
    plan = plan_step.run(config.read_profile("local"), {"output_dir": str(tmp_path), "run_name": longest,
                                                        "unique_run_name": True}, None, "3f2a9c1e-7b0d")  # fmt: skip
    assert plan.spec.run_name == f"{longest}-3f2a9c1e"


def test_compiling_checks_the_default_run_name_with_the_suffix(tmp_path):
    from pipelines.multislice_training import compile_pipeline

    profile = {**config.read_profile("local"), "run_name": "r" * 31}
    with pytest.raises(ConfigError, match="31 \\+ 9 = 40"):
        compile_pipeline(profile, str(tmp_path / "p.yaml"))
    assert not (tmp_path / "p.yaml").exists()


def test_profile_size_refusal_says_the_real_size(tmp_path):
    path = tmp_path / "huge.yaml"
    path.write_bytes(b"#" * (3 * config.profiles.MAX_PROFILE_BYTES))
    code, _, err = run_cli("render", "--profile", str(path), "--output", str(tmp_path / "out"))
    assert_refused(code, err, str(path))
    assert f"is {3 * config.profiles.MAX_PROFILE_BYTES:,} bytes" in err


def test_a_mapping_given_to_set_names_the_dotted_keys(tmp_path):
    code, _, err = run_cli("render", "--profile", "local", "--set", "stages.0.data={kind: text, format: text}",
                           "--output", str(tmp_path / "out"))  # fmt: skip
    assert_refused(code, err, "stages.0.data")
    assert "--set stages.0.data.kind=text --set stages.0.data.format=text" in err


class _Teapot(http.server.BaseHTTPRequestHandler):
    """A storage endpoint answering every request with an error gcsfs does not retry (and logs with its traceback)."""

    def do_GET(self):  # noqa: N802 - http.server's name
        body = b'{"error": {"code": 418, "message": "not a bucket"}}'
        self.send_response(418)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


GLOB_CHECK = """
from multislice import config
from multislice.steps import plan
try:
    plan.run(config.read_profile("local"), {"output_dir": %r, "stages.0.data.files": ["gs://bucket/corpus/*.txt"]})
except config.ConfigError as error:
    print(error)
"""


def test_a_gs_glob_that_cannot_be_listed_is_one_clean_refusal(tmp_path):
    """In a process with no logging set up, as the CLI and the plan step run, gcsfs's log of the failed request
    (with its traceback) is not printed: only the refusal naming the field."""
    import os
    import subprocess
    import sys

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Teapot)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    env = {**os.environ, "STORAGE_EMULATOR_HOST": f"http://127.0.0.1:{server.server_port}",
           "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"}  # fmt: skip
    try:
        done = subprocess.run([sys.executable, "-c", GLOB_CHECK % str(tmp_path)], env=env, capture_output=True,
                              text=True, timeout=300, check=True)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    assert "stages[0] (tiny-8b-recipe).data.files[0]" in done.stdout and "cannot be listed" in done.stdout
    assert "Traceback" not in done.stderr and "non-retriable" not in done.stderr, done.stderr


# ---------------------------------------------------------------- multislice.remote arguments


class Planned(Exception):
    """The call went on to plan (after every argument check): nothing was refused."""


@pytest.fixture
def no_plan(monkeypatch):
    def refuse(*args, **kwargs):
        raise Planned()

    monkeypatch.setattr(remote_call, "plan_call", refuse)


def _shard(rows, keep=None, tpu_type=None):
    return sum(rows), keep, tpu_type


@pytest.mark.parametrize(
    ("call", "field"),
    [
        (lambda: remote_call.run_remote(5), "function"),
        (lambda: remote_call.run_remote(_shard, [1], num_slices="2"), "num_slices"),
        (lambda: remote_call.run_remote(_shard, [1], backend="aws"), "backend"),
        (lambda: remote_call.run_remote(_shard, [1], keep="yes"), "keep"),
        (lambda: remote_call.run_remote(_shard, [1], wait="no"), "wait"),
        (lambda: remote_call.remote(_shard, wait=0), "wait"),
        (lambda: remote_call.run_remote(_shard, [1], collective_timeout=1e308), "collective_timeout"),
        (lambda: remote_call.run_remote(_shard, [1], collective_timeout=1e-300), "collective_timeout"),
        (lambda: remote_call.run_remote(_shard, threading.Lock()), "args[0]"),
        (lambda: remote_call.run_remote(_shard, [1], kwargs={"keep": threading.Lock()}), "kwargs['keep']"),
        (lambda: remote_call.run_remote(_shard, [1], rows_extra=1), "rows_extra"),
        (lambda: remote_call.remote(_shard, num_slices=0), "num_slices"),
        (lambda: remote_call.remote(tpu_type=16), "tpu_type"),
        (lambda: remote_call.remote(_shard).options(call_id="Bad Id"), "call_id"),
    ],
)
def test_remote_misuse_is_refused_naming_the_argument(no_plan, call, field):
    with pytest.raises(ConfigError) as refused:
        call()
    assert [f for f, _ in refused.value.issues] == [field], refused.value


def test_the_functions_keyword_arguments_reach_it_even_named_like_options(tmp_path, monkeypatch):
    """``keep=`` and ``tpu_type=`` of the call go to the function; the options are the decorator's."""

    class Stop(Exception):
        pass

    def tell(line):
        raise Stop(line)  # the first progress line comes after the payload is written, before any submit

    shard = remote_call.remote(_shard, tpu_type="v5litepod-8", backend="local", output_dir=str(tmp_path),
                               call_id="c0ffee00", tell=tell)  # fmt: skip
    with pytest.raises(Stop):
        shard([1, 2], keep="mine", tpu_type="the function's")
    [payload] = tmp_path.glob("remote-*/remote/payload.pkl")
    function, args, kwargs = cloudpickle.loads(payload.read_bytes())
    assert args == ([1, 2],) and kwargs == {"keep": "mine", "tpu_type": "the function's"}
    assert function(*args, **kwargs) == (3, "mine", "the function's")
    assert not list(tmp_path.glob("remote-*/jobsets/*"))  # nothing submitted
    with pytest.raises(Stop):
        shard.options(keep=True)([5], keep=0)
    assert shard.local([1], keep=1) == (1, 1, None)
