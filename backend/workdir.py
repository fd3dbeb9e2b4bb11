"""The launcher's work dir: private (0700), claimed by the launcher that uses it, and swept of its
secrets once that launcher is gone.

It holds the generated backends/ and model_repository/, the logs, and the random admin key
(`admin_key`, 0600). A launcher that exits in any ordinary way removes the dir (or, where it is
kept: --workdir, a failed start, whose logs are the evidence, only the key). A launcher killed
with SIGKILL cannot; its tritonserver stops by itself (PR_SET_PDEATHSIG), and the next launcher
start sweeps every such dir: the key and the bulky copies go, the logs stay."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "dsv4-triton-"
OWNER_FILE = "launcher.pid"  # "<pid> <start time>" of the launcher using the dir
ADMIN_KEY_FILE = "admin_key"
SECRETS_AND_COPIES = (ADMIN_KEY_FILE, "backends", "model_repository", "shutdown", OWNER_FILE)


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks (/proc/<pid>/stat field 22): a pid plus this
    names one process, even after the pid is reused."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def create() -> Path:
    """A fresh private work dir in the temp dir (mkdtemp makes it 0700), claimed by this process."""
    sweep_stale()
    path = Path(tempfile.mkdtemp(prefix=PREFIX))
    claim(path)
    return path


def claim(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    sweep(path)  # a --workdir reused after a SIGKILLed launcher
    (path / OWNER_FILE).write_text(f"{os.getpid()} {_start_time(os.getpid())}\n")


def owner_alive(path: Path) -> bool:
    """True while the launcher that claimed `path` runs (or when no launcher ever claimed it)."""
    try:
        pid, started = (path / OWNER_FILE).read_text().split()
    except (OSError, ValueError):
        return not (path / OWNER_FILE).exists()
    return _start_time(int(pid)) == started


def sweep(path: Path) -> bool:
    """Remove the key and the copies from a dir whose launcher is gone; True when it did."""
    if owner_alive(path):
        return False
    for name in SECRETS_AND_COPIES:
        target = path / name
        if target.is_dir():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)
    return True


def sweep_stale(root: str | os.PathLike | None = None) -> list[Path]:
    """Sweep every work dir of this user whose launcher is gone (see the module docstring)."""
    swept = []
    for path in Path(root or tempfile.gettempdir()).glob(f"{PREFIX}*"):
        try:
            mine = path.is_dir() and path.stat().st_uid == os.getuid()
        except OSError:
            continue
        if mine and (path / OWNER_FILE).exists() and sweep(path):
            swept.append(path)
    return swept


def write_admin_key(path: Path, key: str) -> Path:
    """The key in <path>/admin_key, readable by this user only."""
    target = path / ADMIN_KEY_FILE
    fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(key + "\n")
    return target


def release(path: Path) -> None:
    """This launcher is done with a dir it keeps: the key and the claim go, the logs stay."""
    (path / ADMIN_KEY_FILE).unlink(missing_ok=True)
    (path / OWNER_FILE).unlink(missing_ok=True)
