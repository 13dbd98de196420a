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
from multislice.goodput_model import Restart, Stage, expected_goodput
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
        10 * GB,
        "B/s",
        "assumed: an async save blocks for the HBM -> host copy; v6e chips reach the host over PCIe "
        "Gen5 (cloud.google.com/tpu/docs/v6e), 64 GB/s per x16 direction, taken at about 1/6",
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
    undisturbed time over the wall, as the soak reports it.
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
        "goodput_predicted": round(undisturbed / predicted_wall, 3),
        "goodput_measured": data["soak"]["goodput"],
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


def main() -> None:
    """Print the predictions (and write them as JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--json", type=Path, help="write the predictions and their figures here")
    args = parser.parse_args()
    result = predictions()
    result["calibration"] = calibration()
    for stage in result["stages"]:
        phases = ", ".join(f"{k} {v:g} s" for k, v in stage["restart_seconds"].items())
        print(f"{stage['name']}: step {stage['step_seconds']} s, save blocks {stage['save_blocking_seconds']} s "
              f"every {stage['persistent_period_steps']} steps; restart phases: {phases}")  # fmt: skip
    print(markdown(result))
    c = result["calibration"]
    print(
        f"calibration (this machine's kill soak, {c['kills']} kills): restart from the measured phases "
        f"{c['restart_from_measured_phases_seconds']} s, implied by the soak's wall "
        f"{c['restart_implied_by_soak_seconds']} s; predicted wall {c['predicted_wall_seconds']} s vs "
        f"{c['soak_wall_seconds']} s measured, goodput {c['goodput_predicted']} vs {c['goodput_measured']}"
    )
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
