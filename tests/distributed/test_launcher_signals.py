"""A launcher's ranks stop with it: SIGTERM to a launcher that spawned its ranks stops
them as Ctrl-C does, and on Linux a spawned rank dies with its launcher however the
launcher dies (SIGKILL too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


_SPAWN_SCRIPT = '''\
import os
import sys
import time


def write_pid(path):
    with open(path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(path + ".tmp", path)


def sleeper(info, pid_dir):
    write_pid(f"{pid_dir}/{info.rank}.pid")
    time.sleep(120)


if __name__ == "__main__":
    from deepinfer.distributed.ranks import spawn_ranks

    try:
        spawn_ranks(sleeper, 2, (sys.argv[1],))
    except KeyboardInterrupt:
        sys.exit(130)
    sys.exit(0)
'''

_ORPHAN_SCRIPT = '''\
import multiprocessing as mp
import os
import sys
import time


def child(pid_path):
    from deepinfer.distributed.ranks import die_with_launcher

    die_with_launcher(os.getppid())
    with open(pid_path + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.replace(pid_path + ".tmp", pid_path)
    time.sleep(120)


if __name__ == "__main__":
    p = mp.get_context("spawn").Process(target=child, args=(sys.argv[1],))
    p.start()
    p.join()
'''


def _gone(pid: int) -> bool:
    """Whether ``pid`` has exited (gone, or a zombie not yet reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return True
    return stat[stat.rindex(")") + 2:].split()[0] == "Z"


def _wait_until(cond, timeout: float, step: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(step)
    return cond()


def _start_script(tmp_path: Path, source: str, arg: str) -> tuple[subprocess.Popen, Path]:
    script = tmp_path / "script.py"
    script.write_text(source)
    log = tmp_path / "script.log"
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    with open(log, "wb") as logf:
        proc = subprocess.Popen([sys.executable, str(script), arg], cwd=str(REPO_ROOT),
                                env=env, stdout=logf, stderr=subprocess.STDOUT)
    return proc, log


def _read_pids(paths: list[Path]) -> list[int]:
    return [int(p.read_text()) for p in paths]


def _kill_leftovers(proc: subprocess.Popen, pids: list[int]) -> None:
    """Clean up after a failed test: the processes it started, by pid."""
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    for pid in pids:
        if not _gone(pid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux signals and /proc")
def test_sigterm_to_the_launcher_stops_its_ranks(tmp_path):
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    proc, log = _start_script(tmp_path, _SPAWN_SCRIPT, str(pid_dir))
    pid_files = [pid_dir / "0.pid", pid_dir / "1.pid"]
    pids: list[int] = []
    try:
        started = _wait_until(lambda: all(p.exists() for p in pid_files)
                              or proc.poll() is not None, 60)
        assert started and proc.poll() is None, (
            f"ranks did not start (launcher exit {proc.poll()}):\n{log.read_text()}")
        pids = _read_pids(pid_files)
        assert proc.pid not in pids and len(set(pids)) == 2
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the launcher ignored SIGTERM:\n{log.read_text()}")
        assert code == 130, f"exit {code}:\n{log.read_text()}"
        assert _wait_until(lambda: all(_gone(p) for p in pids), 15), (
            f"ranks still running: {[p for p in pids if not _gone(p)]}")
    finally:
        _kill_leftovers(proc, pids)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl(PR_SET_PDEATHSIG)")
def test_die_with_launcher_after_sigkill_of_the_parent(tmp_path):
    pid_file = tmp_path / "child.pid"
    proc, log = _start_script(tmp_path, _ORPHAN_SCRIPT, str(pid_file))
    pids: list[int] = []
    try:
        started = _wait_until(lambda: pid_file.exists() or proc.poll() is not None, 60)
        assert started and proc.poll() is None, (
            f"child did not start (parent exit {proc.poll()}):\n{log.read_text()}")
        pids = _read_pids([pid_file])
        assert not _gone(pids[0])
        proc.kill()  # SIGKILL: the parent runs no code on the way out
        proc.wait(timeout=30)
        assert _wait_until(lambda: _gone(pids[0]), 15), (
            f"child {pids[0]} outlived its SIGKILLed parent:\n{log.read_text()}")
    finally:
        _kill_leftovers(proc, pids)
