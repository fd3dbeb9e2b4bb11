"""Ports checked before anything loads: a port in use fails the start in well under a second,
naming the port, what it was for and, where /proc shows it, the process that holds it (a real
checkpoint would otherwise load for minutes before Triton found the clash)."""

from __future__ import annotations

import os
import socket
from pathlib import Path


class PortInUse(RuntimeError):
    pass


def can_bind(host: str, port: int) -> bool:
    """True when a listener could bind host:port now (SO_REUSEADDR, as Triton and uvicorn bind:
    a port held only by connections in TIME_WAIT counts as free)."""
    try:
        infos = socket.getaddrinfo(host or "0.0.0.0", port, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return True  # a host that does not resolve fails later with its own message
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(address)
        except OSError:
            return False
    return True


def listening_inodes(port: int) -> set[str]:
    """Socket inodes listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            fields = row.split()
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])  # state 0A: LISTEN
    return inodes


def holder(port: int) -> str | None:
    """'pid 123 (python3 -m http.server 8000)' for the process listening on `port`, when this
    user may see its file descriptors; else None."""
    wanted = {f"socket:[{inode}]" for inode in listening_inodes(port)}
    if not wanted:
        return None
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    return f"pid {entry} ({_command(entry)})"
            except OSError:
                continue
    return None


def _command(pid: str) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    words = [w.decode("utf-8", "replace") for w in raw.split(b"\0") if w]
    text = " ".join([os.path.basename(words[0]), *words[1:]]) if words else "?"
    return text if len(text) <= 120 else text[:117] + "..."


def check_ports(host: str, ports: dict[str, tuple[int, str]]) -> None:
    """`ports`: what each is for -> (port, the flag that moves it). PortInUse for the first busy one."""
    for purpose, (port, flag) in ports.items():
        if port and not can_bind(host, port):
            held_by = holder(port)
            by = f"by {held_by}" if held_by else "by another process (not one this user can see)"
            raise PortInUse(f"port {port} ({purpose}) on {host} is already in use {by}; "
                            f"stop it or pick another port with {flag}")
