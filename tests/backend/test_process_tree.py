"""backend/process_tree.py: cleanup kills the server's process group and the processes recorded
below it, and nothing else, even a process of the same user that names the server's regions."""

import os
import subprocess
import sys
import time

from backend.process_tree import SHM_DIR, alive, descendants, kill_server_tree


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
