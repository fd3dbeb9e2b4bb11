"""The launcher's child processes: started so that they die with it, and what a dead tritonserver
leaves behind removed.

tritonserver runs as the leader of its own process group, and its python stubs inherit that group.
When tritonserver crashes (SIGSEGV) the stubs stay, re-parented to init, holding hundreds of MB (and
GPU memory on a GPU host), and their shared-memory regions stay in /dev/shm. Stubs are found by
their group and, should one have left it, among the processes the launcher recorded below
tritonserver while it ran (pid and start time). Nothing is chosen by its command line: another
user's `tail` of a region, or a monitor naming it, is none of ours.
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from pathlib import Path

SHM_DIR = Path("/dev/shm")


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def die_with_parent(parent_pid: int | None = None) -> None:
    """SIGTERM when the process that started this one dies, so no server outlives its launcher
    (PR_SET_PDEATHSIG); with `parent_pid`, exit at once if that launcher is already gone (it died before
    the call). Children get it through exec_dying_with_this_process; spawned pool workers call it."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except Exception:
        pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)


def exec_dying_with_this_process(command: list[str], private: bool = False) -> list[str]:
    """`command` started through backend/child_exec.py: it dies with this process (and, `private`, gets
    private files and a /dev/shm of its own) without a preexec_fn. The child's environment must put the
    repository on PYTHONPATH."""
    return [sys.executable, "-m", "backend.child_exec", *(["--private"] if private else []), str(os.getpid()),
            "--", *command]


CLONE_NEWNS, CLONE_NEWUSER = 0x00020000, 0x10000000
MS_NOSUID, MS_NODEV, MS_REC, MS_PRIVATE = 2, 4, 1 << 14, 1 << 18


def private_shm() -> str | None:
    """In a child, before exec: a /dev/shm of its own (a tmpfs, 0700, as large as the host's), in
    a mount namespace of its own (and a user namespace where this user is not root), so the python
    backend's regions, which it creates 0644 whatever the umask, are never visible to anyone else,
    not even while the model loads; they go when the last process of the server ends. None when
    done, else why not (the regions are then protected once the server is ready: protect_regions)."""
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        stat = os.statvfs(SHM_DIR)
        uid, gid = os.getuid(), os.getgid()
        if libc.unshare(CLONE_NEWNS | (0 if uid == 0 else CLONE_NEWUSER)) != 0:
            return f"unshare: {os.strerror(ctypes.get_errno())}"
        if uid != 0:  # the same ids inside: the server runs as this user, not as a namespace's root
            for name, text in (("setgroups", "deny"), ("uid_map", f"{uid} {uid} 1"), ("gid_map", f"{gid} {gid} 1")):
                with open(f"/proc/self/{name}", "w") as f:
                    f.write(text)
        if libc.mount(b"none", b"/", None, MS_REC | MS_PRIVATE, None) != 0:
            return f"mount --make-rprivate /: {os.strerror(ctypes.get_errno())}"
        options = f"mode=0700,size={stat.f_blocks * stat.f_frsize}".encode()
        if libc.mount(b"tmpfs", str(SHM_DIR).encode(), b"tmpfs", MS_NOSUID | MS_NODEV, options) != 0:
            return f"mount tmpfs {SHM_DIR}: {os.strerror(ctypes.get_errno())}"
    except Exception as e:  # noqa: BLE001 - any failure leaves the server on the host's /dev/shm
        return f"{type(e).__name__}: {e}"
    return None


def processes_with_arg(fragment: str) -> list[int]:
    """PIDs whose command line contains `fragment` (this process excluded): for looking, never
    for killing (see the module docstring)."""
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


def start_time(pid: int) -> str | None:
    """Start time in clock ticks (/proc/<pid>/stat field 22): with the pid, names one process even
    after the pid is reused."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


def _stat_fields(pid: str) -> list[bytes] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None


def group_members(pgid: int) -> list[int]:
    """Live processes of process group `pgid` (field 5 of /proc/<pid>/stat)."""
    found = []
    for entry in os.listdir("/proc"):
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields and fields[2] == str(pgid).encode() and fields[0] != b"Z":
            found.append(int(entry))
    return found


def descendants(root: int) -> dict[int, str]:
    """Every live process below `root`, with its start time (for record_processes)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        fields = _stat_fields(entry) if entry.isdigit() else None
        if fields:
            children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = {}, [root]
    while todo:
        for child in children.get(todo.pop(), []):
            started = start_time(child)
            if started is not None and child not in found:
                found[child] = started
                todo.append(child)
    return found


def _same_process(pid: int, started: str) -> bool:
    return start_time(pid) == started and alive(pid)


def kill_server_tree(pgid: int | None, shm_prefix: str, recorded: dict[int, str] | None = None,
                     timeout_s: float = 5.0) -> dict:
    """SIGKILL the server's process group and the processes recorded below it (a stub that left
    the group), only those: a pid counts if it still has the start time it was recorded with.
    Wait until they are gone, then remove the regions named by this server's prefix. Returns what
    was killed and removed (for the log)."""
    recorded = {pid: started for pid, started in (recorded or {}).items() if _same_process(pid, started)}
    members = set(group_members(pgid)) if pgid is not None else set()
    killed: set[int] = set()
    if pgid is not None:
        try:
            os.killpg(pgid, signal.SIGKILL)
            killed |= members | {pgid}
        except (ProcessLookupError, PermissionError):
            pass
    for pid in recorded:
        try:
            os.kill(pid, signal.SIGKILL)
            killed.add(pid)
        except (ProcessLookupError, PermissionError):
            pass

    def left() -> list[int]:
        group = group_members(pgid) if pgid is not None else []
        return sorted(set(group) | {pid for pid, started in recorded.items() if _same_process(pid, started)})

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and left():
        time.sleep(0.05)
    removed = []
    for region in SHM_DIR.glob(f"{shm_prefix}*"):
        try:
            region.unlink()
            removed.append(region.name)
        except OSError:
            pass
    return {"killed": sorted(killed), "removed_regions": removed, "still_running": left()}


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
