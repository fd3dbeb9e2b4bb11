"""Synthetic site-packages trees for the doctor's tests: dist-infos, RECORDs and tiny real ELF files.

Shared by tests/tools/test_doctor.py and tests/test_dockerfile.py. ELF files are written byte by
byte (header, .dynstr, .dynamic, .shstrtab, section table), so no compiler is needed; one test in
test_doctor.py also builds real ones with cc to prove the parser reads toolchain output.
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

PY = f"{sys.version_info.major}.{sys.version_info.minor}"


def elf_bytes(needed=(), soname: str | None = None, bits: int = 64, little: bool = True) -> bytes:
    """A minimal valid ELF shared object whose dynamic section lists `needed` (and `soname`)."""
    e = "<" if little else ">"
    names = [*needed, *([soname] if soname else [])]
    dynstr = b"\0"
    offsets = []
    for n in names:
        offsets.append(len(dynstr))
        dynstr += n.encode() + b"\0"
    entries = [(1, off) for off in offsets[: len(needed)]]  # DT_NEEDED
    if soname:
        entries.append((14, offsets[-1]))  # DT_SONAME
    entries.append((0, 0))  # DT_NULL
    dyn_fmt, shdr_fmt, ehsize, shentsize = (
        ("qQ", "IIQQQQIIQQ", 64, 64) if bits == 64 else ("iI", "IIIIIIIIII", 52, 40)
    )
    dynamic = b"".join(struct.pack(e + dyn_fmt, tag, val) for tag, val in entries)
    shstrtab = b"\0.dynstr\0.dynamic\0.shstrtab\0"
    phentsize = 56 if bits == 64 else 32
    dynstr_off = ehsize + phentsize  # one program header (PT_DYNAMIC) follows the ELF header
    dynamic_off = dynstr_off + len(dynstr)
    shstrtab_off = dynamic_off + len(dynamic)
    shoff = shstrtab_off + len(shstrtab)
    sections = [
        (0, 0, 0, 0, 0, 0, 0, 0, 0, 0),
        (1, 3, 2, 0, dynstr_off, len(dynstr), 0, 0, 1, 0),  # .dynstr, SHT_STRTAB
        (9, 6, 3, 0, dynamic_off, len(dynamic), 1, 0, 8, struct.calcsize(e + dyn_fmt)),  # .dynamic -> 1
        (18, 3, 0, 0, shstrtab_off, len(shstrtab), 0, 0, 1, 0),  # .shstrtab
    ]
    ident = b"\x7fELF" + bytes([2 if bits == 64 else 1, 1 if little else 2, 1, 0]) + b"\0" * 8
    if bits == 64:
        header = ident + struct.pack(
            e + "HHIQQQIHHHHHH", 3, 62, 1, 0, ehsize, shoff, 0, ehsize, 56, 1, shentsize, 4, 3
        )
        phdr = struct.pack(
            e + "IIQQQQQQ", 2, 4, dynamic_off, dynamic_off, dynamic_off, len(dynamic), len(dynamic), 8
        )
    else:
        header = ident + struct.pack(
            e + "HHIIIIIHHHHHH", 3, 3, 1, 0, ehsize, shoff, 0, ehsize, 32, 1, shentsize, 4, 3
        )
        phdr = struct.pack(
            e + "IIIIIIII", 2, dynamic_off, dynamic_off, dynamic_off, len(dynamic), len(dynamic), 4, 4
        )
    table = b"".join(struct.pack(e + shdr_fmt, *s) for s in sections)
    return header + phdr + dynstr + dynamic + shstrtab + table


def add_dist(site: Path, name: str, version: str, files: dict[str, bytes] | None = None, requires=()) -> Path:
    """A dist-info with METADATA and a RECORD listing `files` (written too); returns the dist-info."""
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    meta = ["Metadata-Version: 2.4", f"Name: {name}", f"Version: {version}"]
    meta += [f"Requires-Dist: {r}" for r in requires]
    (info / "METADATA").write_text("\n".join(meta) + "\n\n")
    record = []
    for rel, data in (files or {}).items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        record.append(f"{rel},,")
    record += [f"{info.name}/METADATA,,", f"{info.name}/RECORD,,"]
    (info / "RECORD").write_text("\n".join(record) + "\n")
    return info


def so(*needed: str, soname: str | None = None) -> bytes:
    return elf_bytes(needed, soname)


def cuda13_codec_site(root: Path) -> Path:
    """A failing image: torch 2.9.1+cu129, a torchcodec whose libtorchcodec_image.so NEEDs libnvrtc.so.13."""
    site = root / "cuda13-codec" / "site-packages"
    add_dist(
        site, "torch", "2.9.1+cu129", {"torch/lib/libtorch_cuda.so": so("libcudart.so.12", "libnvrtc.so.12")}
    )
    add_dist(
        site, "torchvision", "0.24.1+cu129", {"torchvision/_C.so": so("libcudart.so.12")}, ["torch==2.9.1"]
    )
    add_dist(
        site,
        "torchcodec",
        "0.9.1",
        {
            "torchcodec/libtorchcodec_image.so": so("libnvrtc.so.13", "libc.so.6"),
            "torchcodec/libtorchcodec_core7.so": so("libavcodec.so.61"),
        },
    )
    add_dist(
        site, "nvidia-cuda-nvrtc", "13.0.48", {"nvidia/cu13/lib/libnvrtc.so.13": so(soname="libnvrtc.so.13")}
    )
    add_dist(site, "numpy", "1.26.4")
    return site


def good_cu129_site(root: Path) -> Path:
    """What the Dockerfile installs: torch 2.13.0 and friends, all +cu129, numpy 1.26.4."""
    site = root / "good" / "site-packages"
    add_dist(
        site,
        "torch",
        "2.13.0+cu129",
        {"torch/lib/libtorch_cuda.so": so("libcudart.so.12", "libcublasLt.so.12")},
    )
    add_dist(
        site,
        "torchvision",
        "0.28.0+cu129",
        {"torchvision/_C.so": so("libcudart.so.12")},
        ["numpy", "torch==2.13.0"],
    )
    add_dist(site, "torchaudio", "2.11.0+cu129", {"torchaudio/lib/_torchaudio.so": so("libcudart.so.12")})
    add_dist(
        site,
        "nvidia-cuda-runtime-cu12",
        "12.9.79",
        {"nvidia/cuda_runtime/lib/libcudart.so.12": so(soname="libcudart.so.12")},
    )
    add_dist(
        site,
        "nvidia-cudnn-cu12",
        "9.10.2.21",
        {"nvidia/cudnn/lib/libcudnn.so.9": so("libcublasLt.so.12", soname="libcudnn.so.9")},
    )
    add_dist(
        site,
        "numpy",
        "1.26.4",
        {"numpy/core/_multiarray_umath.cpython-311-x86_64-linux-gnu.so": so("libm.so.6")},
    )
    return site


def pytriton_layout(
    site: Path, pytriton_version: str = "0.7.0", python: str = PY, server: str | None = None
) -> Path:
    """The nvidia-pytriton wheel's layout: a stub for `python` and (optionally) a tritonserver script."""
    stub = f"pytriton/tritonserver/python_backend_stubs/{python}/triton_python_backend_stub"
    files = {
        stub: so(f"libpython{python}.so.1.0", "libcudart-09529672.so.12.6.77"),
        "pytriton/tritonserver/backends/python/libtriton_python.so": so("libcudart-09529672.so.12.6.77"),
    }
    if server is not None:
        files["pytriton/tritonserver/bin/tritonserver"] = server.encode()
    add_dist(site, "nvidia-pytriton", pytriton_version, files)
    for rel in files:
        (site / rel).chmod(0o755)
    return site / stub
