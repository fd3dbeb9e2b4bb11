"""Our threads' names where the OS shows them (`top -H`, py-spy, /proc/PID/task/*/comm): Python 3.11
names only its own Thread objects, so every thread of the Triton stub read "triton_python_b".
`tools.profile_serving --hops` sums each thread's CPU by these names."""

from __future__ import annotations

import ctypes
import functools

PR_SET_NAME = 15
MAX_CHARS = 15  # the kernel keeps 16 bytes with the terminating zero

try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: names stay Python's own
    _prctl = None


def set_os_name(name: str) -> None:
    """Name the calling thread."""
    if _prctl is not None:
        _prctl(PR_SET_NAME, name.encode()[:MAX_CHARS], 0, 0, 0)


def named(name: str, target):
    """`target` as a thread body that first names its thread `name`."""

    @functools.wraps(target)
    def run(*args, **kwargs):
        set_os_name(name)
        return target(*args, **kwargs)

    return run
