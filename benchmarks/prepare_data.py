"""prepare_data's throughput and peak memory as the corpus grows: 1x, 3x and 10x the local profile's corpus.

Usage::

    PYTHONPATH=$PWD .venvs/pipeline/bin/python -m benchmarks.prepare_data [--scales 1 3 10]

The corpus is the local profile's (the package descriptions, ``*.dist-info/METADATA``, of the trainer
environment); scale N writes N copies of each file, each with its copy number on a first line, so every
copy is a distinct document. Each scale is tokenized from scratch by ``multislice.trainer.prepare_data``
in its own trainer-environment process, whose peak resident memory (``ru_maxrss`` of the child) and
wall time are measured; the tokens/s figure is the manifest's (tokens / the work's own seconds, the
interpreter's start excluded). Results go to ``benchmarks/results/prepare_data.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from multislice.backends.local.environment import trainer_env, trainer_process_env
from multislice.config.data import expand_files

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "prepare_data.json"


def corpus_copies(site_packages: str, folder: Path, scale: int) -> int:
    """Write ``scale`` distinct copies of the local corpus into ``folder``; returns the bytes written."""
    files = expand_files(("site-packages:*.dist-info/METADATA",), ("*multislice*",), site_packages)
    written = 0
    for copy in range(scale):
        for index, path in enumerate(files):
            text = f"copy {copy}\n" + Path(path).read_text(encoding="utf-8", errors="replace")
            target = folder / f"c{copy:02d}-{index:04d}.txt"
            target.write_text(text, encoding="utf-8")
            written += target.stat().st_size
    return written


def measure(scale: int, work: Path, site_packages: str) -> dict:
    """Tokenize the corpus at ``scale`` in a fresh trainer-environment process; its figures."""
    corpus = work / f"corpus-{scale}"
    corpus.mkdir()
    size = corpus_copies(site_packages, corpus, scale)
    request = {
        "data": {"kind": "text", "files": [str(corpus / "*.txt")]},
        "tokenizer": {},
        "max_target_length": 128,
        "out_dir": str(work / f"shards-{scale}"),
    }
    env = trainer_process_env(trainer_env())
    env["PYTHONPATH"] = str(ROOT)
    code = (
        "import json, resource, sys\n"
        "from multislice.trainer import prepare_data\n"
        "prepare_data.main(sys.argv[1:])\n"
        "print('PEAK_KIB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n"
    )
    started = time.monotonic()
    done = subprocess.run(
        [str(trainer_env() / "bin" / "python"), "-c", code, "--request", json.dumps(request)],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    wall = time.monotonic() - started
    lines = done.stdout.splitlines()
    manifest = json.loads(next(x for x in lines if x.startswith("MANIFEST ")).removeprefix("MANIFEST "))
    peak_kib = int(next(x for x in lines if x.startswith("PEAK_KIB")).split()[1])
    return {
        "scale": scale,
        "corpus_bytes": size,
        "files": len(manifest["sources"]),
        "tokens": manifest["token_count"],
        "shards": manifest["shard_count"],
        "work_seconds": manifest["seconds"],
        "process_wall_seconds": round(wall, 2),
        "tokens_per_second": manifest["tokens_per_second"],
        "peak_rss_mib": round(peak_kib / 1024, 1),
    }


def main(argv: list[str] | None = None) -> int:
    """Run the scales, print a table, write :data:`RESULTS`."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 3, 10])
    args = parser.parse_args(argv)
    site_packages = str(next(trainer_env().glob("lib/python3*/site-packages")))
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-prepare-data-") as work:
        for scale in args.scales:
            row = measure(scale, Path(work), site_packages)
            rows.append(row)
            print(
                f"{scale:>3}x: {row['corpus_bytes'] / 2**20:6.1f} MiB, {row['tokens']:>10,} tokens, "
                f"{row['tokens_per_second']:>8,} tokens/s, peak RSS {row['peak_rss_mib']:7.1f} MiB, "
                f"{row['work_seconds']:.1f} s",
                flush=True,
            )
    result = {
        "benchmark": "prepare_data: tokenize the local corpus at growing scales (Llama 3 tiktoken, sequences of 128)",
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, shared with other work while measured",
        "python": sys.version.split()[0],
        "chunk_bytes": 1 << 20,
        "rows": rows,
        "peak_rss_growth_1x_to_largest": round(rows[-1]["peak_rss_mib"] / rows[0]["peak_rss_mib"], 3),
    }
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
