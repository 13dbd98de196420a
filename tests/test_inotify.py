"""The tests' inotify wait (:mod:`tests.inotify`): a nested file made by another process, and that process's end."""

import os
import subprocess
import sys

from tests.inotify import wait_for_glob

MAKE = "import os, sys; os.makedirs(sys.argv[1]); open(os.path.join(sys.argv[1], 'state.json'), 'w').write('{}')"


def test_a_file_made_in_new_nested_directories_is_seen(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", MAKE, str(tmp_path / "run" / "jobsets" / "js")])
    pidfd = os.pidfd_open(proc.pid)
    try:
        assert wait_for_glob(tmp_path, "run/jobsets/*/state.json", 60, pidfd)
    finally:
        os.close(pidfd)
        proc.wait()


def test_the_wait_ends_with_the_process_that_never_makes_the_file(tmp_path):
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    pidfd = os.pidfd_open(proc.pid)
    try:
        assert not wait_for_glob(tmp_path, "run/jobsets/*/state.json", 60, pidfd)
    finally:
        os.close(pidfd)
        proc.wait()
