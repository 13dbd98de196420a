"""Schedules: one cron syntax converted per target; Vertex AI schedule bodies and KFP recurring runs as sent."""

import datetime
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
from tests.fakes import FakeServer

warnings.filterwarnings("ignore", category=FutureWarning)
PROFILE = "gke-v6e-16x2"
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
        ("61 3 * * *", None, "cron", "not a valid cron expression"),
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
                           allow_queueing=True, name="nightly")  # fmt: skip
    [sent] = fake.state.sent("POST", "/recurringruns")
    body = sent.body
    assert body["trigger"] == {"cron_schedule": {"cron": "0 30 2 * * mon-fri"}}
    assert body["max_concurrency"] == 2 and body["no_catchup"] is False and body["mode"] == "ENABLE"
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

    def delete_schedule(self, request, **kwargs):
        self.calls.append(("delete", request))
        del self.schedules[request.name]
        response = any_pb2.Any()
        response.Pack(empty_pb2.Empty())
        return operations_pb2.Operation(name="operations/1", done=True, response=response)

    def patches(self):
        names = ["create_schedule", "get_schedule", "list_schedules", "pause_schedule", "resume_schedule",
                 "delete_schedule"]  # fmt: skip
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
                               vertex=where, max_concurrent_runs=1, allow_queueing=True, max_runs=30)  # fmt: skip
        [(_, request)] = [c for c in transport.calls if c[0] == "create"]
        sent = gca_schedule.Schedule.to_dict(request.schedule)
        assert request.parent == "projects/team-project/locations/us-east5"
        assert sent["cron"] == "TZ=America/New_York 0 3 * * *"
        assert sent["max_concurrent_run_count"] == "1" and sent["allow_queueing"] is True
        assert sent["max_run_count"] == "30" and sent["display_name"] == "llama3-multislice-schedule"
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
