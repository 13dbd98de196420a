"""Predicted goodput of the seed stages (``gke-v6e-16x2-seed``: Llama 3 8B and 70B on 2 x v6e-16) against MTBI.

Usage::

    python -m benchmarks.goodput_model [--json benchmarks/results/goodput_model.json]

Prints, per stage, the expected goodput (:func:`multislice.goodput_model.expected_goodput`) at one interruption
per 4, 24 and 168 hours, with and without emergency checkpoints and the persistent compilation cache (and, for
the elastic 8B stage, shrinking instead of waiting), the restart's phases, and Young's optimum persistent period.
The stages' shapes (parameters, slices, chips, ``checkpoint_period``) come from the profile; every other figure
is in :data:`FIGURES` with its source. docs/goodput.md holds the table this prints.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from multislice import config, memory
from multislice.goodput_model import Interruption, Phase, Restart, Stage, expected_goodput
from multislice.plan import make_plan

PROFILE = "gke-v6e-16x2-seed"
HOURS = (4, 24, 168)
GB = 1e9

#: Every figure the model takes that the profile does not give: (value, unit, source).
FIGURES: dict[str, tuple[float, str, str]] = {
    "step_seconds/llama3-8b": (
        3.393,
        "s",
        "MaxText tpu-recipes, training/trillium Llama3.1-8B-MaxText on v6e-16 (2 x v6e-8, Pathways "
        "resiliency README): 'completed step: 14, seconds: 3.393, Tokens/s/device: 7243.378' at 24,576 tokens "
        "per chip per step (the seed stage trains 16,384, so its step is shorter: 2.26 s at the same rate)",
    ),
    "step_seconds/llama3-70b": (
        17.790,
        "s",
        "issue 28's figure for MaxText tpu-recipes Llama 3.1 70B on v6e-32 (the line was not in the "
        "stored tpu-recipes copy; unverified). The v6e-256 recipe (llama3_1_70b_8192, per-device batch 5) logs "
        "960.248 tokens/s/device: 4.27 s for the seed's 4,096 tokens per chip, without its host-offloaded optimizer",
    ),
    "checkpoint_bytes_per_parameter": (
        12,
        "B",
        "float32 parameters + AdamW mu and nu (MaxText weight_dtype float32, base.yml; docs/delivery.md: "
        "8B x 12 B = 96 GB, 70B x 12 B = 847 GB)",
    ),
    "device_to_host_per_chip": (
        32 * GB,
        "B/s",
        "cited: an async save blocks for the HBM -> host copy, 'device/host transfer bandwidth (e.g. 32 GB/s with "
        "TPU PCIe Gen5)', Orbax's Maximizing Performance guide (orbax.readthedocs.io, "
        "guides/checkpoint/v1/maximizing_performance)",
    ),
    "gcs_read_per_host": (
        1 * GB,
        "B/s",
        "assumed (no measured figure for a v6e host reading Orbax OCDBT shards from Cloud Storage); "
        "measure with the restore line the train report reads ('Finished load in S seconds')",
    ),
    "local_read_per_host": (
        10 * GB,
        "B/s",
        "assumed: emergency restore from node-local RAM disk / peers' host memory",
    ),
    "detect_and_reschedule": (
        60,
        "s",
        "assumed: the JobSet's failure policy recreates every child Job (all pods) after one fails; the "
        "local backend's supervisor does it in about 13 s under load (benchmarks/README.md, elastic policy)",
    ),
    "image_pull": (
        80,
        "s",
        "the trainer environment is about 8 GB (docs/delivery.md) at an assumed 100 MB/s from Artifact "
        "Registry, on a replacement node; GKE image streaming would cut it",
    ),
    "startup": (
        34.3,
        "s",
        "measured on this machine: process start and imports of a train task, `make run` stage 1 "
        "(benchmarks/README.md, Train start-up); JAX TPU runtime init is in the next figure",
    ),
    "tpu_runtime_init": (10, "s", "assumed: libtpu initialisation and the slice's ICI handshake"),
    "compile_cold/llama3-8b": (
        306,
        "s",
        "measured on this machine: the AOT compile of the default llama3-8b stage for 2 x v6e-16, cold "
        "(benchmarks/README.md, preflight table): the same XLA TPU compiler and programs, on 2 shared cores",
    ),
    "compile_cold/llama3-70b": (
        254,
        "s",
        "measured on this machine: the AOT compile of the default llama3-70b stage for 2 x v6e-16, cold "
        "(benchmarks/README.md, preflight table)",
    ),
    "compile_cached_fraction": (
        0.7 / 24.0,
        "",
        "measured on this machine: the train step 24.0 s compiled, 0.7 s loaded from the persistent "
        "cache on the restarted attempt (docs/reliability.md, compile once per shape)",
    ),
    "capacity_wait": (
        600,
        "s",
        "assumed: an interruption that takes a node (Spot preemption, maintenance, hardware) waits for a "
        "replacement TPU node pool's capacity; GKE documents no bound",
    ),
    "emergency_period_steps": (10, "steps", "a choice: local_checkpoint_period (MaxText base.yml) of 10 steps"),
    "emergency_coverage": (
        0.9,
        "",
        "assumed: the share of interruptions that leave a peer's in-memory copy (Orbax's emergency "
        "checkpoint manager replicates across slices; losing every slice at once falls back to the persistent tier)",
    ),
}


#: The restart-cost model's figures (:func:`interruptions`): (value, unit, source). "measured here" figures are in
#: ``benchmarks/results/restart_phases.json`` (``python -m benchmarks.restart_phases``) or the files named.
RESTART_FIGURES: dict[str, tuple[float, str, str]] = {
    "detection": (
        1.0,
        "s",
        "cited: the kubelet notices a container's exit at its next PLEG relist, every 1 s "
        "(kubernetes pkg/kubelet/kubelet.go, genericPlegRelistPeriod = time.Second * 1); the Job and JobSet "
        "controllers act on the watch event that follows",
    ),
    "recreate": (
        60.0,
        "s",
        "assumed (the figure the goodput model had, 'detect_and_reschedule'): the JobSet controller deletes every "
        "child Job, the pods terminate (terminationGracePeriodSeconds 30, rendered), new Jobs and pods are created "
        "and scheduled (JobSet KEP-467 'Motivation': 'several minutes' at >= 1,000 nodes); the local supervisor "
        "does its equivalent in about 13 s (benchmarks/README.md)",
    ),
    "in_place": (
        4.0,
        "s",
        "cited parts, summed: the training container exits on SIGTERM at once (Python's default action) and "
        "the kubelet restarts all containers of the pod (RestartAllContainers, KEP-5532) after a PLEG relist "
        "(1 s, above); each restarted agent patches its pod's in-place-restart-attempt annotation, the JobSet "
        "controller raises previousInPlaceRestartAttempt, the other agents exit, then all agents' attempts agree "
        "and the controller sets currentInPlaceRestartAttempt (jobset v0.12.0 pkg/controllers/in_place_restart.go, "
        "cmd/in-place-restart-agent/main.go): two API round trips, **assumed** 1 s each; the agent's startup "
        "probe polls every 1 s (periodSeconds: 1, the upstream example jobset-sidecar-container-mode.yaml)",
    ),
    "pod_start_recreate": (
        5.0,
        "s",
        "assumed: a new pod's sandbox, volumes (the checkpointing CSI driver's, the service account token) and "
        "containers on a node that has the image (imagePullPolicy IfNotPresent, rendered)",
    ),
    "imports": (
        10.33,
        "s",
        "measured here: median wall of a fresh trainer interpreter importing what the worker imports, with the "
        "worker's multislice.trainer.lean_imports (benchmarks/results/train_startup.json, 'lean'; 16.97 s as MaxText "
        "0.2.5 imports without it), 2 cores at load 3-10; a TPU host has 180 vCPUs (ct6e-standard-4t, "
        "cloud.google.com/tpu/docs/v6e)",
    ),
    "tpu_runtime_init": (10.0, "s", "assumed: libtpu initialisation and the slice's ICI handshake"),
    "jax_distributed": (
        0.97,
        "s",
        "measured here: jax.distributed.initialize of 2 processes on a new coordinator port, the slowest of "
        "3 repeats, 0.005-0.97 s (benchmarks/results/restart_phases.json); the barrier is already met: the "
        "agents lift it together",
    ),
    "local_tier_read_per_core": (
        0.42e9,
        "B/s",
        "measured here: Orbax StandardCheckpointer restoring float32 arrays from tmpfs (/dev/shm), CPU-bound: "
        "0.41-0.45 GB/s on 1 core, 0.78-0.89 GB/s on 2 (benchmarks/results/restart_phases.json, "
        "orbax_restore_tmpfs)",
    ),
    "tpu_host_vcpus": (180, "", "cited: ct6e-standard-4t, 180 vCPUs (cloud.google.com/tpu/docs/v6e)"),
    "local_tier_parallel_efficiency": (
        0.25,
        "",
        "assumed: the share of the host's vCPUs the restore's per-core rate scales to (2 cores gave 1.7x 1 core here)",
    ),
    "local_period_steps/llama3-8b": (10, "steps", "a choice: local_checkpoint_period of the 8B stage"),
    "local_period_steps/llama3-70b": (5, "steps", "a choice: local_checkpoint_period of the 70B stage"),
}


def restart_figure(key: str) -> float:
    """A restart-cost figure's value (:data:`RESTART_FIGURES`)."""
    return float(RESTART_FIGURES[key][0])


def _source(key: str) -> str:
    return RESTART_FIGURES[key][2] if key in RESTART_FIGURES else FIGURES[key][2]


def interruptions() -> list[tuple[Interruption, Interruption]]:
    """Per seed stage, one interruption before (``Recreate``, persistent checkpoints only, restored from Cloud
    Storage) and after issue 41 (``InPlaceRestart``, the emergency tier restored from the node), phase by phase.

    Both assume the interruption leaves the nodes (a process or runtime failure, a link flap): a lost node adds the
    capacity wait and a replacement node's image pull to either (:func:`seed_stages`' ``capacity_wait``).
    """
    out = []
    for stage in seed_stages():
        name = stage.name
        plan_stage = _plan_stage(name)
        step = stage.step_seconds
        per_host, per_chip = plan_stage
        restart = stage.restart
        h2d = per_chip / figure("device_to_host_per_chip")
        save = h2d  # an async save blocks for the device-to-host copy (same PCIe figure)
        local_read = restart_figure("local_tier_read_per_core") * restart_figure("tpu_host_vcpus")
        local_read *= restart_figure("local_tier_parallel_efficiency")
        local_period = int(restart_figure(f"local_period_steps/{name}"))
        local_choice = RESTART_FIGURES[f"local_period_steps/{name}"][2]
        common_head = [Phase("detection", restart_figure("detection"), _source("detection"))]
        starting = [
            Phase("image (already on the node)", 0.0, "imagePullPolicy IfNotPresent (rendered); same nodes"),
            Phase("imports", restart_figure("imports"), _source("imports")),
            Phase("TPU runtime init", restart_figure("tpu_runtime_init"), _source("tpu_runtime_init")),
            Phase("jax.distributed", restart_figure("jax_distributed"), _source("jax_distributed")),
            Phase("compile (cache hit)", round(restart.compile_cached, 2), _source("compile_cached_fraction")),
        ]
        first = Phase("first step", 0.0, "counted productive at the steady step time; its excess is the compile")
        persistent_tau = stage.persistent_period_steps * step
        before = Interruption(
            name,
            "Recreate",
            (
                *common_head,
                Phase("JobSet restart (Recreate)", restart_figure("recreate"), _source("recreate")),
                Phase("pod start", restart_figure("pod_start_recreate"), _source("pod_start_recreate")),
                *starting,
                Phase(
                    "restore (Cloud Storage)",
                    round(per_host / figure("gcs_read_per_host"), 2),
                    _source("gcs_read_per_host"),
                ),  # fmt: skip
                Phase(
                    f"steps redone (half of {stage.persistent_period_steps})",
                    round(persistent_tau / 2, 2),
                    "half the persistent period on average (checkpoint_period, the profile)",
                ),  # fmt: skip
                first,
            ),
            save / (persistent_tau + save),
        )
        local_tau = local_period * step
        after = Interruption(
            name,
            "InPlaceRestart",
            (
                *common_head,
                Phase("in-place restart", restart_figure("in_place"), _source("in_place")),
                Phase("pod start (the pod stays)", 0.0, "no new pod: containers restart in place (KEP-467)"),
                *starting,
                Phase(
                    "restore (local tier)",
                    round(per_host / local_read + h2d, 2),
                    f"{_source('local_tier_read_per_core')}; x {_source('tpu_host_vcpus')} x "
                    f"{restart_figure('local_tier_parallel_efficiency')} (assumed efficiency); plus host to HBM at "
                    "the device_to_host_per_chip figure",
                ),  # fmt: skip
                Phase(
                    f"steps redone (half of {local_period})",
                    round(local_tau / 2, 2),
                    f"half the local period on average ({local_choice})",
                ),  # fmt: skip
                first,
            ),
            save / (persistent_tau + save) + save / (local_tau + save),
        )
        out.append((before, after))
    return out


def _plan_stage(name: str) -> tuple[float, float]:
    """The stage's train state per host and per chip, bytes (12 B per parameter; replicated over DCN data)."""
    plan = make_plan(config.load_spec(config.read_profile(PROFILE)))
    stage = next(s for s in plan.spec.stages if s.name == name)
    dims = memory.model_dims(stage)
    assert dims is not None, name
    state = dims.parameters * figure("checkpoint_bytes_per_parameter")
    replicas = stage.dcn.get("data", plan.spec.num_slices if not stage.dcn else 1)
    return (state * replicas / (plan.slice.hosts * plan.spec.num_slices),
            state * replicas / (plan.slice.chips * plan.spec.num_slices))  # fmt: skip


def figure(key: str) -> float:
    """A figure's value (:data:`FIGURES`)."""
    return float(FIGURES[key][0])


def seed_stages() -> list[Stage]:
    """The profile's stages as the model sees them (sizes from the profile, times from :data:`FIGURES`)."""
    plan = make_plan(config.load_spec(config.read_profile(PROFILE)))
    stages = []
    for stage in plan.spec.stages:
        dims = memory.model_dims(stage)
        assert dims is not None, stage.name
        name = stage.model.name or stage.name
        state_bytes = dims.parameters * figure("checkpoint_bytes_per_parameter")
        chips = plan.slice.chips * plan.spec.num_slices
        hosts = plan.slice.hosts * plan.spec.num_slices
        replicas = stage.dcn.get("data", plan.spec.num_slices if not stage.dcn else 1)  # DCN data: replicated state
        per_chip = state_bytes * replicas / chips
        per_host = state_bytes * replicas / hosts
        save = per_chip / figure("device_to_host_per_chip")
        cold = figure(f"compile_cold/{name}")
        restart = Restart(
            detect_and_reschedule=figure("detect_and_reschedule"),
            image_pull=figure("image_pull"),
            startup=figure("startup") + figure("tpu_runtime_init"),
            compile_cold=cold,
            compile_cached=cold * figure("compile_cached_fraction"),
            restore_persistent=per_host / figure("gcs_read_per_host"),
            restore_emergency=per_host / figure("local_read_per_host"),
        )
        stages.append(
            Stage(
                name=stage.name,
                step_seconds=figure(f"step_seconds/{name}"),
                slices=plan.spec.num_slices,
                persistent_period_steps=stage.checkpoint_period,
                persistent_save_blocking=save,
                restart=restart,
                emergency_period_steps=int(figure("emergency_period_steps")),
                emergency_save_blocking=save,
                emergency_coverage=figure("emergency_coverage"),
                capacity_wait=figure("capacity_wait"),
            )
        )
    return stages


#: The table's columns: (label, emergency, compile_cache, elastic).
CHOICES = (
    ("persistent only", False, False, False),
    ("+ compile cache", False, True, False),
    ("+ emergency", True, False, False),
    ("+ both", True, True, False),
    ("+ both, elastic", True, True, True),
)


def predictions() -> dict:
    """Per stage: its inputs, the restart's phases and the predicted goodput per MTBI and choice."""
    out: dict = {"profile": PROFILE, "figures": {k: {"value": v, "unit": u, "source": s}
                                                   for k, (v, u, s) in FIGURES.items()}, "stages": []}  # fmt: skip
    for stage in seed_stages():
        rows = []
        for hours in HOURS:
            row: dict = {"mtbi_hours": hours}
            for label, emergency, cache, elastic in CHOICES:
                predicted = expected_goodput(
                    stage, hours * 3600.0, emergency=emergency, compile_cache=cache, elastic=elastic
                )
                row[label] = round(predicted.goodput, 4)
                row["young_period_steps"] = round(predicted.young_period_steps)
            rows.append(row)
        restart = stage.restart
        out["stages"].append(
            {
                "name": stage.name,
                "step_seconds": stage.step_seconds,
                "persistent_period_steps": stage.persistent_period_steps,
                "save_blocking_seconds": round(stage.persistent_save_blocking, 2),
                "restart_seconds": {
                    "detect_and_reschedule": restart.detect_and_reschedule,
                    "image_pull": restart.image_pull,
                    "startup": restart.startup,
                    "compile_cold": restart.compile_cold,
                    "compile_cached": round(restart.compile_cached, 1),
                    "restore_persistent": round(restart.restore_persistent, 1),
                    "restore_emergency": round(restart.restore_emergency, 1),
                },
                "goodput": rows,
            }
        )
    return out


#: This machine's train-task phases, `make run` stage 1 (benchmarks/README.md, Train start-up): process start and
#: imports, setup, XLA compile, first step and eval, teardown; seconds.
MEASURED_PHASES = {"startup": 34.3, "setup": 3.9, "compile": 42.9, "first_step_and_eval": 16.0, "teardown": 8.2}


def calibration(soak: Path = Path(__file__).parent / "results" / "kill_soak.json") -> dict:
    """The model's restart against this machine's kill soak (``benchmarks/results/kill_soak.json``).

    The soak's wall time is the undisturbed run's plus, per kill, a restart and the steps trained again:
    ``wall = undisturbed + kills x R + steps_lost x step``. Predicted with ``R`` the sum of this machine's
    measured phases (:data:`MEASURED_PHASES`), and ``R`` solved from the measured wall; goodput is the
    undisturbed time over the wall (a wall-time ratio, not Google's goodput).
    """
    data = json.loads(soak.read_text(encoding="utf-8"))
    wall, kills = data["soak"]["seconds"], data["soak"]["kills_done"]
    undisturbed, step = data["baseline"]["seconds"], data["baseline"]["median_step_seconds"]
    lost = data["soak"]["steps_lost_total"] * step
    phases = sum(MEASURED_PHASES.values())
    predicted_wall = undisturbed + kills * phases + lost
    return {
        "kills": kills,
        "soak_wall_seconds": wall,
        "restart_from_measured_phases_seconds": round(phases, 1),
        "restart_implied_by_soak_seconds": round((wall - undisturbed - lost) / kills, 1),
        "predicted_wall_seconds": round(predicted_wall, 1),
        "undisturbed_over_wall_predicted": round(undisturbed / predicted_wall, 3),
        "undisturbed_over_wall_measured": round(undisturbed / wall, 3),
    }


def markdown(result: dict) -> str:
    """The predictions as the Markdown table docs/goodput.md holds."""
    labels = [label for label, *_ in CHOICES]
    lines = [
        "| stage | MTBI | " + " | ".join(labels) + " | Young's period |",
        "|---|---|" + "---|" * len(labels) + "---|",
    ]
    for stage in result["stages"]:
        for row in stage["goodput"]:
            lines.append(
                f"| {stage['name']} | {row['mtbi_hours']} h | "
                + " | ".join(f"{row[label]:.3f}" for label in labels)
                + f" | {row['young_period_steps']} steps |"
            )
    return "\n".join(lines)


def interruption_table(pairs: list[tuple[Interruption, Interruption]]) -> str:
    """One interruption of each seed stage, phase by phase, before and after, as docs/goodput.md holds it."""
    lines = ["| phase | " + " | ".join(f"{b.stage} before | {b.stage} after" for b, _ in pairs) + " |",
             "|---|" + "---:|---:|" * len(pairs)]  # fmt: skip
    names = [[p.name.split(" (")[0] for p in i.phases] for pair in pairs for i in pair]
    for row, phase in enumerate(names[0]):
        cells = []
        for before, after in pairs:
            cells += [f"{before.phases[row].seconds:g}", f"{after.phases[row].seconds:g}"]
        before_name, after_name = pairs[0][0].phases[row].name, pairs[0][1].phases[row].name
        label = phase if before_name.split(" (")[0] != after_name.split(" (")[0] else before_name.split(" (")[0]
        if before_name.split(" (")[0] != after_name.split(" (")[0]:
            label = f"{before_name} / {after_name}"
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    lines.append("| **one interruption** | " + " | ".join(
        f"**{b.seconds:.0f} s** | **{a.seconds:.0f} s**" for b, a in pairs) + " |")  # fmt: skip
    for hours in (4, 24):
        lines.append(f"| goodput at one per {hours} h | " + " | ".join(
            f"{b.goodput(hours * 3600):.4f} | {a.goodput(hours * 3600):.4f}" for b, a in pairs) + " |")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    """Print the predictions (and write them as JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the predictions and their figures here")
    args = parser.parse_args()
    result = predictions()
    result["calibration"] = calibration()
    pairs = interruptions()
    result["interruptions"] = [
        {"stage": i.stage, "strategy": i.strategy, "seconds": round(i.seconds, 1),
         "checkpoint_overhead": round(i.checkpoint_overhead, 4),
         "goodput": {f"{h} h": round(i.goodput(h * 3600.0), 4) for h in HOURS},
         "phases": [{"name": p.name, "seconds": p.seconds, "source": p.source} for p in i.phases]}
        for pair in pairs for i in pair
    ]  # fmt: skip
    for stage in result["stages"]:
        phases = ", ".join(f"{k} {v:g} s" for k, v in stage["restart_seconds"].items())
        print(f"{stage['name']}: step {stage['step_seconds']} s, save blocks {stage['save_blocking_seconds']} s "
              f"every {stage['persistent_period_steps']} steps; restart phases: {phases}")  # fmt: skip
    print(markdown(result))
    print(interruption_table(pairs))
    c = result["calibration"]
    print(
        f"calibration (this machine's kill soak, {c['kills']} kills): restart from the measured phases "
        f"{c['restart_from_measured_phases_seconds']} s, implied by the soak's wall "
        f"{c['restart_implied_by_soak_seconds']} s; predicted wall {c['predicted_wall_seconds']} s vs "
        f"{c['soak_wall_seconds']} s measured, undisturbed/wall {c['undisturbed_over_wall_predicted']} vs "
        f"{c['undisturbed_over_wall_measured']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
