"""The launcher's child processes: started so that they die with it, and what a dead tritonserver
leaves behind removed.

tritonserver runs as the leader of its own process group, and its python stubs inherit that group.
When tritonserver crashes (SIGSEGV) the stubs stay, re-parented to init, holding hundreds of MB (and
GPU memory on a GPU host), and their shared-memory regions stay in /dev/shm. Stubs are found by
their group and, should one have left it, by the region prefix that every stub of this server
carries on its command line.
"""

from __future__ import annotations

import os
import signal
import socket
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent() -> None:
    """In a child, before exec: SIGTERM when the process that started it dies, so no server
    outlives its launcher (a preexec_fn; PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:
        pass


def processes_with_arg(fragment: str) -> list[int]:
    """PIDs whose command line contains `fragment` (this process excluded)."""
    needle = fragment.encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if needle in f.read():
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def kill_server_tree(pgid: int | None, shm_prefix: str, timeout_s: float = 5.0) -> dict:
    """SIGKILL the server's process group and any process still naming its regions, wait until
    they are gone, then remove the regions. Returns what was killed and removed (for the log)."""
    killed: set[int] = set()
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGKILL)
            killed.add(pgid)
        except (ProcessLookupError, PermissionError):
            pass
    for pid in processes_with_arg(shm_prefix):
        try:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        except (ProcessLookupError, PermissionError):
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(alive(pid) for pid in processes_with_arg(shm_prefix)):
        time.sleep(0.05)
    removed = []
    for region in SHM_DIR.glob(f"{shm_prefix}*"):
        try:
            region.unlink()
            removed.append(region.name)
        except OSError:
            pass
    return {"killed": sorted(killed), "removed_regions": removed,
            "still_running": [pid for pid in processes_with_arg(shm_prefix) if alive(pid)]}


def protect_regions(shm_prefix: str) -> list[str]:
    """Make the server's regions 0600: they carry prompt text, and the python backend creates them
    0644 whatever the umask (boost.interprocess sets the mode itself). Each stub makes its region
    while its model loads, before any request can reach it, so once the server is ready is in time."""
    changed = []
    for region in SHM_DIR.glob(f"{shm_prefix}*"):
        try:
            if region.stat().st_mode & 0o077:
                region.chmod(0o600)
                changed.append(region.name)
        except OSError:
            pass
    return changed
