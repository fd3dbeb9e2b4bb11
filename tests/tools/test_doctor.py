"""tools.doctor on synthetic site-packages trees (tests/tools/fake_site.py) and on this very venv."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.fake_site import (
    PY,
    add_dist,
    cuda13_codec_site,
    elf_bytes,
    good_cu129_site,
    pytriton_layout,
    so,
)
from tools import doctor
from tools.doctor import ERROR, SKIPPED, WARNING, Env

REPO = Path(__file__).resolve().parents[2]


def run_doctor(*args, cwd=REPO):
    out = subprocess.run(
        [sys.executable, "-m", "tools.doctor", *args], cwd=cwd, capture_output=True, text=True, timeout=60
    )
    return out.returncode, out.stdout + out.stderr


def errors(problems):
    return [p for p in problems if p.level == ERROR]


# --------------------------------------------------------------------------- a CUDA 13 library beside a CUDA 12 torch


def test_torchcodec_needing_cuda13_nvrtc_is_flagged(tmp_path):
    site = cuda13_codec_site(tmp_path)
    problems = doctor.check_cuda_libs(Env([site]))
    [p] = errors(problems)
    assert "torchcodec 0.9.1" in p.message
    assert "torchcodec/libtorchcodec_image.so NEEDs libnvrtc.so.13 (CUDA 13)" in p.message
    assert "torch 2.9.1+cu129 is CUDA 12" in p.message
    assert "--index-url https://download.pytorch.org/whl/cu129" in p.fix and "extra-index" not in p.fix
    # The CLI fails on it, one line per problem, and says so in JSON too.
    rc, text = run_doctor("--site-packages", str(site), "--skip-triton")
    assert rc == 1, text
    assert any(line.startswith("ERROR") and "libnvrtc.so.13" in line for line in text.splitlines())
    rc, text = run_doctor("--site-packages", str(site), "--skip-triton", "--json")
    report = json.loads(text)
    assert rc == 1 and report["ok"] is False and report["checks"]["cuda-libs"] == "error"
    assert report["checks"]["triton"] == "skipped"


def test_good_cu129_set_passes(tmp_path):
    site = good_cu129_site(tmp_path)
    rc, text = run_doctor("--site-packages", str(site), "--skip-triton", "--strict")
    assert rc == 0, text
    assert text.splitlines()[-1].startswith("OK: torch 2.13.0+cu129, numpy 1.26.4")


def test_cuda_major_read_from_untagged_torch_libraries(tmp_path):
    # A PyPI torch has no +cuXYZ tag: its own libraries say which CUDA it wants.
    site = tmp_path / "site"
    add_dist(site, "torch", "2.13.0", {"torch/lib/libtorch_cuda.so": so("libcudart.so.13", "libnvrtc.so.13")})
    add_dist(site, "vllm", "0.29.0", {"vllm/_C.abi3.so": so("libcudart.so.12")})
    [p] = doctor.check_cuda_libs(Env([site]))
    assert p.level == ERROR and "vllm 0.29.0: vllm/_C.abi3.so NEEDs libcudart.so.12 (CUDA 12)" in p.message
    assert "torch 2.13.0 is CUDA 13" in p.message and "pip uninstall vllm" in p.fix


def test_cpu_torch_skips_the_cuda_check_and_says_so(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "torch", "2.13.0+cpu")
    add_dist(site, "torchcodec", "0.9.1", {"torchcodec/libtorchcodec_image.so": so("libnvrtc.so.13")})
    [p] = doctor.check_cuda_libs(Env([site]))
    assert p.level == SKIPPED and "CPU build" in p.message


def test_vendored_cuda_copy_is_a_warning_and_unowned_files_are_named(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "torch", "2.13.0+cu130")
    pytriton_layout(site)  # its stub NEEDs libcudart-09529672.so.12.6.77, a copy the wheel carries
    (site / "stray").mkdir()
    (site / "stray/libfoo.so.1").write_bytes(so("libcublas.so.12"))
    problems = doctor.check_cuda_libs(Env([site]))
    by_level = {p.level: p for p in problems}
    assert "nvidia-pytriton 0.7.0" in by_level[WARNING].message and "vendored" in by_level[WARNING].message
    assert "a file no RECORD lists: stray/libfoo.so.1 NEEDs libcublas.so.12" in by_level[ERROR].message


def test_several_files_of_one_package_make_one_line(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "torch", "2.9.1+cu129")
    files = {
        f"torchcodec/libtorchcodec_core{i}.so": so("libnppc.so.13", "libcufft.so.12") for i in range(4, 9)
    }
    add_dist(site, "torchcodec", "0.9.1", files)
    [p] = doctor.check_cuda_libs(Env([site]))
    assert "(and 4 more files)" in p.message and "torchcodec==0.9.1" in p.fix


# --------------------------------------------------------------------------- torch family


def family(tmp_path, torch, **siblings):
    site = tmp_path / "site"
    add_dist(site, "torch", torch)
    for name, (version, *requires) in siblings.items():
        add_dist(site, name, version, requires=requires)
    return doctor.check_torch_family(Env([site]))


def test_torchaudio_built_for_another_torch_is_flagged(tmp_path):
    [p] = family(tmp_path, "2.13.0+cu129", torchaudio=("2.10.0+cu129", "torch==2.10.0"))
    assert p.level == ERROR and "torchaudio 2.10.0+cu129 requires torch==2.10.0" in p.message
    assert "torchaudio==2.11.*" in p.fix and "--index-url https://download.pytorch.org/whl/cu129" in p.fix


def test_torchaudio_2_11_declares_any_later_torch(tmp_path):
    # torchaudio 2.11 is built on libtorch's stable ABI: its METADATA says torch>=2.11 (pytorch/audio#4212),
    # and vLLM 0.28-0.30 pin torchaudio==2.11.0 beside torch==2.13.0. Not a mismatch.
    assert family(tmp_path, "2.13.0+cu129", torchaudio=("2.11.1+cu129", "torch>=2.11")) == []


def test_torchaudio_2_11_without_metadata_is_judged_by_the_table(tmp_path):
    assert family(tmp_path / "a", "2.13.0+cu129", torchaudio=("2.11.0+cu129",)) == []
    [p] = family(tmp_path / "b", "2.9.1+cu129", torchaudio=("2.11.0+cu129",))
    assert p.level == ERROR and "built for torch 2.11+" in p.message and "torchaudio==2.9.*" in p.fix


@pytest.mark.parametrize(
    "torch, torchvision, ok",
    [
        ("2.13.0", "0.28.0", True),
        ("2.9.1", "0.24.1", True),
        ("2.10.0", "0.25.0", True),
        ("2.13.0", "0.27.1", False),
    ],
)
def test_torchvision_pairs_with_torch_minor_plus_15(tmp_path, torch, torchvision, ok):
    problems = family(tmp_path, f"{torch}+cu129", torchvision=(f"{torchvision}+cu129",))
    assert (problems == []) == ok, problems
    if not ok:
        assert "torchvision==0.28.*" in problems[0].fix


@pytest.mark.parametrize(
    "torch, torchcodec, level",
    [
        ("2.9.1", "0.8.1", None),
        ("2.9.1", "0.9.1", None),
        ("2.10.0", "0.9.1", ERROR),
        ("2.13.0", "0.12.0", None),
        ("2.10.0", "0.12.0", ERROR),
        ("2.13.0", "0.15.0", WARNING),
    ],
)
def test_torchcodec_table(tmp_path, torch, torchcodec, level):
    problems = family(tmp_path, f"{torch}+cu129", torchcodec=(f"{torchcodec}+cu129",))
    assert [p.level for p in problems] == ([level] if level else []), problems


def test_cuda_variant_mismatch_is_an_error_and_a_missing_tag_a_warning(tmp_path):
    [p] = family(tmp_path / "a", "2.13.0+cu129", torchvision=("0.28.0+cu130",))
    assert p.level == ERROR and "+cu130 build, torch 2.13.0+cu129 is +cu129" in p.message
    assert "--index-url https://download.pytorch.org/whl/cu129" in p.fix
    [p] = family(tmp_path / "b", "2.13.0+cu129", torchvision=("0.28.0",))
    assert p.level == WARNING and "no CUDA variant tag" in p.message


def test_missing_torch_and_broken_metadata_do_not_crash(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "numpy", "1.26.4")
    (site / "torch-2.13.0.dist-info").mkdir()  # no METADATA at all
    (site / "torchvision-0.28.0.dist-info").mkdir()
    (site / "torchvision-0.28.0.dist-info" / "METADATA").write_bytes(b"\xff\xfe garbage \x00\n")
    env = Env([site])
    [p] = doctor.check_torch_family(env)
    assert p.message == "torch is not installed"
    assert doctor.check_cuda_libs(env)[0].level == SKIPPED


def test_requirement_parsing():
    d = doctor.Dist("x", "1", ["numpy", "torch (==2.13.0)", "torch>=9; extra == 'dev'"], Path(), Path())
    assert doctor.torch_requirement(d) == "==2.13.0"
    assert doctor.satisfies("2.13.0+cu129", "==2.13.0")
    assert doctor.satisfies("2.13.1", ">=2.11,<3") and not doctor.satisfies("2.10.0", ">=2.11")
    assert doctor.satisfies("2.13.4", "==2.13.*") and not doctor.satisfies("2.14.0", "~=2.13.0")


# --------------------------------------------------------------------------- numpy vs stub


def test_numpy2_with_the_2_51_stub_is_flagged(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "numpy", "2.1.3")
    stub = pytriton_layout(site)
    [p] = doctor.check_numpy_stub(Env([site]))
    assert p.level == ERROR and "numpy 2.1.3 with Triton 2.51's stub" in p.message and str(stub) in p.message
    assert "numpy<2" in p.fix


def test_numpy1_with_the_2_51_stub_passes(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "numpy", "1.26.4")
    pytriton_layout(site)
    assert doctor.check_numpy_stub(Env([site])) == []


def test_container_stub_version_comes_from_triton_version_file(tmp_path):
    site, root = tmp_path / "site", tmp_path / "opt/tritonserver"
    add_dist(site, "numpy", "2.1.3")
    stub = root / "backends/python/triton_python_backend_stub"
    stub.parent.mkdir(parents=True)
    stub.write_bytes(so(f"libpython{PY}.so.1.0"))
    (root / "TRITON_VERSION").write_text("2.59.0\n")
    assert doctor.check_numpy_stub(Env([site], triton_root=root)) == []  # numpy 2 works from 2.52 on
    (root / "TRITON_VERSION").write_text("2.50.0\n")
    assert [p.level for p in doctor.check_numpy_stub(Env([site], triton_root=root))] == [ERROR]
    (root / "TRITON_VERSION").unlink()
    [p] = doctor.check_numpy_stub(Env([site]), stub=stub)  # --stub PATH of unknown version
    assert p.level == WARNING


def test_no_stub_means_the_numpy_check_is_skipped(tmp_path):
    site = tmp_path / "site"
    add_dist(site, "numpy", "2.1.3")
    [p] = doctor.check_numpy_stub(Env([site], triton_root=tmp_path / "none"))
    assert p.level == SKIPPED


# --------------------------------------------------------------------------- tritonserver


USAGE = "#!/bin/sh\necho 'Usage: tritonserver [options]'\nexit 1\n"
BROKEN = (
    "#!/bin/sh\necho 'tritonserver: error while loading shared libraries: libtritonserver.so' >&2\nexit 127\n"
)


def test_triton_runs_and_stub_exists(tmp_path):
    site = tmp_path / "site"
    pytriton_layout(site, server=USAGE)
    assert doctor.check_triton(Env([site], triton_root=tmp_path / "none")) == []


def test_triton_that_cannot_start_is_flagged(tmp_path):
    site = tmp_path / "site"
    pytriton_layout(site, server=BROKEN)
    [p] = doctor.check_triton(Env([site], triton_root=tmp_path / "none"))
    assert "does not run" in p.message and "error while loading shared libraries" in p.message


def test_stub_for_another_python_is_flagged(tmp_path):
    site = tmp_path / "site"
    other = "3.8" if PY != "3.8" else "3.9"
    pytriton_layout(site, python=other, server=USAGE)
    [p] = doctor.check_triton(Env([site], triton_root=tmp_path / "none"))
    assert f"no python backend stub for Python {PY}" in p.message


def test_container_stub_embedding_another_python_is_flagged(tmp_path, monkeypatch):
    root = tmp_path / "opt/tritonserver"
    (root / "bin").mkdir(parents=True)
    (root / "bin/tritonserver").write_text(USAGE)
    (root / "bin/tritonserver").chmod(0o755)
    stub = root / "backends/python/triton_python_backend_stub"
    stub.parent.mkdir(parents=True)
    stub.write_bytes(so("libpython3.99.so.1.0"))
    stub.chmod(0o644)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    messages = [p.message for p in doctor.check_triton(Env([tmp_path / "site"], triton_root=root))]
    assert any("is not executable" in m for m in messages)
    assert any("embeds Python 3.99" in m for m in messages)


# --------------------------------------------------------------------------- ELF parsing


@pytest.mark.parametrize("bits, little", [(64, True), (64, False), (32, True), (32, False)])
def test_elf_needed_reads_every_class_and_byte_order(tmp_path, bits, little):
    path = tmp_path / "lib.so"
    path.write_bytes(elf_bytes(["libnvrtc.so.13", "libc.so.6"], soname="libx.so.1", bits=bits, little=little))
    assert doctor.elf_needed(path) == ["libnvrtc.so.13", "libc.so.6"]


def test_elf_needed_survives_junk(tmp_path):
    good = elf_bytes(["libcudart.so.12"])
    cases = {
        "text.so": b"INPUT(-lfoo)\n",  # a linker script named .so
        "empty.so": b"",
        "short.so": good[:40],
        "truncated.so": good[: len(good) - 10],  # section table cut off
        "bad_class.so": good[:4] + b"\x07" + good[5:],
        "huge_offsets.so": good[:40] + b"\xff" * 8 + good[48:],
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        assert doctor.elf_needed(tmp_path / name) in (None, []), name
    assert doctor.elf_needed(tmp_path / "missing.so") is None


@pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")
def test_elf_needed_on_objects_built_by_cc(tmp_path):
    src = tmp_path / "x.c"
    src.write_text("int x(void) { return 1; }\n")
    nvrtc = tmp_path / "libnvrtc.so.13"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", nvrtc, src, "-Wl,-soname,libnvrtc.so.13"], check=True)
    image = tmp_path / "libtorchcodec_image.so"
    subprocess.run(
        [
            "cc",
            "-shared",
            "-fPIC",
            "-o",
            image,
            src,
            "-Wl,--no-as-needed",
            f"-L{tmp_path}",
            "-l:libnvrtc.so.13",
        ],
        check=True,
    )
    assert "libnvrtc.so.13" in doctor.elf_needed(image)
    if shutil.which("readelf"):  # the same list binutils reads
        for lib in (nvrtc, image):
            out = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True, check=True).stdout
            assert doctor.elf_needed(lib) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out)
    # Built into that site's layout, the real object is flagged like the synthetic one.
    site = tmp_path / "site"
    add_dist(site, "torch", "2.9.1+cu129")
    add_dist(site, "torchcodec", "0.9.1", {"torchcodec/libtorchcodec_image.so": image.read_bytes()})
    [p] = doctor.check_cuda_libs(Env([site]))
    assert "torchcodec/libtorchcodec_image.so NEEDs libnvrtc.so.13" in p.message


@pytest.mark.skipif(shutil.which("readelf") is None, reason="no readelf (binutils)")
def test_elf_needed_agrees_with_readelf_on_this_venvs_libraries():
    libs = sorted(doctor.Env(doctor.default_sites()).shared_libraries())[:60]
    if not libs:
        pytest.skip("no shared libraries in this environment")
    for lib in libs:
        out = subprocess.run(["readelf", "-d", lib], capture_output=True, text=True).stdout
        assert doctor.elf_needed(lib) == re.findall(r"\(NEEDED\)\s+Shared library: \[(.*?)\]", out), lib


@pytest.mark.parametrize(
    "needed, expected",
    [
        ("libcudart.so.12", (12, False)),
        ("libnvrtc.so.13", (13, False)),
        ("libcublasLt.so.12", (12, False)),
        ("libnvrtc-builtins.so.12.9", (12, False)),
        ("libnppicc.so.13", (13, False)),
        ("libcufft.so.11", (12, False)),
        ("libcudart-09529672.so.12.6.77", (12, True)),
        ("libcudnn.so.9", None),
        ("libnccl.so.2", None),
        ("libcudart_static.a", None),
        ("libc.so.6", None),
    ],
)
def test_cuda_dependency_names(needed, expected):
    assert doctor.cuda_dependency(needed) == expected


# --------------------------------------------------------------------------- this very environment


def test_doctor_passes_on_this_venv():
    """The venv the tests run in (sys.prefix) is the project's: the doctor must find nothing wrong."""
    rc, text = run_doctor("--json")
    report = json.loads(text)
    assert rc == 0 and report["ok"], text
    assert report["site_packages"] and all(
        Path(s).is_relative_to(sys.prefix) for s in report["site_packages"]
    )
    assert not [p for p in report["problems"] if p["level"] == ERROR]
    if os.path.isdir(Path(report["site_packages"][0]) / "pytriton"):
        assert report["checks"]["triton"] == "ok" and report["checks"]["numpy-stub"] == "ok"
