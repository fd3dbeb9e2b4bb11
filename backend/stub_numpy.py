"""Which numpy a Triton python backend stub can embed: the launcher refuses a pair that corrupts
BYTES tensors (the server would say ready, then fail every request "Stub process is not healthy"),
and `make doctor` (tools/doctor.py) reports it.

Triton's python backend handles numpy 2 from python_backend#384 (pybind11 2.12, merged 2024-10-18),
first in Triton 2.52 (24.11). Triton 2.51 (nvidia-pytriton 0.7.0's, seen here and on the H200)
corrupts BYTES tensors under numpy 2.
"""

from __future__ import annotations

import re
from pathlib import Path

NUMPY2_SINCE = (2, 52)
PYTRITON_TRITON = {"0.7.0": (2, 51)}
NUMPY_FIX = "pip install -c constraints.txt 'numpy<2' into the Python the stub embeds"


def release(version: str) -> tuple[int, ...]:
    """(2, 9, 1) from '2.9.1+cu129', '2.13.0rc1', '0.15.0.dev20260101'."""
    m = re.match(r"\d+(?:\.\d+)*", version)
    return tuple(int(p) for p in m.group(0).split(".")) if m else ()


def triton_version(stub: Path, pytriton_version: str | None) -> tuple[int, ...] | None:
    """From a TRITON_VERSION file above the stub (NVIDIA's containers), else the pytriton wheel's table."""
    for parent in list(stub.parents)[:4]:
        marker = parent / "TRITON_VERSION"
        if marker.is_file():
            return release(marker.read_text(errors="replace").strip()) or None
    if pytriton_version and "pytriton" in stub.parts:
        return PYTRITON_TRITON.get(pytriton_version.split("+")[0])
    return None


def corrupts_bytes(numpy_version: str, triton: tuple[int, ...] | None) -> bool | None:
    """True: this numpy with this Triton's stub corrupts BYTES tensors; None: unknown Triton version."""
    if release(numpy_version)[:1] < (2,):
        return False
    if triton is None:
        return None
    return triton < NUMPY2_SINCE
