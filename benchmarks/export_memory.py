"""Peak memory of the Hugging Face export and its check at several model depths: flat in depth, bounded by a layer.

Writes a checkpoint of the tiny Llama 3 preset (``configs/models/llama3-tiny.yaml``'s dims) at 2, 4 and 8
decoder layers (:data:`MAKE_CHECKPOINT`: MaxText's own model initialised and saved by Orbax in the layout MaxText
trains with, ``params``/``opt_state``/``step`` with scanned layers: the cheapest real checkpoint, no training
step), exports each with ``python -m multislice.trainer.export`` in its own trainer-environment process and reads
the report's memory figures: the conversion's peak RSS (``getrusage``), the largest layer group's bytes and the
check's peak. Results go to ``benchmarks/results/export_memory.json``::

    heavy .venvs/pipeline/bin/python -m benchmarks.export_memory [--depths 2 4 8] [--emb 64]
    heavy .venvs/pipeline/bin/python -m benchmarks.export_memory --shape llama3-3b --depths 4 28

``--emb`` widens the model (``base_emb_dim``, ``base_mlp_dim`` = 4 x emb, heads of 16) so a layer weighs more
than the process's baseline and a conversion that held every layer would show it. ``--shape`` takes a real Llama 3
width (:data:`SHAPES`: the dims of Meta's ``config.json``) with its depth from ``--depths``, written in bfloat16
(``weight_dtype=bfloat16``, as a bf16 checkpoint of that model) with MaxText's own initialisation (no
scaling) and unscanned layers (``scan_layers=false``: each layer its own arrays; a scanned checkpoint's stacked
arrays are one storage chunk each here, a single device's, so every layer's read would decode all layers: the
read amplification docs/delivery.md describes, which measures the storage, not the exporter's memory), and
exported in the default dtype (bfloat16 from a billion parameters). Each row has the writer's, the
exporter's (conversion and check, each its own peak) and each loader's peak RSS, and the phases' seconds.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from multislice.backends.local.environment import trainer_env, trainer_process_env

#: The tiny preset's dims as MaxText arguments (``configs/models/llama3-tiny.yaml``), without the depth.
TINY = [
    "decoder_block=llama2", "base_num_query_heads=4", "base_num_kv_heads=2", "head_dim=16",
    "vocab_size=128256", "mlp_activations=[silu,linear]", "rope_max_timescale=500000",
    "normalization_layer_epsilon=1e-5", "logits_via_embedding=false", "enable_dropout=false",
    "max_target_length=64", "per_device_batch_size=1", "run_name=export-bench",
]  # fmt: skip

#: Writes ``<dir>/<step>/items`` for the MaxText arguments after it (trainer environment): MaxText's model
#: (``model_creation_utils.from_config``) initialised, its parameters unboxed and scaled so logits are large
#: enough to tell a wrong conversion, saved with Orbax's ``PyTreeCheckpointer`` (OCDBT, as MaxText saves).
MAKE_CHECKPOINT = """
import os, sys
import flax.linen as nn
import jax, jax.numpy as jnp, orbax.checkpoint as ocp
from etils import epath
from multislice.trainer import verify
from maxtext.utils import model_creation_utils
out, step, args = sys.argv[1], sys.argv[2], sys.argv[3:]
jax.config.update("jax_default_prng_impl", "unsafe_rbg")
cfg = verify._config(args)
model = model_creation_utils.from_config(cfg)
ids = jnp.zeros((1, 8), jnp.int32)
key = jax.random.PRNGKey(0)
# one XLA program: the parameters are made in weight_dtype, not op by op through float32 copies (an 8B model's
# 16 GB in bfloat16 is written in 24 GiB)
init = jax.jit(lambda key: nn.unbox(model.init({"params": key, "aqt": key, "dropout": key}, ids, jnp.arange(8)[None],
                                               decoder_segment_ids=jnp.ones_like(ids), enable_dropout=False)))
params = init(key)
def spread(x):
    return x * 10 if x.ndim >= 2 else x + 0.01 * jnp.arange(x.size).reshape(x.shape)
if os.environ.get("SPREAD", "1") == "1":
    params = jax.tree_util.tree_map(spread, params)
state = {"params": params, "opt_state": {"count": jnp.zeros((), jnp.int32)}, "step": jnp.asarray(int(step), jnp.int32)}
ocp.PyTreeCheckpointer().save(epath.Path(out) / step / "items", args=ocp.args.PyTreeSave(state))
import resource
print("PEAK_RSS", resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""

#: Real Llama 3 widths (Meta's ``config.json`` of each model): MaxText arguments without the depth. ``llama3-3b``
#: is Llama 3.2 3B's width with an untied output head (the exporter's Llama; 3.2 3B itself ties them).
SHAPES = {
    "llama3-8b": ["base_emb_dim=4096", "base_mlp_dim=14336", "base_num_query_heads=32", "base_num_kv_heads=8",
                  "head_dim=128"],
    "llama3-3b": ["base_emb_dim=3072", "base_mlp_dim=8192", "base_num_query_heads=24", "base_num_kv_heads=8",
                  "head_dim=128"],
}  # fmt: skip


def write_checkpoint(directory: Path, step: int, maxtext_args: list[str], spread: bool = True) -> int | None:
    """A checkpoint of the model ``maxtext_args`` describe at ``directory/step/items`` (:data:`MAKE_CHECKPOINT`);
    ``spread``: its weights scaled (x10) so the tiny models' logits are large; else MaxText's initialisation.

    Returns:
        The writer's peak RSS, bytes (None when it did not say).

    Raises:
        RuntimeError: the trainer-environment process failed (its stderr's end).
    """
    python = trainer_env() / "bin" / "python"
    done = subprocess.run(
        [str(python), "-c", MAKE_CHECKPOINT, str(directory), str(step), *maxtext_args],
        capture_output=True, text=True, env={**trainer_process_env(trainer_env()), "SPREAD": "1" if spread else "0"},
    )  # fmt: skip
    if done.returncode != 0:
        raise RuntimeError(f"checkpoint not written: {done.stderr[-3000:]}")
    peaks = [int(line.split()[1]) for line in done.stdout.splitlines() if line.startswith("PEAK_RSS ")]
    return peaks[-1] if peaks else None


def arguments(shape: str | None, depth: int, emb: int) -> list[str]:
    """MaxText arguments of one row: a real width (:data:`SHAPES`, bfloat16 weights) or the tiny preset at ``emb``."""
    if shape:
        base = [a for a in TINY if not a.startswith(("base_num_query_heads", "base_num_kv_heads", "head_dim"))]
        return [*base, *SHAPES[shape], f"base_num_decoder_layers={depth}", "weight_dtype=bfloat16", "scan_layers=false"]
    args = [*TINY, f"base_num_decoder_layers={depth}", f"base_emb_dim={emb}", f"base_mlp_dim={4 * emb}"]
    if emb != 64:
        args = [a for a in args if not a.startswith(("base_num_query_heads", "base_num_kv_heads"))]
        args += [f"base_num_query_heads={emb // 16}", f"base_num_kv_heads={emb // 32}"]
    return args


def main(argv: list[str] | None = None) -> int:
    """Measure and write ``benchmarks/results/export_memory.json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--emb", type=int, default=64, help="base_emb_dim (the tiny preset's is 64)")
    parser.add_argument("--shape", choices=sorted(SHAPES), help="a real Llama 3 width instead of --emb")
    parser.add_argument("--scratch", default=None, help="where checkpoints and exports are written (disk: GBs)")
    parser.add_argument("--out", default="benchmarks/results/export_memory.json")
    options = parser.parse_args(argv)
    python = trainer_env() / "bin" / "python"
    rows = []
    loads = [os.getloadavg()]
    for depth in options.depths:
        args = arguments(options.shape, depth, options.emb)
        with tempfile.TemporaryDirectory(dir=options.scratch) as scratch:
            started = time.time()
            writer_peak = write_checkpoint(Path(scratch) / "checkpoints", 1, args, spread=not options.shape)
            written = time.time() - started
            started = time.time()
            report_file = Path(scratch) / "export.json"
            done = subprocess.run(
                [str(python), "-m", "multislice.trainer.export", "--checkpoint-dir", f"{scratch}/checkpoints",
                 "--step", "1", "--output", f"{scratch}/export", "--report", str(report_file), "--", *args],
                capture_output=True, text=True, env=trainer_process_env(trainer_env()),
            )  # fmt: skip
            report = json.loads(report_file.read_text()) if report_file.exists() else {"error": done.stderr[-2000:]}
        memory = report.get("memory", {})
        check = report.get("logits_check", {})
        loaders = check.get("loaders", {})
        rows.append({
            "layers": depth, "shape": options.shape, "emb": None if options.shape else options.emb,
            "verdict": report.get("verdict"), "error": report.get("error"), "dtype": report.get("dtype"),
            "parameter_count": report.get("parameter_count"), "seconds": round(time.time() - started, 1),
            "write_seconds": round(written, 1), "writer_peak_rss_bytes": writer_peak,
            "conversion_seconds": check.get("conversion_seconds"), "check_seconds": check.get("seconds"),
            "concurrent_loaders": check.get("concurrent"),
            "loader_peak_rss_bytes": {name: c.get("peak_rss_bytes") for name, c in loaders.items()},
            "max_abs_diff": {name: c.get("max_abs_diff") for name, c in loaders.items()},
            **memory,
        })  # fmt: skip
        loads.append(os.getloadavg())
        print(json.dumps(rows[-1]), flush=True)
    memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2**30
    result = {"machine": f"{os.cpu_count()} cores, {memory} GiB", "load_average": loads,
              "date": time.strftime("%F %H:%M UTC", time.gmtime()), "rows": rows}  # fmt: skip
    previous = json.loads(Path(options.out).read_text()) if Path(options.out).exists() else {}
    previous[options.shape or f"emb{options.emb}"] = result
    Path(options.out).write_text(json.dumps(previous, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
