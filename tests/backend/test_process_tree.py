"""backend/process_tree.py: cleanup kills the server's process group and the processes recorded
below it, and nothing else, even a process of the same user that names the server's regions; the
server's shared-memory regions live in a /dev/shm of its own."""

import os
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from backend.process_tree import SHM_DIR, alive, descendants, kill_server_tree
from backend.serve import REPO_ROOT, TritonServer


def test_cleanup_kills_the_group_and_recorded_pids_never_a_process_naming_the_prefix():
    prefix = f"dsv4_test_{os.getpid()}_"
    # a "server": a group leader with one child in its group and one that left it (setsid), as a stub could
    server = subprocess.Popen(["bash", "-c", "setsid sleep 60 & sleep 60 & wait"], start_new_session=True)
    deadline = time.monotonic() + 10
    while len(descendants(server.pid)) < 2:
        assert time.monotonic() < deadline, descendants(server.pid)
        time.sleep(0.05)
    recorded = descendants(server.pid)
    # someone's `tail` of a region: same user, the prefix on its command line, not the server's
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", f"/dev/shm/{prefix}x"])
    region = SHM_DIR / f"{prefix}region"
    region.write_bytes(b"prompt text")
    try:
        result = kill_server_tree(server.pid, prefix, recorded)
        server.wait(10)
        assert not any(alive(pid) for pid in recorded), result
        assert result["still_running"] == [] and result["removed_regions"] == [region.name]
        assert bystander.poll() is None and bystander.pid not in result["killed"], result
    finally:
        bystander.kill()
        region.unlink(missing_ok=True)


def _private_shm_possible() -> bool:
    code = "import sys; from backend.process_tree import private_shm; sys.exit(private_shm() is not None)"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT).returncode == 0


@pytest.mark.slow
def test_the_servers_regions_are_never_in_the_hosts_dev_shm(tmp_path):
    """The python backend creates its regions 0644 while the model loads (and at every restart):
    they live in a /dev/shm of the server's own, 0700, and never appear in the host's."""
    if not _private_shm_possible():
        pytest.skip("this system refuses mount namespaces to this user: the fallback is protect_regions")
    server = TritonServer(engine_args={"max_model_len": 256}, http_port=0, grpc_port=0, metrics_port=0,
                          workdir=tmp_path)
    seen: set[str] = set()
    watching = threading.Event()

    def watch():
        while not watching.is_set():
            seen.update(region.name for region in SHM_DIR.glob(f"{server.shm_prefix}*"))
            time.sleep(0.005)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        with server:
            own_shm = Path(f"/proc/{server.process.pid}/root/dev/shm")
            assert own_shm.stat().st_dev != SHM_DIR.stat().st_dev
            assert stat.S_IMODE(own_shm.stat().st_mode) == 0o700
            assert any(name.startswith(server.shm_prefix) for name in os.listdir(own_shm))
    finally:
        watching.set()
        watcher.join()
    assert seen == set()


def test_a_child_dies_with_its_launcher_without_a_preexec_fn():
    """exec_dying_with_this_process (backend/child_exec.py: the servers' and load processes' start, no Python
    between fork and exec): the command runs as the same pid, gets SIGTERM when its launcher is SIGKILLed, and
    never starts if the launcher it was given is already gone."""
    child = "import time; print('up', flush=True); time.sleep(60)"
    launcher = ("import subprocess, sys, time; from backend.process_tree import exec_dying_with_this_process; "
                f"p = subprocess.Popen(exec_dying_with_this_process([sys.executable, '-c', {child!r}]), "
                "stdout=subprocess.PIPE); print(p.pid, flush=True); print(p.stdout.readline().decode().strip(), "
                "flush=True); time.sleep(60)")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    outer = subprocess.Popen([sys.executable, "-c", launcher], stdout=subprocess.PIPE, env=env)
    pid = int(outer.stdout.readline())
    assert outer.stdout.readline().strip() == b"up"  # the command runs, exec'd in the pid the launcher holds
    assert b"-c" in Path(f"/proc/{pid}/cmdline").read_bytes() and b"child_exec" not in Path(
        f"/proc/{pid}/cmdline").read_bytes()
    outer.kill()
    outer.wait()
    deadline = time.monotonic() + 10
    while alive(pid):
        assert time.monotonic() < deadline, "the child outlived its SIGKILLed launcher"
        time.sleep(0.05)
    gone = subprocess.run([sys.executable, "-m", "backend.child_exec", "1", "--", sys.executable, "-c", child],
                          env=env, capture_output=True, timeout=30)
    assert gone.returncode == 1 and b"up" not in gone.stdout  # pid 1 is not its parent: gone before it started
    usage = subprocess.run([sys.executable, "-m", "backend.child_exec", "--private", "1"], env=env,
                           capture_output=True, timeout=30)
    assert usage.returncode == 2 and b"LAUNCHER_PID -- COMMAND" in usage.stderr
