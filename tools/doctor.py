"""Environment doctor: is this Python environment one that serves correctly?

    python -m tools.doctor [--site-packages DIR ...] [--stub PATH] [--skip-triton] [--json] [--strict]

Four checks, one function each, each returning a list of Problem:

  torch-family  torch / torchvision / torchaudio / torchcodec from one torch release and CUDA variant
  cuda-libs     no installed shared library NEEDs a CUDA major other than torch's (a real failure:
                torchcodec's libtorchcodec_image.so NEEDed libnvrtc.so.13 beside torch 2.9.1+cu129)
  numpy-stub    numpy works with the Triton python backend stub in use (Triton <= 2.51 needs numpy < 2)
  triton        tritonserver runs, and a python backend stub for this Python exists

Nothing from the environment under test is imported: versions come from *.dist-info/METADATA and
library dependencies from the ELF files themselves, so a broken install cannot crash the doctor.
Errors exit 1; warnings (pairs the doctor cannot vouch for) are printed and exit 0 unless --strict.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import re
import shutil
import site
import struct
import subprocess
import sys
import sysconfig
from collections import Counter
from dataclasses import asdict, dataclass, field
from email.parser import HeaderParser
from pathlib import Path

from backend import stub_numpy

ERROR, WARNING, SKIPPED = "error", "warning", "skipped"
CHECKS = ("torch-family", "cuda-libs", "numpy-stub", "triton")
TORCH_INDEX = "https://download.pytorch.org/whl"
NVIDIA_TRITON_ROOT = Path("/opt/tritonserver")  # where NVIDIA's containers keep the server


@dataclass(frozen=True)
class Problem:
    check: str
    message: str
    fix: str = ""
    level: str = ERROR  # error fails the run; warning is printed; skipped says a check did not apply


# --------------------------------------------------------------------------- versions and dists


release = stub_numpy.release


def local_label(version: str) -> str | None:
    """The PEP 440 local label: 'cu129' from '2.9.1+cu129'; None for a wheel from PyPI."""
    return version.split("+", 1)[1].lower() if "+" in version else None


def cuda_major(label: str | None) -> int | None:
    """12 from 'cu129', 13 from 'cu130', 11 from 'cu118'; None for 'cpu', 'rocm6.4', None."""
    m = re.fullmatch(r"cu(\d+)\d", label or "")
    return int(m.group(1)) if m else None


def index_url(label: str | None) -> str:
    return (
        f"{TORCH_INDEX}/{label}"
        if label and (label == "cpu" or cuda_major(label))
        else f"{TORCH_INDEX}/cu129"
    )


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass
class Dist:
    name: str  # normalized project name
    version: str
    requires: list[str]
    info_dir: Path
    site: Path

    @property
    def public(self) -> str:
        return self.version.split("+", 1)[0]


def read_dists(sites: list[Path]) -> dict[str, Dist]:
    """Every *.dist-info (and *.egg-info) in the sites; the first site wins, like sys.path."""
    dists: dict[str, Dist] = {}
    for site_dir in sites:
        try:
            entries = sorted(site_dir.iterdir())
        except OSError:
            continue
        for info in entries:
            meta = info / "METADATA" if info.suffix == ".dist-info" else info / "PKG-INFO"
            if info.suffix not in (".dist-info", ".egg-info") or not meta.is_file():
                continue
            try:
                headers = HeaderParser().parsestr(meta.read_text(encoding="utf-8", errors="replace"))
            except OSError:
                continue
            name, version = headers.get("Name"), headers.get("Version")
            if name and version and normalize(name) not in dists:
                requires = headers.get_all("Requires-Dist") or []
                dists[normalize(name)] = Dist(normalize(name), version.strip(), requires, info, site_dir)
    return dists


_OPS = {
    "==": lambda v, s: v == s,
    "!=": lambda v, s: v != s,
    ">=": lambda v, s: v >= s,
    "<=": lambda v, s: v <= s,
    ">": lambda v, s: v > s,
    "<": lambda v, s: v < s,
}


def torch_requirement(dist: Dist) -> str | None:
    """The specifier a dist declares on torch ('==2.13.0', '>=2.11'), extras' requirements left out."""
    for req in dist.requires:
        body, _, marker = req.partition(";")
        if "extra" in marker:
            continue
        m = re.fullmatch(r"\s*torch\s*\(?\s*([^()]*?)\s*\)?\s*", body)
        if m and m.group(1):
            return m.group(1).replace(" ", "")
    return None


def satisfies(version: str, spec: str) -> bool:
    """A small PEP 440 subset: comma-joined ==, !=, >=, <=, >, <, ~= and ==X.Y.* on release numbers."""
    v = release(version)
    for clause in spec.split(","):
        m = re.fullmatch(r"(==|!=|>=|<=|~=|>|<)([\d.]+)(\.\*)?", clause)
        if not m:
            continue  # a form this subset does not read constrains nothing here
        op, target, star = m.group(1), release(m.group(2)), m.group(3)
        if star or op == "~=":
            prefix = target if star else target[:-1]
            ok = v[: len(prefix)] == prefix and (star or v >= target)
            ok = ok if op != "!=" else not ok
        else:
            width = max(len(v), len(target))
            ok = _OPS[op](v + (0,) * (width - len(v)), target + (0,) * (width - len(target)))
        if not ok:
            return False
    return True


# --------------------------------------------------------------------------- ELF DT_NEEDED

DT_NULL, DT_NEEDED = 0, 1
SHT_DYNAMIC = 6
# ELF class (1: 32-bit, 2: 64-bit) -> (e_shoff format and offset, offset of e_shentsize (e_shnum follows),
# section header layout, dynamic entry layout)
_ELF = {
    1: (("I", 32), 46, "IIIIIIIIII", "iI"),
    2: (("Q", 40), 58, "IIQQQQIIQQ", "qQ"),
}


def elf_needed(path: Path) -> list[str] | None:
    """DT_NEEDED names of an ELF file (32/64-bit, either byte order); None if it is not a readable ELF.

    Reads the section headers, every SHT_DYNAMIC section and, for each DT_NEEDED entry, one string
    from the string table that section links to. Never raises on malformed input.
    """
    try:
        with open(path, "rb") as f:
            head = f.read(64)
            if len(head) < 52 or head[:4] != b"\x7fELF" or head[4] not in _ELF or head[5] not in (1, 2):
                return None
            (shoff_fmt, shoff_at), shentsize_at, shdr_fmt, dyn_fmt = _ELF[head[4]]
            order = "<" if head[5] == 1 else ">"
            (shoff,) = struct.unpack_from(order + shoff_fmt, head, shoff_at)
            shentsize, shnum = struct.unpack_from(order + "HH", head, shentsize_at)
            shdr, dyn = struct.Struct(order + shdr_fmt), struct.Struct(order + dyn_fmt)
            if shnum == 0 or shentsize < shdr.size:
                return []  # no section table (stripped of it, or > 0xff00 sections): nothing we can read
            f.seek(shoff)
            table = f.read(shnum * shentsize)
            if len(table) < shnum * shentsize:
                return None
            sections = [shdr.unpack_from(table, i * shentsize) for i in range(shnum)]
            needed: list[str] = []
            for _name, sh_type, _flags, _addr, offset, size, link, *_ in sections:
                if sh_type != SHT_DYNAMIC or link >= shnum:
                    continue
                str_offset, str_size = sections[link][4], sections[link][5]
                f.seek(offset)
                data = f.read(min(size, 1 << 20))
                for i in range(0, len(data) - dyn.size + 1, dyn.size):
                    tag, value = dyn.unpack_from(data, i)
                    if tag == DT_NULL:
                        break
                    if tag == DT_NEEDED and value < str_size:
                        f.seek(str_offset + value)
                        raw = f.read(min(4096, str_size - value)).split(b"\0", 1)[0]
                        needed.append(raw.decode("utf-8", "replace"))
            return needed
    except (OSError, struct.error, ValueError, IndexError):
        return None


# Libraries whose soname major is the CUDA major they ship with (libcudart.so.12 is CUDA 12).
# cuFFT numbers its soname on its own: 10, 11, 12 ship with CUDA 11, 12, 13. Left out on purpose:
# cuDNN (libcudnn.so.9 serves CUDA 12 and 13), NCCL, cuSPARSE, cuSOLVER, cuRAND, whose soname
# major is the library's own and does not tell the CUDA major apart.
_CUDA_SONAME = re.compile(
    r"lib(cudart|nvrtc|nvrtc-builtins|cublas|cublasLt|nvJitLink|cupti|nvjpeg|npp[a-z]*|cufftw?)"
    r"(-[0-9a-f]{8})?\.so\.(\d+)"
)
_SONAME_TO_CUDA = {"cufft": {10: 11, 11: 12, 12: 13}, "cufftw": {10: 11, 11: 12, 12: 13}}


def cuda_dependency(needed: str) -> tuple[int, bool] | None:
    """(CUDA major, vendored) for a DT_NEEDED name of a CUDA library, else None.

    Vendored: auditwheel renamed it (libcudart-09529672.so.12): the wheel carries its own copy.
    """
    m = _CUDA_SONAME.match(needed)
    if not m:
        return None
    lib, major = m.group(1), int(m.group(3))
    return _SONAME_TO_CUDA.get(lib, {}).get(major, major), bool(m.group(2))


# --------------------------------------------------------------------------- the environment


def default_sites() -> list[Path]:
    """The running interpreter's site-packages (a venv's own, or the system's in a container)."""
    candidates = [*site.getsitepackages(), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]
    seen: list[Path] = []
    for c in candidates:
        p = Path(c)
        if p.is_dir() and p not in seen:
            seen.append(p)
    return seen


class Env:
    """What the checks read: the site-packages dirs, their dists, their shared libraries."""

    def __init__(self, sites: list[Path], triton_root: Path = NVIDIA_TRITON_ROOT):
        self.sites = [Path(s) for s in sites]
        self.dists = read_dists(self.sites)
        self.triton_root = triton_root
        self._owners: dict[str, str] | None = None

    def dist(self, name: str) -> Dist | None:
        return self.dists.get(normalize(name))

    @property
    def python(self) -> str:
        """'3.11': the Python these site-packages belong to (the path says), else the running one."""
        for s in self.sites:
            m = re.search(r"python(\d+\.\d+)", str(s))
            if m:
                return m.group(1)
        return f"{sys.version_info.major}.{sys.version_info.minor}"

    def shared_libraries(self):
        for site_dir in self.sites:
            for root, dirs, files in os.walk(site_dir):
                dirs[:] = [d for d in dirs if d != "__pycache__"]
                for name in files:
                    path = Path(root, name)
                    if re.search(r"\.so(\.|$)", name) and not path.is_symlink():
                        yield path

    def owner(self, path: Path) -> Dist | None:
        """The dist whose RECORD lists this file."""
        if self._owners is None:
            self._owners = {}
            for dist in self.dists.values():
                try:
                    rows = list(
                        csv.reader((dist.info_dir / "RECORD").open(encoding="utf-8", errors="replace"))
                    )
                except OSError:
                    continue
                for row in rows:
                    if row:
                        self._owners[os.path.normpath(dist.site / row[0])] = dist.name
        name = self._owners.get(os.path.normpath(path))
        return self.dists.get(name) if name else None

    def relative(self, path: Path) -> str:
        for s in self.sites:
            if path.is_relative_to(s):
                return str(path.relative_to(s))
        return str(path)

    def stubs(self) -> list[Path]:
        """Python backend stubs this environment would run: the pytriton wheel's, NVIDIA's container's."""
        found = [
            s / "pytriton/tritonserver/python_backend_stubs" / self.python / "triton_python_backend_stub"
            for s in self.sites
        ]
        found.append(self.triton_root / "backends/python/triton_python_backend_stub")
        return [p for p in found if p.is_file()]

    def tritonserver(self) -> tuple[Path, Path | None] | None:
        """(binary, library dir to put on LD_LIBRARY_PATH) or None."""
        for s in self.sites:
            binary = s / "pytriton/tritonserver/bin/tritonserver"
            if binary.is_file():
                return binary, s / "nvidia_pytriton.libs"
        on_path = shutil.which("tritonserver")
        if on_path:
            return Path(on_path), None
        binary = self.triton_root / "bin/tritonserver"
        return (binary, None) if binary.is_file() else None


# --------------------------------------------------------------------------- check 1: torch family

# Which torch release a sibling was built for, as an inclusive (lowest, highest) torch (major, minor);
# highest None: any later torch. Sources: the siblings' own Requires-Dist (torchvision 0.28.0 declares
# torch==2.13.0; torchaudio 2.10.0 torch==2.10.0; torchaudio 2.11.1 torch>=2.11), pytorch/audio#4212
# ("torchaudio 2.11 supports torch>=2.11", libtorch stable ABI) and torchcodec's README table.
_TORCHCODEC = {
    (0, 0): ((2, 4), (2, 4)),  # 0.0.3
    (0, 1): ((2, 5), (2, 5)),
    (0, 2): ((2, 6), (2, 6)),
    (0, 3): ((2, 7), (2, 7)),
    (0, 4): ((2, 7), (2, 7)),
    (0, 5): ((2, 7), (2, 7)),
    (0, 6): ((2, 8), (2, 8)),
    (0, 7): ((2, 8), (2, 8)),
    (0, 8): ((2, 9), (2, 9)),
    (0, 9): ((2, 9), (2, 9)),
    (0, 10): ((2, 10), (2, 10)),
    (0, 11): ((2, 11), (2, 11)),
    (0, 12): ((2, 11), None),  # stable ABI from here on
}
FAMILY = ("torchvision", "torchaudio", "torchcodec")


def torch_range(name: str, version: str) -> tuple[tuple[int, int], tuple[int, int] | None] | None:
    v = release(version) + (0, 0)
    if name == "torchvision" and v[0] == 0 and v[1] >= 15:
        return (2, v[1] - 15), (2, v[1] - 15)  # torchvision 0.(N+15) is built for torch 2.N
    if name == "torchaudio" and v[0] == 2 and v[1] <= 10:
        return (2, v[1]), (2, v[1])
    if name == "torchaudio" and v[:2] == (2, 11):
        return (2, 11), None
    if name == "torchcodec":
        return _TORCHCODEC.get(v[:2])
    return None


def suggested(name: str, torch: tuple[int, ...]) -> str:
    """The sibling release to pair with torch 2.N."""
    minor = torch[1] if len(torch) > 1 else 0
    if name == "torchvision":
        return f"torchvision==0.{minor + 15}.*"
    if name == "torchaudio":
        return f"torchaudio==2.{minor}.*" if minor <= 10 else "torchaudio==2.11.*"
    fits = [k for k, (lo, hi) in _TORCHCODEC.items() if lo <= (2, minor) and (hi is None or (2, minor) <= hi)]
    return f"torchcodec=={max(fits)[0]}.{max(fits)[1]}.*" if fits else "torchcodec (see its README's table)"


def check_torch_family(env: Env) -> list[Problem]:
    c = "torch-family"
    torch = env.dist("torch")
    if torch is None:
        return [Problem(c, "torch is not installed", "pip install -c constraints.txt torch==2.13.0")]
    problems = []
    t_label = local_label(torch.version)
    t_minor = release(torch.version)[:2]
    for name in FAMILY:
        d = env.dist(name)
        if d is None:
            continue
        label = local_label(d.version)
        url = index_url(t_label)
        reinstall = f"pip install --force-reinstall --no-deps '{suggested(name, t_minor)}' --index-url {url}"
        declared = torch_requirement(d)
        rng = torch_range(name, d.version)
        in_table = rng is not None and rng[0] <= t_minor and (rng[1] is None or t_minor <= rng[1])
        if declared and not satisfies(torch.version, declared):
            problems.append(
                Problem(
                    c, f"{name} {d.version} requires torch{declared}, found torch {torch.version}", reinstall
                )
            )
        elif rng is not None and not in_table:
            want = f"{rng[0][0]}.{rng[0][1]}" + ("+" if rng[1] is None else "")
            problems.append(
                Problem(
                    c, f"{name} {d.version} is built for torch {want}, found torch {torch.version}", reinstall
                )
            )
        elif rng is None and not declared:
            problems.append(
                Problem(
                    c,
                    f"{name} {d.version} beside torch {torch.version}: a pair the doctor has no record of",
                    f"check {name}'s compatibility table, or {reinstall}",
                    WARNING,
                )
            )
        if label and t_label and label != t_label:
            fix = (
                f"pip install --force-reinstall --no-deps {name}=={d.public} --index-url {index_url(t_label)}"
            )
            problems.append(
                Problem(
                    c, f"{name} {d.version} is a +{label} build, torch {torch.version} is +{t_label}", fix
                )
            )
        elif (label is None) != (t_label is None):
            problems.append(
                Problem(
                    c,
                    f"{name} {d.version} and torch {torch.version}: one has no CUDA variant tag, "
                    "so they may come from different indexes",
                    f"install both from one index: pip install --force-reinstall --no-deps {name}=={d.public} "
                    f"--index-url {index_url(t_label)}",
                    WARNING,
                )
            )
    return problems


# --------------------------------------------------------------------------- check 2: CUDA libraries


def torch_cuda_major(env: Env, torch: Dist) -> int | None:
    """From torch's variant tag; for an untagged (PyPI) torch, from what torch's own libraries NEED."""
    major = cuda_major(local_label(torch.version))
    if major is not None or local_label(torch.version) is not None:
        return major
    votes: Counter[int] = Counter()
    for lib in (torch.site / "torch" / "lib").glob("*.so*"):
        for n in elf_needed(lib) or []:
            dep = cuda_dependency(n)
            if dep:
                votes[dep[0]] += 1
    return votes.most_common(1)[0][0] if votes else None


def check_cuda_libs(env: Env) -> list[Problem]:
    c = "cuda-libs"
    torch = env.dist("torch")
    if torch is None:
        return [Problem(c, "torch is not installed: no CUDA major to hold libraries to", level=SKIPPED)]
    major = torch_cuda_major(env, torch)
    if major is None:
        why = "a CPU build" if local_label(torch.version) == "cpu" else "not a CUDA build"
        return [
            Problem(
                c, f"torch {torch.version} is {why}: no CUDA major to hold other libraries to", level=SKIPPED
            )
        ]
    t_label = local_label(torch.version)
    # package -> [(file, needed lib, its CUDA major, vendored)]
    offenders: dict[str, list[tuple[Path, str, int, bool]]] = {}
    owners: dict[str, Dist | None] = {}
    for path in env.shared_libraries():
        for needed in elf_needed(path) or []:
            dep = cuda_dependency(needed)
            if dep and dep[0] != major:
                owner = env.owner(path)
                key = owner.name if owner else "?"
                owners[key] = owner
                offenders.setdefault(key, []).append((path, needed, dep[0], dep[1]))
    problems = []
    for key, hits in sorted(offenders.items()):
        owner = owners[key]
        path, needed, other, vendored = hits[0]
        files = {h[0] for h in hits}
        who = f"{owner.name} {owner.version}" if owner else "a file no RECORD lists"
        more = f" (and {len(files) - 1} more file{'s' * (len(files) > 2)})" if len(files) > 1 else ""
        message = f"{who}: {env.relative(path)} NEEDs {needed} (CUDA {other}), but torch {torch.version} is CUDA {major}{more}"
        if owner and owner.name in ("torch", *FAMILY):
            fix = (
                f"reinstall {owner.name} built for {t_label or f'CUDA {major}'} from the PyTorch index: pip install "
                f"--force-reinstall --no-deps {owner.name}=={owner.public} --index-url {index_url(t_label)}"
            )
        elif owner:
            fix = f"install a build of {owner.name} made for CUDA {major} (a +{t_label or f'cu{major}x'} wheel), or pip uninstall {owner.name}"
        else:
            fix = f"remove {path} or find what put it there"
        # A vendored copy (auditwheel-renamed) loads beside torch's runtime instead of in its place.
        level = WARNING if all(h[3] for h in hits) else ERROR
        problems.append(Problem(c, message + (" [vendored copy]" if level == WARNING else ""), fix, level))
    return problems


# --------------------------------------------------------------------------- check 3: numpy vs stub

def triton_version(env: Env, stub: Path) -> tuple[int, ...] | None:
    pytriton = env.dist("nvidia-pytriton")
    return stub_numpy.triton_version(stub, pytriton.public if pytriton else None)


def check_numpy_stub(env: Env, stub: Path | None = None) -> list[Problem]:
    c = "numpy-stub"
    stubs = [stub] if stub else env.stubs()
    if not stubs:
        return [
            Problem(
                c,
                f"no Triton python backend stub for Python {env.python} found: nothing to check",
                level=SKIPPED,
            )
        ]
    numpy = env.dist("numpy")
    if numpy is None:
        return [
            Problem(
                c,
                "numpy is not installed; the python backend stub imports it",
                "pip install -c constraints.txt 'numpy<2'",
            )
        ]
    if release(numpy.version)[:1] < (2,):
        return []
    problems = []
    fix = "pip install -c constraints.txt 'numpy<2'"
    for s in stubs:
        tv = triton_version(env, s)
        if tv is None:
            problems.append(
                Problem(
                    c,
                    f"numpy {numpy.version} with a stub of unknown Triton version ({s}); "
                    f"stubs before Triton {stub_numpy.NUMPY2_SINCE[0]}.{stub_numpy.NUMPY2_SINCE[1]} corrupt BYTES tensors under numpy 2",
                    fix,
                    WARNING,
                )
            )
        elif tv < stub_numpy.NUMPY2_SINCE:
            version = ".".join(map(str, tv))
            problems.append(
                Problem(
                    c,
                    f"numpy {numpy.version} with Triton {version}'s stub ({s}): BYTES tensors get corrupted",
                    fix,
                )
            )
    return problems


# --------------------------------------------------------------------------- check 4: tritonserver


def check_triton(env: Env, timeout: float = 30.0) -> list[Problem]:
    c = "triton"
    problems = []
    found = env.tritonserver()
    install = (
        "pip install --no-deps nvidia-pytriton==0.7.0 (make setup), or use NVIDIA's tritonserver container"
    )
    if found is None:
        problems.append(
            Problem(c, "tritonserver not found (pytriton wheel, PATH, /opt/tritonserver/bin)", install)
        )
    else:
        binary, libs = found
        run_env = dict(os.environ)
        if libs is not None:
            run_env["LD_LIBRARY_PATH"] = os.pathsep.join(
                filter(None, [str(libs), run_env.get("LD_LIBRARY_PATH")])
            )
        try:
            out = subprocess.run(
                [str(binary), "--help"],
                capture_output=True,
                text=True,
                errors="replace",
                timeout=timeout,
                env=run_env,
            )
            text = out.stdout + out.stderr
            if "Usage: tritonserver" not in text:  # --help prints usage and exits 1
                last = (text.strip().splitlines() or [f"exit code {out.returncode}"])[-1]
                problems.append(Problem(c, f"{binary} --help does not run: {last}", f"reinstall: {install}"))
        except (OSError, subprocess.TimeoutExpired) as e:
            problems.append(Problem(c, f"{binary} --help does not run: {e}", f"reinstall: {install}"))
    stubs = env.stubs()
    if not stubs:
        problems.append(Problem(c, f"no python backend stub for Python {env.python}", install))
    for stub in stubs:
        if not os.access(stub, os.X_OK):
            problems.append(Problem(c, f"{stub} is not executable", f"chmod +x {stub}"))
        wants = {
            m.group(1) for n in elf_needed(stub) or [] for m in [re.match(r"libpython(\d+\.\d+)", n)] if m
        }
        if wants and env.python not in wants:
            problems.append(
                Problem(
                    c,
                    f"{stub} embeds Python {', '.join(sorted(wants))}, these packages are for Python {env.python}",
                    f"install the project with python{', '.join(sorted(wants))}",
                )
            )
    return problems


# --------------------------------------------------------------------------- running it


@dataclass
class Report:
    sites: list[str]
    problems: list[Problem] = field(default_factory=list)

    def count(self, level: str) -> int:
        return sum(p.level == level for p in self.problems)

    def status(self, check: str) -> str:
        levels = {p.level for p in self.problems if p.check == check}
        return next((lv for lv in (ERROR, WARNING, SKIPPED) if lv in levels), "ok")

    def failed(self, strict: bool = False) -> bool:
        return self.count(ERROR) > 0 or (strict and self.count(WARNING) > 0)

    def as_json(self, strict: bool = False) -> dict:
        return {
            "ok": not self.failed(strict),
            "site_packages": self.sites,
            "checks": {name: self.status(name) for name in CHECKS},
            "problems": [asdict(p) for p in self.problems],
        }

    def as_text(self, env: Env, strict: bool = False) -> str:
        lines = []
        rank = {ERROR: 0, WARNING: 1, SKIPPED: 2}
        for p in sorted(self.problems, key=lambda p: (rank[p.level], CHECKS.index(p.check))):
            lines.append(
                f"{p.level.upper():8}[{p.check}] {p.message}" + (f" -- fix: {p.fix}" if p.fix else "")
            )
        counts = (
            f"{self.count(ERROR)} error(s), {self.count(WARNING)} warning(s), {self.count(SKIPPED)} skipped"
        )
        if self.failed(strict):
            lines.append(f"FAILED: {counts} in {', '.join(self.sites)}")
        else:
            versions = ", ".join(f"{d.name} {d.version}" for n in ("torch", "numpy") if (d := env.dist(n)))
            lines.append(f"OK: {versions or 'no torch, no numpy'}; {len(CHECKS)} checks, {counts}")
        return "\n".join(lines)


def diagnose(env: Env, stub: Path | None = None, skip_triton: bool = False) -> Report:
    report = Report([str(s) for s in env.sites])
    report.problems += check_torch_family(env)
    report.problems += check_cuda_libs(env)
    report.problems += check_numpy_stub(env, stub)
    if skip_triton:
        report.problems.append(Problem("triton", "not checked (--skip-triton)", level=SKIPPED))
    else:
        report.problems += check_triton(env)
    return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.doctor", description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--site-packages", action="append", type=Path, metavar="DIR", help="default: this interpreter's"
    )
    ap.add_argument(
        "--stub", type=Path, help="the python backend stub to check numpy against (default: found)"
    )
    ap.add_argument("--skip-triton", action="store_true", help="do not look for or run tritonserver")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--strict", action="store_true", help="warnings fail too")
    args = ap.parse_args(argv)
    env = Env(args.site_packages or default_sites())
    report = diagnose(env, args.stub, args.skip_triton)
    print(
        json.dumps(report.as_json(args.strict), indent=2) if args.json else report.as_text(env, args.strict)
    )
    return 1 if report.failed(args.strict) else 0


if __name__ == "__main__":
    sys.exit(main())
