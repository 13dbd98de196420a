"""Elastic stages: the option's validation, the slice counts, and gradient accumulation keeping the global batch."""

import contextlib
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from multislice import config, elastic, preflight
from multislice.backends.base import Backend
from multislice.config.elastic import describe
from multislice.errors import ConfigError
from multislice.plan import make_plan
from multislice.steps import preflight as step


def gke_data() -> dict:
    return config.spec_to_data(config.load_profile("gke-v6e-16x2-seed"))


def args_of(count) -> dict[str, str]:
    return dict(arg.split("=", 1) for arg in count.maxtext_args)


def test_the_gke_8b_stage_trains_on_one_slice_with_gradient_accumulation_two():
    plan = make_plan(config.load_profile("gke-v6e-16x2-seed"))
    stage = plan.stage("llama3-8b")
    assert stage.runnable_counts() == [2, 1]
    full, one = stage.on_slices(2), stage.on_slices(1)
    assert (full.gradient_accumulation_steps, one.gradient_accumulation_steps) == (1, 2)
    # MaxText: global batch = per_device_batch_size x devices x gradient_accumulation_steps (configs/types.py).
    assert full.global_batch_size == one.global_batch_size == stage.global_batch_size == 4 * 16 * 2
    assert args_of(one)["dcn_data_parallelism"] == "1" and args_of(one)["gradient_accumulation_steps"] == "2"
    assert args_of(full)["dcn_data_parallelism"] == "2" and "gradient_accumulation_steps" not in args_of(full)
    # On the full count the arguments are the stage's own, so preflight's cached verdict is shared.
    assert full.maxtext_args == stage.maxtext_args
    assert stage.wait_for_lost_slice_seconds == 300
    assert plan.stage("llama3-70b").elastic == []
    assert "1 slice: gradient_accumulation_steps 2, global batch 128 (unchanged)" in describe(stage.elastic)


@pytest.mark.parametrize(
    ("elastic_option", "field", "words"),
    [
        ({"min_slices": 0}, "elastic.min_slices", "greater than or equal to 1"),
        ({"min_slices": 3}, "elastic.min_slices", "exceeds num_slices (2)"),
        ({"min_slices": 2, "max_slices": 1}, "elastic", "min_slices (2) exceeds max_slices (1)"),
        ({"min_slices": 1, "max_slices": 4}, "elastic.max_slices", "set max_slices to 2"),
        ({"min_slices": 1, "on_indivisible": "drop"}, "elastic.on_indivisible", "'wait' or 'shrink_batch'"),
        ({"min_slices": 1, "wait_for_lost_slice_seconds": -1}, "elastic.wait_for_lost_slice_seconds", ">= 0"),
    ],
)
def test_bad_elastic_options_name_the_field_and_the_fix(elastic_option, field, words):
    data = gke_data()
    data["stages"][0]["elastic"] = elastic_option
    with pytest.raises(ConfigError) as caught:
        config.load_spec(data)
    message = str(caught.value).replace("greater_than_equal", ">=")
    assert field in message and (words in message or words.replace(">= 0", "greater than or equal to 0") in message)


def test_a_fixed_dcn_stage_cannot_shrink_and_says_so():
    data = gke_data()
    data["stages"][1]["elastic"] = {"min_slices": 1}  # the 70B stage: DCN fsdp 2 x data 1, no -1 axis
    with pytest.raises(ConfigError) as caught:
        config.load_spec(data)
    [(field, message)] = caught.value.issues
    assert field == "stages[1] (llama3-70b).elastic.min_slices"
    assert "multiplies to 2, not 1" in message and "-1 axis" in message


def three_slices(on_indivisible: str) -> dict:
    data = gke_data()
    data.update(num_slices=3)
    data["stages"] = data["stages"][:1]
    data["stages"][0]["elastic"] = {"min_slices": 1, "on_indivisible": on_indivisible}
    return data


def test_a_count_that_cannot_keep_the_batch_waits_or_shrinks_the_batch_as_the_stage_says():
    waiting = make_plan(config.load_spec(three_slices("wait"))).stages[0]
    assert waiting.runnable_counts() == [3, 1]
    two = waiting.on_slices(2)
    assert not two.runnable and "3 slices / 2 is not whole" in two.reason and two.maxtext_args == []
    shrinking = make_plan(config.load_spec(three_slices("shrink_batch"))).stages[0]
    assert shrinking.runnable_counts() == [3, 2, 1]
    two = shrinking.on_slices(2)
    assert not two.keeps_global_batch and two.global_batch_size == 4 * 16 * 2 < shrinking.global_batch_size
    assert "shrink_batch" in two.reason
    with pytest.raises(KeyError):
        shrinking.on_slices(4)


@settings(max_examples=60, deadline=None)
@given(
    slices=st.integers(1, 8),
    data=st.data(),
    accumulation=st.integers(1, 4),
    per_device=st.sampled_from([0.25, 0.5, 1, 2, 4]),
)
def test_gradient_accumulation_keeps_the_global_batch_on_every_runnable_count(slices, data, accumulation, per_device):
    """Property: for every count that keeps the batch, per_device x chips x k x accumulation = the full batch."""
    spec_data = gke_data()
    spec_data.update(num_slices=slices)
    stage = spec_data["stages"][0]
    stage.update(per_device_batch_size=per_device, elastic={"min_slices": data.draw(st.integers(1, slices))})
    stage["maxtext_overrides"] = {"gradient_accumulation_steps": accumulation}
    spec_data["stages"] = [stage]
    try:
        spec = config.load_spec(spec_data)
    except ConfigError:
        return  # e.g. a min_slices whose micro-batch is not whole: refused, which the cases above cover
    [plan_stage] = make_plan(spec).stages
    chips = spec.slice_type.chips
    full = per_device * chips * slices * accumulation
    for count in plan_stage.elastic:
        if not count.runnable:
            assert count.reason and count.slices < slices
            continue
        assert count.keeps_global_batch
        assert per_device * chips * count.slices * count.gradient_accumulation_steps == pytest.approx(full)
        assert args_of(count).get("gradient_accumulation_steps", "1") == str(count.gradient_accumulation_steps)
        assert int(args_of(count)["dcn_data_parallelism"]) == count.slices
    assert plan_stage.runnable_counts()[0] == slices


# --- preflight: a verdict for every slice count -------------------------------------------------------------------

#: The seed profile's 8B stage on 2 x v6e-16 as XLA reported it here (benchmarks/results/preflight.json).
RECORDED_8B_BYTES = 24_063_695_104  # 22.41 GiB per chip


class RecordingSession:
    """A CompileSession that answers ``fits`` with a fixed use per chip and records each request."""

    def __init__(self, used: int = RECORDED_8B_BYTES):
        self.used, self.requests = used, []

    def compile(self, request: dict, timeout: float = 0) -> dict:
        self.requests.append(request)
        memory = {"argument": self.used, "output": 0, "alias": 0, "temp": 0, "generated_code": 0, "total": self.used}
        return {"verdict": "fits", "memory": memory, "compile_seconds": 1.0, "maxtext_args": request["maxtext_args"]}


class FakeBackend:
    name = "fake"
    timings = SimpleNamespace(compile_timeout=60, alternative_budget=60)
    holding_run = Backend.holding_run  # a step holds its run through its backend: nothing to hold here

    def __init__(self, session):
        self.session = session

    @contextlib.contextmanager
    def aot_session(self, plan, cache, pipeline_run_id, tell):
        yield self.session


def gke_stage_plan(name: str, **changes):
    data = gke_data()
    data["output_dir"] = "gs://bucket/runs"
    [stage] = [s for s in data["stages"] if s["name"] == name]
    stage.update(changes)
    data["stages"] = [stage]
    return make_plan(config.load_spec(data))


def test_preflight_compiles_the_8b_stage_for_two_slices_and_for_one_with_gradient_accumulation():
    plan = gke_stage_plan("llama3-8b")
    session = RecordingSession()
    [report] = preflight.check_stages(plan, plan.stages, session, timeout=60)
    assert [(r["num_slices"], r["compile_topology"]) for r in session.requests] == [(2, "v6e-16"), (1, "v6e-16")]
    one = dict(a.split("=", 1) for a in session.requests[1]["maxtext_args"])
    assert one["gradient_accumulation_steps"] == "2" and one["dcn_data_parallelism"] == "1"
    assert report.verdict == "fits" and report.target.num_slices == 2
    [shrunk] = report.elastic
    assert (shrunk.slices, shrunk.gradient_accumulation_steps, shrunk.verdict, shrunk.source) == (1, 2, "fits", "aot")
    assert shrunk.global_batch_size == 128 and shrunk.used_bytes_per_chip == RECORDED_8B_BYTES
    line = preflight.summary_line(report)
    assert "fits on 2 x v6e-16" in line
    assert "elastic: on 1 slice (gradient_accumulation_steps 2): fits, 22.41 GiB per chip" in line
    assert report.to_dict()["elastic"][0]["verdict"] == "fits"


def test_a_count_the_memory_model_rules_out_is_not_compiled_and_preflight_fails_naming_it(gcs):
    # The 70B stage with FSDP over DCN: on 1 slice each chip holds twice the parameters (plus an accumulation
    # buffer), and with the moments offloaded that is still over v6e's 31.24 GiB per chip.
    plan = gke_stage_plan("llama3-70b", dcn={"fsdp": -1}, elastic={"min_slices": 1})
    floor = preflight.memory_floor_bytes(plan, plan.stages[0], 1)
    assert floor > plan.slice.usable_hbm_bytes_per_chip
    session = RecordingSession(used=30 * 2**30)
    with pytest.raises(preflight.PreflightFailed) as caught:
        step.run(plan, backend=FakeBackend(session))
    assert [r["num_slices"] for r in session.requests] == [2]  # the 1-slice count was pruned, not compiled
    [report] = caught.value.reports
    [pruned] = report.elastic
    assert (pruned.slices, pruned.verdict, pruned.source) == (1, "does_not_fit", "memory_model")
    assert "cannot shrink to 1 slice(s) (does not fit): set elastic.min_slices to 2" in str(caught.value)


def test_a_count_that_cannot_run_gets_a_not_runnable_verdict_without_a_compile():
    data = three_slices("wait")
    data["output_dir"] = "gs://bucket/runs"
    plan = make_plan(config.load_spec(data))
    session = RecordingSession()
    [report] = preflight.check_stages(plan, plan.stages, session, timeout=60)
    assert [r["num_slices"] for r in session.requests] == [3, 1]
    assert [(v.slices, v.verdict) for v in report.elastic] == [(2, "not_runnable"), (1, "fits")]
    assert "3 slices / 2 is not whole" in report.elastic[0].reason


# --- the resize policy ---------------------------------------------------------------------------------------------


def policy(**observed):
    defaults = {"running": 2, "lost_at": None, "available": 2, "now": 0.0, "wait_seconds": 60.0}
    return elastic.decide([2, 1], **{**defaults, "checkpoint_since_capacity": False, **observed})


def test_a_lost_slice_waits_then_shrinks_and_grows_back_at_a_checkpoint():
    assert policy().action == "keep"
    waiting = policy(lost_at=100.0, available=1, now=130.0)
    assert (waiting.action, waiting.until) == ("wait", 160.0)
    shrink = policy(lost_at=100.0, available=1, now=160.0)
    assert (shrink.action, shrink.slices) == ("relaunch", 1) and "did not return within 60 s" in shrink.cause
    assert "gradient accumulation 2" in shrink.cause
    # On 1 slice: capacity back, but no checkpoint yet since -> keep; after one -> grow to 2.
    assert policy(running=1, available=2).action == "keep"
    grow = policy(running=1, available=2, checkpoint_since_capacity=True)
    assert (grow.action, grow.slices) == ("relaunch", 2) and "grow from 1" in grow.cause


def test_capacity_back_within_the_wait_restarts_on_the_same_size():
    back = policy(lost_at=100.0, available=2, now=120.0)
    assert (back.action, back.slices) == ("relaunch", 2)


def test_no_runnable_count_within_the_capacity_waits_for_an_event():
    none = elastic.decide(
        [4, 2], running=4, lost_at=0.0, available=1, now=1e6, wait_seconds=1, checkpoint_since_capacity=False
    )
    assert (none.action, none.until) == ("wait", None) and "fewer than the stage's minimum of 2" in none.cause
    # 3 available of 4 with counts [4, 2]: shrink to 2 (3 cannot keep the batch).
    two = elastic.decide(
        [4, 2], running=4, lost_at=0.0, available=3, now=10, wait_seconds=1, checkpoint_since_capacity=False
    )
    assert (two.action, two.slices) == ("relaunch", 2)


@settings(max_examples=200, deadline=None)
@given(
    full=st.integers(1, 6),
    data=st.data(),
    wait=st.floats(0, 1000),
    now=st.floats(0, 5000),
    checkpoint=st.booleans(),
)
def test_the_policy_never_relaunches_beyond_capacity_or_before_the_wait(full, data, wait, now, checkpoint):
    runnable = sorted(data.draw(st.sets(st.integers(1, full), max_size=full)) | {full}, reverse=True)
    running = data.draw(st.sampled_from(runnable))
    available = data.draw(st.integers(0, full))
    lost_at = data.draw(st.none() | st.floats(0, 5000))
    decision = elastic.decide(
        runnable,
        running=running,
        lost_at=lost_at,
        available=available,
        now=now,
        wait_seconds=wait,
        checkpoint_since_capacity=checkpoint,
    )
    if decision.action == "relaunch":
        assert decision.slices in runnable and decision.slices <= available
        if decision.slices < running:
            assert lost_at is not None and now >= lost_at + wait  # shrink only after the wait
        if lost_at is None:
            assert checkpoint and decision.slices > running  # grow only at a checkpoint
    elif decision.action == "wait":
        assert lost_at is not None
    else:
        assert decision.action == "keep" and lost_at is None


def test_goodput_counts_each_step_once_and_the_timeline_shows_each_size():
    records = [{"step": s, "perf/step_time_seconds": 1.0, "slices": 2} for s in range(0, 6)]
    records += [{"step": s, "perf/step_time_seconds": 2.0, "slices": 1} for s in range(4, 9)]  # restored from 3
    records += [{"step": s, "perf/step_time_seconds": 1.0, "slices": 2} for s in range(9, 12)]
    value, lost = elastic.goodput(records, wall_seconds=30.0)
    assert lost == 2  # steps 4 and 5 were trained again on 1 slice
    assert value == pytest.approx((4 * 1.0 + 5 * 2.0 + 3 * 1.0) / 30.0)
    assert elastic.slice_timeline(records) == [
        {"first_step": 0, "last_step": 5, "slices": 2},
        {"first_step": 4, "last_step": 8, "slices": 1},
        {"first_step": 9, "last_step": 11, "slices": 2},
    ]
    assert elastic.goodput(records, 0) == (0.0, 2)


def test_a_checkpoint_committed_while_stopping_whose_step_was_never_logged_is_discarded(tmp_path):
    from multislice import storage

    checkpoints = tmp_path / "checkpoints"
    for number in (0, 3, 6, 9):  # 9: committed by the stopping workload, after the grow back was decided at 6
        (checkpoints / str(number)).mkdir(parents=True)
        (checkpoints / str(number) / storage.COMMIT_FILE).write_text("")
    (checkpoints / "12").mkdir()  # an uncommitted attempt: not a checkpoint, left alone
    # The last line read was step 7 (MaxText prints step 8's only when step 9 completes).
    assert elastic.discard_unlogged_checkpoints(str(checkpoints), logged_step=7, kept_step=6) == [9]
    assert storage.committed_steps(checkpoints) == [0, 3, 6] and (checkpoints / "12").is_dir()
    # A resumed run's earlier checkpoints have no line in this run: kept_step protects them.
    assert elastic.discard_unlogged_checkpoints(str(checkpoints), logged_step=None, kept_step=6) == []
    assert elastic.discard_unlogged_checkpoints(str(checkpoints), logged_step=4, kept_step=3) == [6]
    assert storage.committed_steps(checkpoints) == [0, 3]


def test_the_train_pages_show_goodput_the_slice_timeline_and_each_resize():
    from multislice.delivery import artifacts
    from multislice.reports import TrainReport

    records = [{"step": s, "perf/step_time_seconds": 1.0, "learning/loss": 7.0 - s / 10, "slices": 2} for s in range(4)]
    records += [{"step": s, "perf/step_time_seconds": 2.0, "learning/loss": 7.0 - s / 10, "slices": 1} for s in (3, 4)]
    resize = elastic.Resize(
        from_slices=2, to_slices=1, cause="a slice was lost", detected_at_seconds=4.0, resumed_at_seconds=9.5,
        last_step_before=3, resumed_from_step=2, steps_lost=1, cost_seconds=5.5, last_loss_before=6.7,
        first_loss_after=6.7,
    )  # fmt: skip
    value, lost = elastic.goodput(records, 16.0)
    report = TrainReport(
        jobset="run-stage", steps_trained=5, restarts=0, wall_seconds=16.0, first_step=0, last_step=4, first_loss=7.0,
        final_loss=6.6, step_time_seconds=1.2, tokens_per_second_per_device=10.0, tflops_per_second_per_device=0.1,
        records=6, goodput=value, steps_lost=lost, resizes=[resize], slice_timeline=elastic.slice_timeline(records),
        global_batch_size=16,
    )  # fmt: skip
    text = artifacts.train_markdown("stage", report)
    assert "## elastic" in text and "Goodput 43.8%" in text and "1 resize(s), 1 step(s) trained again" in text
    assert "global batch stayed 16 sequences" in text and "a slice was lost" in text
    page = artifacts.train_html("stage", report, records)
    assert "slice count per step and resizes" in page and "<td>a slice was lost</td>" in page
    assert report.to_dict()["resizes"][0]["cost_seconds"] == 5.5
