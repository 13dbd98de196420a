"""Schedules: one cron syntax converted per target; Vertex AI schedule bodies and KFP recurring runs as sent."""

import datetime
import re
import warnings
from unittest import mock

import pytest
from google.auth.credentials import AnonymousCredentials
from google.cloud.aiplatform_v1.services.schedule_service.transports import grpc as schedule_grpc
from google.cloud.aiplatform_v1.types import schedule as gca_schedule
from google.longrunning import operations_pb2
from google.protobuf import any_pb2, empty_pb2

from multislice import cli, identity
from multislice.config import ConfigError
from multislice.delivery import schedule, submission
from multislice.delivery.schedule import Cron
from multislice.steps import plan as plan_step
from tests import deployment
from tests.fakes import FakeServer

warnings.filterwarnings("ignore", category=FutureWarning)
#: The packaged seed profile with a deployment's values in place of its placeholders (tests/deployment.py).
PROFILE = deployment.profile_file("gke-v6e-16x2-seed")
VALUES = {"output_dir": "gs://team-bucket/runs", "stage1_steps": 100}


def test_cron_conversion():
    cron = Cron.parse("30  2 * * mon-fri", "Europe/Paris")
    assert cron.vertex() == "TZ=Europe/Paris 30 2 * * mon-fri"
    assert Cron.parse("*/15 * * * *").kfp() == "0 */15 * * * *"
    assert Cron.parse("0 3 1 * *", "UTC").kfp() == "0 0 3 1 * *"
    start = datetime.datetime(2026, 11, 22, 10, 0, tzinfo=datetime.UTC)  # a Sunday
    times = Cron.parse("30 2 * * mon-fri", "Europe/Paris").next_times(2, start)
    assert [t.isoformat() for t in times] == ["2026-11-23T02:30:00+01:00", "2026-11-24T02:30:00+01:00"]


@pytest.mark.parametrize(
    ("cron", "zone", "field", "words"),
    [
        ("0 0 3 * * *", None, "cron", "has 6 fields; give 5"),
        ("0 3 * *", None, "cron", "has 4 fields"),
        ("61 3 * * *", None, "cron", "minute field '61': 61 is outside 0-59"),
        ("0 3 * * $", None, "cron", "day-of-week field '$'"),
        ("0 3 * * *", "Mars/Olympus", "timezone", "unknown time zone"),
    ],
)
def test_bad_cron_is_refused(cron, zone, field, words):
    with pytest.raises(ConfigError) as raised:
        Cron.parse(cron, zone)
    assert raised.value.issues[0][0] == field and words in raised.value.issues[0][1]


def test_kfp_refuses_a_time_zone():
    with pytest.raises(ConfigError, match="convert the times to UTC"):
        Cron.parse("0 3 * * *", "America/New_York").kfp()


def test_scheduled_runs_get_unique_run_names():
    first = identity.unique_run_name("nightly", "3f2a9c1e-7b0d-4c55-9e1a-0a1b2c3d4e5f")
    second = identity.unique_run_name("nightly", "a81b77d0-1111-4c55-9e1a-0a1b2c3d4e5f")
    assert (first, second) == ("nightly-3f2a9c1e", "nightly-a81b77d0")
    plan = plan_step.run(
        {**_local_profile(), "unique_run_name": True}, {"output_dir": "/tmp/runs"}, None, "3f2a9c1e-7b0d-4c55"
    )
    assert plan.spec.run_name == "local-demo-3f2a9c1e" and plan.run_dir == "/tmp/runs/local-demo-3f2a9c1e"
    assert plan.stages[0].jobset.startswith("local-demo-3f2a9c1e-")


def _local_profile():
    from multislice import config

    return config.read_profile("local")


@pytest.fixture
def fake(monkeypatch):
    with FakeServer() as server:
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", server.url)
        yield server


def test_kfp_recurring_run_sent(fake):
    where = submission.KfpTarget(host=fake.url, service_account="pipeline-runner")
    made = schedule.create(PROFILE, VALUES, target="kfp", cron="30 2 * * mon-fri", kfp=where, max_concurrent_runs=2,
                           name="nightly")  # fmt: skip
    [sent] = fake.state.sent("POST", "/recurringruns")
    body = sent.body
    assert body["trigger"] == {"cron_schedule": {"cron": "0 30 2 * * mon-fri"}}
    # Concurrency and catch-up are separate: two at once, and no backfill unless asked.
    assert body["max_concurrency"] == 2 and body["no_catchup"] is True and body["mode"] == "ENABLE"
    assert body["display_name"] == "nightly" and body["service_account"] == "pipeline-runner"
    params = body["runtime_config"]["parameters"]
    assert params["unique_run_name"] is True and params["run_name"] == "llama3-multislice"
    assert params["stage1_steps"] == 100 and params["output_dir"] == "gs://team-bucket/runs"
    assert made.schedule_id in fake.state.recurring_runs

    listed = schedule.list_schedules("kfp", kfp=where)
    assert [(s.schedule_id, s.name, s.cron) for s in listed] == [(made.schedule_id, "nightly", "0 30 2 * * mon-fri")]
    schedule.change("pause", made.schedule_id, "kfp", kfp=where)
    assert fake.state.recurring_runs[made.schedule_id]["mode"] == "DISABLE"
    schedule.change("resume", made.schedule_id, "kfp", kfp=where)
    assert fake.state.recurring_runs[made.schedule_id]["mode"] == "ENABLE"
    schedule.change("delete", made.schedule_id, "kfp", kfp=where)
    assert fake.state.recurring_runs == {}


def test_continue_run_keeps_one_run_name_and_needs_one_run_at_a_time(fake):
    where = submission.KfpTarget(host=fake.url)
    with pytest.raises(ConfigError, match="max_concurrent_runs"):
        schedule.create(PROFILE, VALUES, target="kfp", cron="0 * * * *", kfp=where, continue_run=True,
                        max_concurrent_runs=2)  # fmt: skip
    assert fake.state.requests == []
    schedule.create(PROFILE, {**VALUES, "run_name": "llama-long"}, target="kfp", cron="0 * * * *", kfp=where,
                    continue_run=True)  # fmt: skip
    [sent] = fake.state.sent("POST", "/recurringruns")
    params = sent.body["runtime_config"]["parameters"]
    assert (params["run_name"], params["unique_run_name"]) == ("llama-long", False)


class ScheduleTransport:
    """The final gRPC calls of ScheduleService, recorded; schedules held in memory."""

    def __init__(self):
        self.calls = []
        self.schedules = {}

    def create_schedule(self, request, **kwargs):
        self.calls.append(("create", request))
        made = gca_schedule.Schedule(request.schedule)
        made.name = f"{request.parent}/schedules/777"
        made.state = gca_schedule.Schedule.State.ACTIVE
        self.schedules[made.name] = made
        return made

    def get_schedule(self, request, **kwargs):
        self.calls.append(("get", request))
        return self.schedules[request.name]

    def list_schedules(self, request, **kwargs):
        self.calls.append(("list", request))
        from google.cloud.aiplatform_v1.types import schedule_service

        return schedule_service.ListSchedulesResponse(schedules=list(self.schedules.values()))

    def pause_schedule(self, request, **kwargs):
        self.calls.append(("pause", request))
        self.schedules[request.name].state = gca_schedule.Schedule.State.PAUSED

    def resume_schedule(self, request, **kwargs):
        self.calls.append(("resume", request))
        self.schedules[request.name].state = gca_schedule.Schedule.State.ACTIVE

    def update_schedule(self, request, **kwargs):
        self.calls.append(("update", request))
        held = self.schedules[request.schedule.name]
        for path in request.update_mask.paths:
            setattr(held, path, getattr(request.schedule, path))
        return held

    def delete_schedule(self, request, **kwargs):
        self.calls.append(("delete", request))
        del self.schedules[request.name]
        response = any_pb2.Any()
        response.Pack(empty_pb2.Empty())
        return operations_pb2.Operation(name="operations/1", done=True, response=response)

    def patches(self):
        names = ["create_schedule", "get_schedule", "list_schedules", "pause_schedule", "resume_schedule",
                 "update_schedule", "delete_schedule"]  # fmt: skip
        return [
            mock.patch.object(schedule_grpc.ScheduleServiceGrpcTransport, n, new_callable=mock.PropertyMock,
                              return_value=getattr(self, n))
            for n in names
        ]  # fmt: skip


def test_vertex_schedule_sent_and_managed(fake):
    transport = ScheduleTransport()
    where = submission.VertexTarget(project="team-project", location="us-east5", credentials=AnonymousCredentials(),
                                    service_account="runner@team-project.iam.gserviceaccount.com")  # fmt: skip
    patches = transport.patches()
    for p in patches:
        p.start()
    try:
        made = schedule.create(PROFILE, VALUES, target="vertex", cron="0 3 * * *", timezone="America/New_York",
                               vertex=where, max_concurrent_runs=1, allow_queueing=True, max_runs=30,
                               start_time="2026-12-01T00:00:00Z", end_time="2027-03-01T00:00:00Z")  # fmt: skip
        [(_, request)] = [c for c in transport.calls if c[0] == "create"]
        sent = gca_schedule.Schedule.to_dict(request.schedule)
        assert request.parent == "projects/team-project/locations/us-east5"
        assert sent["cron"] == "TZ=America/New_York 0 3 * * *"
        assert sent["max_concurrent_run_count"] == "1" and sent["allow_queueing"] is True
        assert sent["max_run_count"] == "30" and sent["display_name"] == "llama3-multislice-schedule"
        assert (sent["start_time"], sent["end_time"]) == ("2026-12-01T00:00:00Z", "2027-03-01T00:00:00Z")
        job = sent["create_pipeline_job_request"]
        assert job["parent"] == "projects/team-project/locations/us-east5"
        assert job["pipeline_job"]["service_account"] == "runner@team-project.iam.gserviceaccount.com"
        values = job["pipeline_job"]["runtime_config"]["parameter_values"]
        assert values["unique_run_name"] is True and values["run_name"] == "llama3-multislice"
        assert values["stage1_steps"] == 100
        assert made.schedule_id == "projects/team-project/locations/us-east5/schedules/777"

        assert [s.state for s in schedule.list_schedules("vertex", vertex=where)] == ["ACTIVE"]
        schedule.change("pause", made.schedule_id, "vertex", vertex=where)
        assert transport.schedules[made.schedule_id].state == gca_schedule.Schedule.State.PAUSED
        schedule.change("resume", made.schedule_id, "vertex", vertex=where)
        assert transport.schedules[made.schedule_id].state == gca_schedule.Schedule.State.ACTIVE
        # Resume never catches up unless asked; asked, it warns with the runs missed while paused.
        assert [r.catch_up for n, r in transport.calls if n == "resume"] == [False]
        schedule.change("pause", made.schedule_id, "vertex", vertex=where)
        transport.schedules[made.schedule_id].last_pause_time = datetime.datetime(2026, 12, 1, 12, tzinfo=datetime.UTC)
        now = datetime.datetime(2026, 12, 5, 12, tzinfo=datetime.UTC)
        with pytest.warns(schedule.CatchUpWarning, match="starts 4 missed run"):
            schedule.change("resume", made.schedule_id, "vertex", vertex=where, catch_up=True, now=now)
        assert [r.catch_up for n, r in transport.calls if n == "resume"] == [False, True]

        updated = schedule.update(made.schedule_id, "vertex", cron="0 5 * * 1-5", timezone="UTC",
                                  max_concurrent_runs=2, vertex=where)  # fmt: skip
        [(_, request)] = [c for c in transport.calls if c[0] == "update"]
        assert sorted(request.update_mask.paths) == ["cron", "max_concurrent_run_count"]
        assert request.schedule.cron == "TZ=UTC 0 5 * * 1-5" and request.schedule.max_concurrent_run_count == 2
        assert updated.cron == "TZ=UTC 0 5 * * 1-5"
        with pytest.raises(ConfigError, match="day-of-week"):
            schedule.update(made.schedule_id, "vertex", cron="0 5 * * 7", vertex=where)
        assert len([c for c in transport.calls if c[0] == "update"]) == 1
        schedule.change("delete", made.schedule_id, "vertex", vertex=where)
        assert transport.schedules == {}
    finally:
        for p in patches:
            p.stop()


def test_cli_schedule_create_prints_next_runs(fake, capsys):
    status = cli.main(["schedule", "create", "--profile", PROFILE, "--target", "kfp", "--host", fake.url,
                       "--cron", "0 4 * * sun", "--set", "output_dir=gs://bucket/r"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and "cron '0 0 4 * * sun'" in out and "next runs: " in out
    assert cli.main(["schedule", "create", "--profile", PROFILE, "--target", "kfp", "--host", fake.url,
                     "--cron", "0 4 * * * *"]) == 2  # fmt: skip
    assert "cron: '0 4 * * * *' has 6 fields" in capsys.readouterr().err
    assert len(fake.state.sent("POST", "/recurringruns")) == 1


def test_cli_schedule_dry_run_prints_the_schedule_and_sends_nothing(fake, capsys, monkeypatch):
    monkeypatch.setattr(submission.KfpTarget, "make_client", lambda *a, **k: pytest.fail("a dry run built a client"))
    status = cli.main(["schedule", "create", "--profile", PROFILE, "--target", "kfp", "--host", fake.url,
                       "--cron", "0 4 * * sun", "--set", "output_dir=gs://bucket/r", "--dry-run"])  # fmt: skip
    out = capsys.readouterr().out
    assert status == 0 and fake.state.requests == []
    assert out.startswith("dry run: schedule llama3-multislice-schedule would be created on kfp; nothing was sent")
    assert "  cron:                 0 0 4 * * sun\n" in out  # as KFP's controller would get it
    assert "  each run:             a new run named llama3-multislice-<its run id, 8 characters>\n" in out
    assert "  unique_run_name = True\n" in out and "next runs: " in out


def test_schedule_update_dry_run_checks_the_changes_and_sends_nothing(monkeypatch, capsys):
    monkeypatch.setattr(schedule, "_vertex_schedule", lambda *a: pytest.fail("a dry run read the schedule"))
    name = "projects/team-project/locations/us-east5/schedules/777"
    argv = ["schedule", "update", name, "--target", "vertex", "--project", "team-project", "--location", "us-east5"]
    assert cli.main([*argv, "--cron", "0 4 * * *", "--max-concurrent-runs", "2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"dry run: schedule {name} would be updated; nothing was sent")
    assert "  change cron:          0 4 * * *\n" in out and "  change max concurrent run count: 2\n" in out
    assert cli.main([*argv, "--cron", "0 4 * * 7", "--dry-run"]) == 2  # Vertex's dialect: day-of-week 0-6
    assert "cron" in capsys.readouterr().err


def test_schedule_create_help_is_creates_own(capsys):
    with pytest.raises(SystemExit) as done:
        cli.main(["schedule", "create", "--help"])
    out = capsys.readouterr().out
    assert done.value.code == 0 and out.startswith("usage: multislice schedule create ")
    assert "--cron CRON" in out and "--dry-run" in out and "ACTION" not in out  # not `schedule --help`'s text
    assert "\nexamples:\n  multislice schedule create --profile " in out


@pytest.mark.parametrize(
    ("cron", "target", "words"),
    [
        ("0 3 * * 7", "kfp", "7 is outside 0-6 for kfp; use 0 for Sunday"),
        ("0 3 * * 7", "vertex", "outside 0-6"),
        ("0 3 L * *", "kfp", "'L' is not accepted by kfp"),
        ("0 3 * * 5#3", "kfp", "day-of-week field '5#3'"),
        ("0 3 15W * *", "vertex", "not accepted"),
        ("0 3 ? * mon", "vertex", "'?' is not accepted"),
        ("0 24 * * *", "kfp", "hour field '24': 24 is outside 0-23"),
    ],
)
def test_cron_outside_the_backends_dialect_is_refused_before_anything_is_sent(fake, cron, target, words):
    vertex = submission.VertexTarget(project="team-project", location="us-east5", credentials=AnonymousCredentials())
    where = {"kfp": submission.KfpTarget(host=fake.url)} if target == "kfp" else {"vertex": vertex}
    with pytest.raises(ConfigError, match=re.escape(words)):
        schedule.create(PROFILE, VALUES, target=target, cron=cron, **where)
    assert fake.state.requests == []  # no pipeline version uploaded


def test_kfp_accepts_its_own_dialect():
    for cron in ("0 3 * * 0", "0 3 ? * mon-fri", "*/5 1-3,7 1 jan,dec sun", "0 0 1-31/2 * *"):
        schedule.check_dialect(cron, "kfp")


def test_kfp_catch_up_is_explicit_and_warns_with_the_runs_it_starts(fake):
    where = submission.KfpTarget(host=fake.url)
    now = datetime.datetime(2026, 11, 23, 14, 30, tzinfo=datetime.UTC)
    with pytest.raises(ConfigError, match="KFP has no queue"):
        schedule.create(PROFILE, VALUES, target="kfp", cron="0 3 * * *", kfp=where, allow_queueing=True)
    with pytest.warns(schedule.CatchUpWarning, match="starts 7 missed run"):  # 03:00 on Nov 17..23
        made = schedule.create(PROFILE, VALUES, target="kfp", cron="0 3 * * *", kfp=where, catch_up=True,
                               start_time="2026-11-16T12:00:00Z", end_time="2027-01-01T00:00:00Z",
                               now=now)  # fmt: skip
    [sent] = fake.state.sent("POST", "/recurringruns")
    assert sent.body["no_catchup"] is False
    assert sent.body["trigger"]["cron_schedule"] == {
        "cron": "0 0 3 * * *", "start_time": "2026-11-16T12:00:00Z", "end_time": "2027-01-01T00:00:00Z"}  # fmt: skip

    # Enabling a recurring run created with catch-up backfills: refused unless asked.
    schedule.change("pause", made.schedule_id, "kfp", kfp=where)
    with pytest.raises(ConfigError, match="created with catch-up"):
        schedule.change("resume", made.schedule_id, "kfp", kfp=where)
    assert fake.state.recurring_runs[made.schedule_id]["mode"] == "DISABLE"
    with pytest.warns(schedule.CatchUpWarning):
        schedule.change("resume", made.schedule_id, "kfp", kfp=where, catch_up=True, now=now)
    assert fake.state.recurring_runs[made.schedule_id]["mode"] == "ENABLE"
    with pytest.raises(ConfigError, match="cannot be updated"):
        schedule.update(made.schedule_id, "kfp", cron="0 4 * * *", kfp=where)


def test_kfp_interval_trigger(fake):
    where = submission.KfpTarget(host=fake.url)
    made = schedule.create(PROFILE, VALUES, target="kfp", interval_seconds=6 * 3600, kfp=where)
    [sent] = fake.state.sent("POST", "/recurringruns")
    assert sent.body["trigger"] == {"periodic_schedule": {"interval_second": 21600}}
    assert sent.body["no_catchup"] is True
    assert [s.cron for s in schedule.list_schedules("kfp", kfp=where)] == ["every 21600s"]
    with pytest.raises(ConfigError, match="without catch-up"):
        schedule.change("resume", made.schedule_id, "kfp", kfp=where, catch_up=True)
    with pytest.raises(ConfigError, match="either a cron expression or"):
        schedule.create(PROFILE, VALUES, target="kfp", cron="0 3 * * *", interval_seconds=60, kfp=where)


def test_cli_schedule_times_and_catch_up(fake, capsys):
    base = ["schedule", "create", "--profile", PROFILE, "--target", "kfp", "--host", fake.url, "--set",
            "output_dir=gs://bucket/r", "--cron", "0 3 * * *"]  # fmt: skip
    assert cli.main([*base, "--start-time", "2026-12-01T00:00:00Z", "--end-time", "2026-11-01T00:00:00Z"]) == 2
    assert "end_time" in capsys.readouterr().err
    assert cli.main([*base, "--start-time", "yesterday"]) == 2
    assert "--start-time: 'yesterday' is not an RFC 3339 time" in capsys.readouterr().err
    assert cli.main([*base, "--cron", "0 3 * * 7"]) == 2
    assert "use 0 for Sunday" in capsys.readouterr().err
    assert fake.state.requests == []
    assert cli.main([*base, "--catch-up", "--start-time", "2020-01-01T00:00:00Z"]) == 0
    captured = capsys.readouterr()
    assert "warning: catch-up is on: the schedule starts" in captured.err and "catch-up: on" in captured.out
    [sent] = fake.state.sent("POST", "/recurringruns")
    assert sent.body["no_catchup"] is False and sent.body["trigger"]["cron_schedule"]["start_time"].startswith("2020")


@pytest.mark.parametrize("dry_run", [False, True])
def test_schedule_create_refuses_the_profiles_placeholders_before_compiling(fake, capsys, monkeypatch, dry_run):
    """Issue 44: a nightly schedule made with the packaged profile's placeholders failed every night."""
    monkeypatch.setattr(submission, "compile_for", lambda *a, **k: pytest.fail("compiled before refusing"))
    flags = ["--dry-run"] if dry_run else []
    status = cli.main(["schedule", "create", "--profile", "gke-v6e-16x2", "--target", "kfp", "--host", fake.url,
                       "--cron", "0 3 * * *", *flags])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    for field in ("output_dir", "cluster_project", "cluster_name", "trainer_image", "images.pipeline"):
        assert f"  - {field}: " in err
    assert "--set output_dir=gs://BUCKET/PATH" in err and fake.state.requests == []
    with pytest.raises(ConfigError) as raised:
        schedule.create("gke-v6e-16x2", VALUES, target="kfp", cron="0 3 * * *", kfp=submission.KfpTarget(fake.url),
                        dry_run=dry_run)  # fmt: skip
    assert "cluster_project" in dict(raised.value.issues) and fake.state.requests == []
    monkeypatch.undo()
    status = cli.main(["schedule", "create", "--profile", "gke-v6e-16x2", "--target", "kfp", "--host", fake.url,
                       "--cron", "0 3 * * *", *deployment.sets(), *flags])  # fmt: skip
    assert status == 0, capsys.readouterr().err
    assert len(fake.state.sent("POST", "/recurringruns")) == (0 if dry_run else 1)


def test_a_cron_error_names_the_flag_and_the_field_and_does_not_hide_the_others(fake, capsys):
    status = cli.main(["schedule", "create", "--profile", PROFILE, "--target", "kfp", "--host", fake.url,
                       "--cron", "0 25 * * *", "--max-runs", "3", "--set", "stage1_stepz=5", "--dry-run"])  # fmt: skip
    err = capsys.readouterr().err
    assert status == 2
    assert "  - --cron: hour field '25': 25 is outside 0-23" in err
    assert "  - --max-runs: " in err  # a KFP schedule has no run limit: reported with the cron, not after it
    assert "  - stage1_stepz: unknown pipeline parameter; did you mean stage1_steps?" in err
    with pytest.raises(ConfigError) as raised:  # the Python API names its arguments
        schedule.create(PROFILE, VALUES, target="kfp", cron="61 3 * * *", kfp=submission.KfpTarget(fake.url))
    assert raised.value.issues == [("cron", "minute field '61': 61 is outside 0-59 for cron")]
    assert fake.state.requests == []
