"""End to end on this machine: the pipeline trains both stages across emulated slices; a killed worker is survived."""

import json
from pathlib import Path

import pytest

from multislice import metrics, reports
from multislice.backends.local import LocalJobSets, pid_alive
from multislice.steps import admit, launch, prepare_data
from multislice.storage import latest_committed_step

pytestmark = pytest.mark.e2e


def test_run_trains_both_stages_and_verifies_their_checkpoints(local_run):
    assert local_run.returncode == 0, local_run.stdout[-3000:] + local_run.stderr[-3000:]
    out = local_run.stdout
    assert "run e2e: SUCCEEDED" in out
    plan = local_run.plan
    for stage in plan.stages:
        assert f"stage {stage.index + 1} {stage.name}" in out
        assert f"[preflight {stage.name}] fits on 2 x v5litepod-8" in out  # AOT-checked before provision
        assert latest_committed_step(stage.checkpoint_dir) == stage.final_step
        assert (Path(stage.checkpoint_dir) / str(stage.final_step) / "items").is_dir()
        trained = reports.read(reports.TrainReport, plan, stage)
        assert trained.steps_trained == stage.steps and trained.restarts == 0
        assert trained.final_loss < trained.first_loss  # it learned something
        verified = reports.read(reports.VerificationReport, plan, stage)
        assert verified.verdict == "PASS" and verified.latest_step == stage.final_step
        # Start-up: no torch, transformers, goodput recorder or Vertex AI SDK for the step loop
        # (multislice.trainer.lean_imports);
        # each process compiled the train step once, and said so (multislice.trainer.compile_cache).
        for host in range(plan.slice.hosts):
            log = LocalJobSets(plan.run_dir).pod_log(stage.jobset, 0, host, attempt=0).read_text()
            heavy = log.split("heavy packages imported: ")[1].split(" (of ")[0].split(", ")
            assert not {"torch", "transformers", "ml_goodput_measurement", "cloud_accelerator_diagnostics"} & set(heavy)
            assert "multislice worker: XLA compile of jit(train_step): " in log
        assert [c["function"] for c in trained.compiles].count("jit(train_step)") == 1
        for step in ("plan", "preflight", "admit", "launch"):  # every step left its report
            assert (Path(plan.run_dir) / "reports" / stage.name / f"{step}.json").is_file(), step
    assert reports.read(reports.ProvisionReport, plan).backend == "local"
    assert reports.read(reports.CleanupReport, plan).deleted == []
    assert out.count("verification  PASS") == 2
    # each stage's verifier ran in the process its train step started ahead (multislice.backends.local.warm_tools)
    assert out.count("in the verifier's process started during training (its imports done)") == 2
    assert not list((Path(plan.run_dir) / "warm").glob("*.json"))  # each used once, none left for cleanup
    assert out.count("preflight     fits:") == 2
    assert out.index("[preflight") < out.index("[provision")
    assert "trained       20/20 steps" in out


def test_stage_two_shards_fsdp_over_dcn(local_run):
    stage = local_run.plan.stages[1]
    leader = LocalJobSets(local_run.plan.run_dir).pod_log(stage.jobset, 0, 0)
    text = leader.read_text()
    assert "2 slices as DCN granules (slice 0: processes [0, 1]; slice 1: processes [2, 3])" in text
    assert "mesh fsdp=8 (ici 4 x dcn 2), tensor=2" in text
    verified = reports.read(reports.VerificationReport, local_run.plan, stage)
    assert verified.written_mesh == {"fsdp": 8, "tensor": 2}


def test_run_leaves_no_process_behind(local_run):
    states = LocalJobSets(local_run.plan.run_dir).list_jobsets()
    assert [s.phase for s in states] == ["Completed", "Completed"]
    for state in states:
        assert not pid_alive(state.supervisor_pid)
        assert not any(pid_alive(p.pid) for p in state.pods)


def test_two_local_runs_at_once_both_train_and_verify(local_runs):
    """The shared run and its twin started together in one output directory: no port or cache clash."""
    for run in local_runs:
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
        assert f"run {run.plan.spec.run_name}: SUCCEEDED" in run.stdout
        assert run.stdout.count("verification  PASS") == 2
        for state in LocalJobSets(run.plan.run_dir).list_jobsets():
            restarts = 1 if run.killed and state.name == run.killed.jobset else 0  # the twin's killed worker
            # restarts of either strategy (status.restarts counts only Recreate's; in place, the attempts)
            assert (state.phase, state.attempt) == ("Completed", restarts)
            # a free port per attempt, not 1234
            assert [e.reason for e in state.events].count("CoordinatorPort") == 1 + restarts
    assert "trained       6/6 steps" in local_runs[1].stdout
    # The twin is the single-slice run: one slice (child Job 0) of 8 chips, each stage's DCN degrees all 1.
    twin = local_runs[1]
    assert twin.plan.spec.num_slices == 1 and twin.plan.total_chips == twin.plan.slice.chips
    for stage in twin.plan.stages:
        assert set(stage.dcn.values()) == {1}
        state = LocalJobSets(twin.plan.run_dir).get_jobset(stage.jobset)
        assert {p.job_index for p in state.pods} == {0} and len(state.pods) == twin.plan.slice.hosts


def test_a_second_run_of_the_same_name_is_refused_before_writing_and_the_first_trains_on(local_run):
    """Issue 31: a second ``multislice run`` with the shared run's run_name and output directory, started while the
    shared run trains, is refused before it writes anything, naming the owner and the fix; the shared run is not
    harmed (its own assertions, here and above: it trained both stages and verified them, 0 restarts)."""
    intruder = local_run.intrusion
    assert intruder.owner_running, "the shared run ended before the second run was refused: nothing was tested"
    assert intruder.returncode == 2, intruder.stdout[-3000:] + intruder.stderr[-3000:]
    owner = json.loads(intruder.owner_before)
    assert f"is owned by run {owner['run_id']} (pipeline run {owner['pipeline_run_id']}, pid " in intruder.stderr
    assert "fix: set unique_run_name: true" in intruder.stderr and "Traceback" not in intruder.stderr
    assert intruder.stdout == "" and intruder.owner_after == intruder.owner_before
    ours = {f"pipeline.{owner['run_id']}.yaml", f"pipeline.{owner['run_id']}.log"}
    assert {name for name in intruder.after if name.startswith("pipeline.")} == ours  # no file of the second run
    assert set(intruder.before) <= set(intruder.after)
    assert local_run.returncode == 0 and f"run {local_run.plan.spec.run_name}: SUCCEEDED" in local_run.stdout
    assert local_run.stdout.count("verification  PASS") == 2


def test_a_killed_worker_restarts_the_jobset_which_resumes_from_its_checkpoint(local_runs):
    """The twin's stage 1 lost host 1 of its slice (SIGKILL) after its first periodic checkpoint
    (tests/conftest.py ``_kill_a_worker``): the JobSet restarted, the stage resumed from that checkpoint,
    trained to the end, and its final checkpoint verified."""
    twin = local_runs[1]
    killed, plan = twin.killed, twin.plan
    stage = plan.stages[0]
    assert killed is not None and killed.landed, "the twin's stage 1 ended before its worker could be killed"
    assert killed.jobset == stage.jobset and killed.after_step == stage.checkpoint_period
    report = reports.read(reports.TrainReport, plan, stage)
    assert report.restarts == 1 and len(report.leader_logs) == 2  # both attempts' leader logs were read
    assert report.steps_trained == stage.steps and report.last_step == stage.final_step
    backend = LocalJobSets(plan.run_dir)
    # a Job failure under restartStrategy Recreate, a pod failure restarted in place under InPlaceRestart
    failed = next(e for e in backend.get_jobset(stage.jobset).events if e.reason in ("JobFailed", "PodFailed"))
    assert f"{killed.pod} exited with code 137" in failed.message
    resumed = backend.pod_log(stage.jobset, 0, 0, attempt=1).read_text()
    step = int(resumed.split("restoring from this run's directory step ")[1].split()[0])
    assert step >= stage.checkpoint_period
    assert f"completed step: {step + 1}," in resumed and "completed step: 0," not in resumed
    # The restarted pods are new processes that start cold, as a cluster's containers (nothing is pre-started).
    assert "MaxText imported " in resumed and " s after the process started" in resumed
    assert reports.read(reports.VerificationReport, plan, stage).verdict == "PASS"
    assert "1 JobSet restarts" in twin.stdout
    # the restart's cause, in the report and the summary: the killed pod and its exit code (SIGKILL)
    assert len(report.restart_causes) == 1 and f"pod {killed.pod} exited with code 137" in report.restart_causes[0]
    assert f"  restart 1     {report.restart_causes[0]}" in twin.stdout
    # Compiled once per shape: every process of the restarted attempt loaded the train step from the run's
    # persistent compilation cache (jax_cache_dir; on CPU each process writes its own entries,
    # multislice.trainer.compile_cache), in less time than the first attempt compiled it.
    (first,) = [c for c in report.compiles if c["attempt"] == 0 and c["function"] == "jit(train_step)"]
    (again,) = [c for c in report.compiles if c["attempt"] == 1 and c["function"] == "jit(train_step)"]
    assert not first["cache_hit"] and again["cache_hit"] and again["seconds"] < first["seconds"]
    for host in range(plan.slice.hosts):
        lines = backend.pod_log(stage.jobset, 0, host, attempt=1).read_text().splitlines()
        steps = [c for c in map(metrics.parse_compile_line, lines) if c and c["function"] == "jit(train_step)"]
        assert len(steps) == 1 and steps[0]["cache_hit"], (host, steps)
    by_attempt = metrics.compile_seconds_by_attempt(report.compiles)  # both attempts' compile times, told
    assert len(by_attempt) == 2 and by_attempt[1][1] >= 1
    told = ", ".join(f"{t:.1f} s ({hits}/{count} from the cache)" for t, hits, count in by_attempt)
    assert f"XLA compile per attempt: {told}" in twin.stdout


def test_a_rerun_of_the_same_run_does_not_train_a_finished_stage_again(local_run):
    plan = local_run.plan
    jobsets = LocalJobSets(plan.run_dir)
    before = [s.name for s in jobsets.list_jobsets()]
    report = admit.run(plan, plan.stages[0], "a-later-pipeline-run")
    assert report.skipped is True and report.reason == "final checkpoint exists"
    assert [s.name for s in jobsets.list_jobsets()] == before
    assert launch.run(plan, plan.stages[0], report.to_dict()).skipped is True


def test_both_stages_train_on_the_prepared_corpus_and_eval_loss_falls(local_run):
    plan = local_run.plan
    for stage in plan.stages:
        prepared = reports.read(reports.PrepareDataReport, plan, stage)
        assert prepared.uri == stage.data_dir and prepared.manifest["tokenizer"]["vocab_size"] == 128256
        assert f"grain_train_files={stage.data_dir}/train-*.array_record" in stage.maxtext_args
        trained = reports.read(reports.TrainReport, plan, stage)
        assert trained.evals == 4  # after steps 0, 5, 10 and 15 (eval_interval 5)
        assert trained.final_eval_loss < trained.first_eval_loss - 1.0, trained  # it learned the corpus
        assert f"eval          loss {trained.first_eval_loss:.3f} -> {trained.final_eval_loss:.3f}" in local_run.stdout
    # the two stages share one recipe: stage 2 reused stage 1's shards
    assert reports.read(reports.PrepareDataReport, plan, plan.stages[1]).reused


def test_a_rerun_on_unchanged_data_reuses_the_shards(local_run):
    stage = local_run.plan.stages[0]
    shards = {p: p.stat().st_mtime_ns for p in Path(stage.data_dir).glob("*.array_record")}
    report = prepare_data.run(local_run.plan, stage)
    assert report.reused and shards  # hashing the sources only: no shard is written again
    assert {p: p.stat().st_mtime_ns for p in Path(stage.data_dir).glob("*.array_record")} == shards
