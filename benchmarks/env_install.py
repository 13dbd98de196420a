"""`multislice env install` against `make env`'s trainer step, each into a fresh directory, uv's cache as it is.

Times, in turn: the Makefile's ``.venvs/trainer`` recipe (``uv venv``, ``uv pip sync --compile-bytecode
requirements/trainer.txt``, the editable install) into ``DIR/make/trainer``, and ``multislice env install
DIR/cli`` (the trainer and loader-hf4 venvs), recording the load average before and after each and the longest
gap between two lines of the CLI's output. uv's cache (``uv cache dir``) is never cleaned: with the cache warm
(a machine that ran ``make env``) nothing is downloaded. With ``--empty-cache`` each of the two gets a new, empty
uv cache of its own under DIR (``UV_CACHE_DIR``): everything is downloaded, as on a fresh machine, and the shared
cache is left alone. DIR is removed at the end.

    .venvs/pipeline/bin/python -m benchmarks.env_install --dir /tmp/env-bench [--empty-cache]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UV = ROOT / ".venvs" / "bootstrap" / "bin" / "uv"


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed(argvs: list[list[str]], env: dict[str, str] | None = None) -> dict:
    before, started, gaps, last = load(), time.monotonic(), [], time.monotonic()
    for argv in argvs:
        with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
            assert proc.stdout is not None
            for line in proc.stdout:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
                print(f"  {now - started:7.1f} s | {line.rstrip()}", flush=True)
            if proc.wait() != 0:
                raise SystemExit(f"{argv} exited {proc.returncode}")
    gaps.append(time.monotonic() - last)  # the silence before the end
    return {"seconds": round(time.monotonic() - started, 1), "load_before": before, "load_after": load(),
            "longest_silence_seconds": round(max(gaps, default=0.0), 1)}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--cli-first", action="store_true", help="time `multislice env install` first")
    parser.add_argument("--empty-cache", action="store_true", help="each run downloads into an empty uv cache")
    args = parser.parse_args()
    base = args.dir.resolve()
    if base.exists():
        raise SystemExit(f"{base} exists; give a fresh --dir")
    make_env = base / "make" / "trainer"
    results = {"uv_cache": subprocess.run([str(UV), "cache", "dir"], capture_output=True, text=True).stdout.strip()}
    try:
        caches = {name: {"UV_CACHE_DIR": str(base / "cache" / name)} if args.empty_cache else {}
                  for name in ("make", "cli")}  # fmt: skip
        results["empty_cache"] = args.empty_cache
        venv_env = {**os.environ, "VIRTUAL_ENV": str(make_env), **caches["make"]}
        uv, cli = str(UV), str(Path(sys.executable).parent / "multislice")
        runs = {
            "make_env_trainer": lambda: timed([
                [uv, "venv", "--quiet", "--allow-existing", "--python", args.python, str(make_env)],
                [uv, "pip", "sync", "--quiet", "--compile-bytecode", str(ROOT / "requirements" / "trainer.txt")],
                [uv, "pip", "install", "--quiet", "--no-deps", "-e", str(ROOT)],
            ], venv_env),
            "multislice_env_install": lambda: timed([[cli, "env", "install", str(base / "cli"), "--python",
                                                      args.python]], {**os.environ, **caches["cli"]}),
        }  # fmt: skip
        for name in sorted(runs, reverse=args.cli_first):
            print(f"{name}:", flush=True)
            results[name] = runs[name]()
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
