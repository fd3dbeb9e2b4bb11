"""Start a real Triton Inference Server serving model_repository/ with the `deepseek` backend.

    python -m backend.serve [--model DIR] [--engine-args JSON] [--http-port 8000 --grpc-port 8001
                            --metrics-port 8002] [--host 127.0.0.1] [--admin-key-file F] [--workdir DIR]
                            [--drain-timeout-s 30] [--no-restart] [--allow-model-control]

Finds `tritonserver` (on PATH in NVIDIA's containers, else inside the nvidia-pytriton wheel), lays
out a backends directory (the python backend with the stub for this Python, and ours as
`deepseek`), copies the model repository with the model path and engine-argument overrides applied
to model.json, binds 127.0.0.1 unless told otherwise, puts the admin APIs (shared memory, logging,
trace; model control only with --allow-model-control) behind a key, waits until ready, restarts a
server that dies (backend/supervisor.py), and stops cleanly on Ctrl-C / SIGTERM: admission stops at
once, in-flight requests run on up to the drain timeout, then it exits. Whatever way the server
ends, none of its processes or shared-memory regions remain (backend/process_tree.py).
Tests use the same code through the `TritonServer` context manager.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import importlib.metadata
import importlib.util
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import sysconfig
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from backend import stub_numpy, workdir
from backend.engine_setup import drained_marker, finalize_marker
from backend.openai.process import API_KEY_ENV as OPENAI_API_KEY_ENV
from backend.openai.process import workers_arg
from backend.ports import PortInUse, check_ports
from backend.process_tree import (
    descendants,
    exec_dying_with_this_process,
    free_port,
    kill_server_tree,
    protect_regions,
)
from backend.startup_report import HARMLESS_NOTE, harmless, headline, last_lines
from backend.supervisor import RestartPolicy, supervise

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
BACKEND_NAME = "deepseek"
ADMIN_HEADER = "admin-key"  # on gRPC the header is "triton-grpc-protocol-admin-key" (Triton adds the prefix)
# APIs a client never needs: shared memory, log and trace settings behind the admin key; model
# loading (with override files it writes and runs code in the server) stays shut unless the
# operator opts in (--allow-model-control), then behind the same key.
RESTRICTED_HTTP_APIS = "shared-memory,logging,trace"
MODEL_CONTROL_API = "model-repository"
ADMIN_KEY_ENV = "DSV4_ADMIN_KEY"
# Python backend shared memory per model instance: requests and responses travel through it, so
# it must hold a long prompt (1M tokens is ~4 MB of text) without many growth steps, yet fit in
# Docker's default 64 MB /dev/shm.
SHM_DEFAULT_BYTES = 16 << 20
SHM_GROWTH_BYTES = 16 << 20
# An HTTP body larger than this is refused by Triton before it reaches the stub (a refused 100 MB
# prompt still grew the region to 128 MB for good): Tritons that have --http-max-input-size only.
HTTP_MAX_INPUT_BYTES = 32 << 20
RESTARTS_IN_A_ROW = 10
EXIT_TIMEOUT_S = 30  # default drain timeout: how long in-flight requests may run on after SIGTERM
# After the model drained: how long Triton may take to call finalize (it looks at its models once a
# second), and once it has, to finish and exit.
FINALIZE_START_S = 2.0
FINALIZE_EXIT_S = 5.0
EXIT_POLL_S = 0.1
LOOPBACK = ("127.0.0.1", "localhost", "::1")
OPENAI_LOG = "openai.log"

_BACKEND_SHIM = '''\
# Written by backend.serve: Triton's python backend loads this file as the "deepseek" backend.
# The project's code is imported from {root} (also on PYTHONPATH).
import sys

if {root!r} not in sys.path:
    sys.path.insert(0, {root!r})

from backend.model import TritonPythonModel  # noqa: E402,F401
'''


class ServerError(RuntimeError):
    pass


@dataclass
class TritonInstall:
    binary: Path
    python_backend: Path  # folder holding libtriton_python.so
    stub: Path  # triton_python_backend_stub for the running Python
    library_path: Path | None  # extra LD_LIBRARY_PATH (the wheel's bundled libraries)


def find_tritonserver() -> TritonInstall:
    """`tritonserver` on PATH (containers: /opt/tritonserver) first, else the nvidia-pytriton wheel."""
    on_path = shutil.which("tritonserver")
    if on_path:
        root = Path(on_path).resolve().parent.parent
        python_backend = root / "backends" / "python"
        stub = python_backend / "triton_python_backend_stub"
        if stub.exists():
            return TritonInstall(Path(on_path), python_backend, stub, None)
    # find, not import: pytriton is installed without its dependencies, only for its binaries
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise ServerError("tritonserver is not on PATH and nvidia-pytriton is not installed: "
                          "run `make setup` (pip install --no-deps nvidia-pytriton==0.7.0)")
    package = Path(list(spec.submodule_search_locations)[0])
    root = package / "tritonserver"
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    stub = root / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise ServerError(f"nvidia-pytriton has no python backend stub for Python {version} ({stub})")
    libs = package.parent / "nvidia_pytriton.libs"
    return TritonInstall(root / "bin" / "tritonserver", root / "backends" / "python", stub,
                         libs if libs.is_dir() else None)


def triton_version(install: TritonInstall) -> tuple[int, ...] | None:
    try:
        pytriton = importlib.metadata.version("nvidia-pytriton")
    except importlib.metadata.PackageNotFoundError:
        pytriton = None
    return stub_numpy.triton_version(install.stub, pytriton)


def stub_numpy_problem(install: TritonInstall, numpy_version: str) -> str | None:
    """Why the stub must not start beside this numpy (it embeds this Python's), or None."""
    triton = triton_version(install)
    if stub_numpy.corrupts_bytes(numpy_version, triton):
        return (f"numpy {numpy_version} with Triton {'.'.join(map(str, triton))}'s python backend stub "
                f"({install.stub}): the stub corrupts BYTES tensors under numpy 2 (the server would say ready, then "
                f"fail every request). Fix: {stub_numpy.NUMPY_FIX}, or use Triton >= "
                f"{'.'.join(map(str, stub_numpy.NUMPY2_SINCE))}")
    return None


@functools.cache
def _help_text(binary: Path, library_path: str) -> str:
    try:
        done = subprocess.run([str(binary), "--help"], capture_output=True, text=True, timeout=30,
                              env={**os.environ, "LD_LIBRARY_PATH": library_path})
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return done.stdout + done.stderr


def server_flags(install: TritonInstall, env: dict[str, str]) -> set[str]:
    """The flags this tritonserver knows (its --help): options differ between Triton releases."""
    return set(re.findall(r"^\s*(--[a-z0-9-]+)", _help_text(install.binary, env.get("LD_LIBRARY_PATH", "")),
                          flags=re.MULTILINE))


def layout_backends(install: TritonInstall, out: Path) -> Path:
    """backends/python (Triton's python backend + our Python's stub) and backends/deepseek/model.py."""
    # copies, not symlinks: Triton refuses a backend library that resolves outside its folder
    python_dir = out / "python"
    shutil.copytree(install.python_backend, python_dir, ignore=shutil.ignore_patterns("__pycache__"),
                    dirs_exist_ok=True)
    shutil.copy2(install.stub, python_dir / "triton_python_backend_stub")
    ours = out / BACKEND_NAME
    ours.mkdir(parents=True, exist_ok=True)
    (ours / "model.py").write_text(_BACKEND_SHIM.format(root=str(REPO_ROOT)))
    version = triton_version(install)
    if version:  # beside the stub copy, as in NVIDIA's images: the model checks numpy against it
        (out / "TRITON_VERSION").write_text(".".join(map(str, version)) + "\n")
    return out


def prepare_repository(src: Path, dst: Path, model: str | None = None, engine_args: dict | None = None) -> Path:
    """Copy the model repository; in every model.json make relative paths absolute (the copy lives
    elsewhere) and apply the model path and engine-argument overrides."""
    shutil.copytree(src, dst, dirs_exist_ok=True)
    for model_json in sorted(dst.glob("*/*/model.json")):
        original = src / model_json.relative_to(dst)
        args = json.loads(model_json.read_text())
        for key in ("model", "tokenizer"):
            value = args.get(key)
            if value and value != "tiny" and not Path(value).expanduser().is_absolute():
                candidate = original.parent / value
                if candidate.exists():
                    args[key] = str(candidate.resolve())
        if model is not None:
            args["model"] = model if model == "tiny" or not Path(model).exists() else str(Path(model).resolve())
        args.update(engine_args or {})
        model_json.write_text(json.dumps(args, indent=2) + "\n")
    return dst


class TritonServer:
    """A tritonserver process serving the model repository. Use as a context manager.

    Port 0 means "pick a free port". Logs go to `<workdir>/tritonserver.log` (and to stdout with
    echo=True)."""

    def __init__(
        self,
        model: str | None = None,
        engine_args: dict | None = None,
        host: str = "127.0.0.1",
        http_port: int = 8000,
        grpc_port: int = 8001,
        metrics_port: int = 8002,
        admin_key: str | None = None,
        workdir: str | os.PathLike | None = None,
        model_repository: str | os.PathLike = DEFAULT_MODEL_REPOSITORY,
        echo: bool = False,
        startup_timeout_s: float = 600.0,
        extra_args: list[str] | None = None,
        drain_timeout_s: int = EXIT_TIMEOUT_S,
        allow_model_control: bool = False,
    ):
        self.model = model
        self.engine_args = engine_args
        self.host = host
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.http_port = http_port or free_port(local)
        self.grpc_port = grpc_port or free_port(local)
        self.metrics_port = metrics_port or free_port(local)
        self.admin_key = admin_key or secrets.token_urlsafe(24)
        self.allow_model_control = allow_model_control
        # shut: a key nobody is told; open: the admin key
        self._model_control_key = self.admin_key if allow_model_control else secrets.token_urlsafe(32)
        # several servers on one host (tests, a dev server) must not share regions
        self.shm_prefix = f"dsv4_{os.getpid()}_{self.http_port}_"
        self.keep_workdir = workdir is not None
        self.workdir = Path(workdir) if workdir is not None else None
        self.model_repository = Path(model_repository)
        self.echo = echo
        self.startup_timeout_s = startup_timeout_s
        self.drain_timeout_s = int(drain_timeout_s)
        self.extra_args = list(extra_args or [])
        self.process: subprocess.Popen | None = None
        self._tail: collections.deque[str] = collections.deque(maxlen=200)
        self._log_thread: threading.Thread | None = None
        self._local = local
        self.leftovers: dict = {}  # what reap() had to kill and remove
        self.recorded: dict[int, str] = {}  # pid -> start time of every process seen below tritonserver
        self.ended_after_drain = False  # stop() ended a drained tritonserver that never called finalize

    # URLs as clients use them (tritonclient takes host:port without a scheme).
    @property
    def http_url(self) -> str:
        return f"{self._local}:{self.http_port}"

    @property
    def grpc_url(self) -> str:
        return f"{self._local}:{self.grpc_port}"

    @property
    def metrics_url(self) -> str:
        return f"http://{self._local}:{self.metrics_port}/metrics"

    @property
    def log_path(self) -> Path:
        return self.workdir / "tritonserver.log"

    @property
    def shutdown_file(self) -> Path:
        """Where stop() writes the drain deadline for the model (backend/model.py `_poll_shutdown`)."""
        return self.workdir / "shutdown"

    def command(self, install: TritonInstall) -> list[str]:
        # Triton 2.51 takes restricted-API keys only on its command line (world-readable in
        # /proc/<pid>/cmdline): docs/RELIABILITY.md says what protects them.
        restricted = f"{RESTRICTED_HTTP_APIS}:{ADMIN_HEADER}={self.admin_key}"
        model_control = f"{MODEL_CONTROL_API}:{ADMIN_HEADER}={self._model_control_key}"
        return [
            str(install.binary),
            f"--model-repository={self.workdir / 'model_repository'}",
            f"--backend-directory={self.workdir / 'backends'}",
            # explicit: the backend unloads the model when its engine dies, so readiness says so
            "--model-control-mode=explicit",
            "--load-model=*",
            f"--http-address={self.host}",
            f"--http-port={self.http_port}",
            f"--grpc-address={self.host}",
            f"--grpc-port={self.grpc_port}",
            f"--metrics-address={self.host}",
            f"--metrics-port={self.metrics_port}",
            f"--http-restricted-api={restricted}",
            f"--grpc-restricted-protocol={restricted}",
            f"--http-restricted-api={model_control}",
            f"--grpc-restricted-protocol={model_control}",
            f"--backend-config=python,shm-default-byte-size={SHM_DEFAULT_BYTES}",
            f"--backend-config=python,shm-growth-byte-size={SHM_GROWTH_BYTES}",
            f"--backend-config=python,shm-region-prefix-name={self.shm_prefix}",
            f"--exit-timeout-secs={self.drain_timeout_s}",
            *([f"--http-max-input-size={HTTP_MAX_INPUT_BYTES}"]
              if "--http-max-input-size" in server_flags(install, self.environment(install)) else []),
            *self.extra_args,
        ]

    def environment(self, install: TritonInstall) -> dict[str, str]:
        env = dict(os.environ)
        # The stub links the system libpython; where the running Python is another build of the
        # same version (pyenv), its own libpython must win, or C modules such as _ssl fail to load.
        libdir = sysconfig.get_config_var("LIBDIR")
        own_libpython = libdir if libdir and glob.glob(os.path.join(libdir, "libpython3*.so*")) else None
        env["LD_LIBRARY_PATH"] = os.pathsep.join(p for p in (
            own_libpython, str(install.library_path) if install.library_path else None, env.get("LD_LIBRARY_PATH"))
            if p)
        # the stub embeds the first `python3` on PATH: ours, so it imports this venv's packages
        env["PATH"] = os.pathsep.join(p for p in (os.path.dirname(sys.executable), env.get("PATH")) if p)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        # the stub's embedded Python takes its file encoding from the locale: make it UTF-8
        env.setdefault("PYTHONUTF8", "1")
        if "UTF-8" not in (env.get("LC_ALL") or env.get("LC_CTYPE") or env.get("LANG") or "").upper():
            env["LC_ALL"] = "C.UTF-8"
        return env

    def check_ports(self) -> None:
        """Every port free before anything loads (ServerError naming the port and its holder)."""
        try:
            check_ports(self.host, {"HTTP": (self.http_port, "--http-port"), "gRPC": (self.grpc_port, "--grpc-port"),
                                    "metrics": (self.metrics_port, "--metrics-port")})
        except PortInUse as e:
            raise ServerError(str(e)) from None

    def start(self, restart: int = 0) -> TritonServer:
        """Lay out the work dir and start tritonserver; `restart` > 0: the log is appended to. A
        start that fails keeps the work dir (its logs are the evidence) and names it."""
        self.check_ports()
        install = find_tritonserver()
        problem = stub_numpy_problem(install, importlib.metadata.version("numpy"))
        if problem:
            raise ServerError(problem)
        if self.workdir is None:
            self.workdir = workdir.create()
        elif not restart:
            workdir.claim(self.workdir)
        for sub in ("backends", "model_repository"):
            shutil.rmtree(self.workdir / sub, ignore_errors=True)
        layout_backends(install, self.workdir / "backends")
        for marker in (self.shutdown_file, drained_marker(self.shutdown_file), finalize_marker(self.shutdown_file)):
            marker.unlink(missing_ok=True)
        prepare_repository(self.model_repository, self.workdir / "model_repository", self.model,
                           {**(self.engine_args or {}), "shutdown_file": str(self.shutdown_file)})
        log = open(self.log_path, "a" if restart else "w")  # noqa: SIM115 (closed by the log thread)
        if restart:
            log.write(f"---- restart {restart} ----\n")
        # private files and /dev/shm, SIGTERM if we die: backend/child_exec.py, then exec into tritonserver
        self.process = subprocess.Popen(
            exec_dying_with_this_process(self.command(install), private=True), env=self.environment(install),
            cwd=self.workdir, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True)  # Ctrl-C reaches us, and we forward SIGTERM
        self._log_thread = threading.Thread(target=self._pump_log, args=(log,), daemon=True)
        self._log_thread.start()
        try:
            self.wait_ready()
        except ServerError:
            self.stop(keep_workdir=True)
            raise
        except BaseException:
            self.stop()
            raise
        return self

    def _pump_log(self, log) -> None:
        with log:
            for raw in self.process.stdout:
                line = raw.decode("utf-8", "replace")
                self._tail.append(line)
                log.write(line)
                log.flush()
                if self.echo:
                    sys.stdout.write(line)
                    sys.stdout.flush()

    def log_tail(self, lines: int = 40) -> str:
        return "".join(list(self._tail)[-lines:])

    def log_lines(self) -> list[str]:
        try:
            return self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return []

    def failure_report(self, what: str) -> str:
        """Why a start failed: the cause as the headline, where the evidence is kept, the log's last lines."""
        lines = self.log_lines()
        return "\n".join([headline(lines) or what,
                          f"({what}; work dir kept: {self.workdir}, log {self.log_path})",
                          "last lines of the log:", *last_lines(lines), HARMLESS_NOTE])

    def printed_harmless_lines(self) -> bool:
        """Triton printed its GPU-probe lines (a host without a GPU): worth one line of explanation."""
        return any(harmless(line) for line in self.log_lines())

    def is_ready(self) -> bool:
        """Inference ready and the metrics endpoint answering: Triton starts its metrics service
        after the HTTP one, so a scrape right after HTTP readiness could be refused."""
        try:
            for url in (f"http://{self.http_url}/v2/health/ready", self.metrics_url):
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status != 200:
                        return False
            return True
        except (urllib.error.URLError, OSError):
            return False

    def model_names(self) -> list[str]:
        return sorted(p.parent.name for p in self.model_repository.glob("*/config.pbtxt"))

    def models_ready(self) -> bool:
        """Every model of the repository ready (the server's own readiness ignores unloaded ones,
        and the backend unloads its model when the engine dies)."""
        for name in self.model_names():
            try:
                url = f"http://{self.http_url}/v2/models/{name}/ready"
                with urllib.request.urlopen(url, timeout=2) as response:
                    if response.status != 200:
                        return False
            except (urllib.error.URLError, OSError):
                return False
        return True

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                if self._log_thread is not None:
                    self._log_thread.join(timeout=5)
                raise ServerError(self.failure_report(
                    f"tritonserver exited with code {self.process.returncode} before it was ready"))
            if self.is_ready():
                protect_regions(self.shm_prefix)
                self.record_processes()
                return
            time.sleep(0.25)
        raise ServerError(self.failure_report(f"tritonserver was not ready after {self.startup_timeout_s:.0f} s"))

    def stop(self, timeout_s: float | None = None, keep_workdir: bool = False) -> int | None:
        """SIGTERM (Triton refuses new requests and drains in-flight ones up to
        --exit-timeout-secs = drain_timeout_s), wait, kill what is left, remove the work dir (only
        the admin key where it is kept: --workdir, or `keep_workdir` after a failed start)."""
        process = self.process
        if process is not None and process.poll() is None:
            # the model ends what is still running a little before Triton's own exit timeout would
            margin = min(5.0, self.drain_timeout_s / 3)
            self.shutdown_file.write_text(f"{time.time() + self.drain_timeout_s - margin:.3f}\n")
            process.send_signal(signal.SIGTERM)
            self._wait_exit(process, self.drain_timeout_s + 15 if timeout_s is None else timeout_s)
        code = self.reap()
        if self.workdir is not None:
            if self.keep_workdir or keep_workdir:
                workdir.release(self.workdir)
            else:
                shutil.rmtree(self.workdir, ignore_errors=True)
        return code

    def _wait_exit(self, process: subprocess.Popen, timeout_s: float) -> None:
        """Wait for tritonserver to exit after SIGTERM; reap() kills what is left. Once the model has
        drained (nothing in flight, its engine stopped: backend/model.py `_mark_drained`), Triton
        calls finalize at its next look at the models (each second) and exits. Triton 2.51 sometimes
        keeps a reference to the model after gRPC streams end (seen after ~1,500 requests over
        tritonclient.grpc.aio, one stream each: every run) and then waits out its whole exit timeout
        without calling finalize: with no finalize FINALIZE_START_S after the drain there is nothing
        left to wait for."""
        deadline = time.monotonic() + timeout_s
        drained, finalizing = drained_marker(self.shutdown_file), finalize_marker(self.shutdown_file)
        drained_at = finalize_at = None
        while time.monotonic() < deadline:
            try:
                process.wait(EXIT_POLL_S)
                return
            except subprocess.TimeoutExpired:
                pass
            now = time.monotonic()
            if drained_at is None and drained.exists():
                drained_at = now
            if finalize_at is None and finalizing.exists():
                finalize_at = now
            if finalize_at is not None:
                if now - finalize_at > FINALIZE_EXIT_S:
                    print(f"tritonserver has not exited {FINALIZE_EXIT_S:.0f} s after the model's finalize; "
                          "nothing is in flight, so it is stopped now", file=sys.stderr, flush=True)
                    return
            elif drained_at is not None and now - drained_at > FINALIZE_START_S:
                self.ended_after_drain = True
                print(f"tritonserver has not called the model's finalize {FINALIZE_START_S:g} s after the drain "
                      "ended (Triton 2.51 holds the model after some gRPC streams: docs/RELIABILITY.md); "
                      "nothing is in flight, so it is stopped now", file=sys.stderr, flush=True)
                return

    def reap(self) -> int | None:
        """After tritonserver exited (or to make it): nothing of it remains, neither its python
        stubs (they outlive a crashed server) nor their shared-memory regions."""
        process, self.process = self.process, None
        self.record_processes()
        self.leftovers = kill_server_tree(process.pid if process is not None else None, self.shm_prefix,
                                          self.recorded)
        self.recorded = {}
        if process is not None:
            process.wait()
        if self._log_thread is not None:
            self._log_thread.join(timeout=5)
        return None if process is None else process.returncode

    def record_processes(self) -> None:
        """Remember the processes below tritonserver (stubs, engine cores): reap() kills those that
        left its process group, and no other (the supervisor calls this every poll)."""
        process = self.process
        if process is not None and process.poll() is None:
            self.recorded.update(descendants(process.pid))

    def __enter__(self) -> TritonServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def write_admin_key(self) -> Path:
        """The admin key in <workdir>/admin_key, readable by this user only (backend/workdir.py
        says when it goes)."""
        return workdir.write_admin_key(self.workdir, self.admin_key)

    def usage(self, admin_key_shown_as: str, openai_url: str | None = None, openai_key: bool = False) -> str:
        """The banner: where everything is, and commands that run as printed (openai_url: the OpenAI
        API's base URL when it runs; with a key its command names it KEY)."""
        model = "deepseek_v4"
        generate = json.dumps({"text_input": "Hello", "parameters": {"max_tokens": 32, "temperature": 0}})
        stream = json.dumps({"text_input": "Hello", "stream": True, "parameters": {"max_tokens": 32}})
        completion = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 32})
        bearer = " -H 'Authorization: Bearer KEY'" if openai_key else ""
        openai = [f"  curl -s {openai_url}/completions -H 'Content-Type: application/json'{bearer} -d '{completion}'"
                  + ("   # KEY: the OpenAI API key it was given" if openai_key else "")] if openai_url else []
        apis = "model control, " if self.allow_model_control else ""
        return "\n".join([
            f"Triton is ready: HTTP {self.http_url}, gRPC {self.grpc_url}, metrics {self.metrics_url}",
            f"admin key (HTTP header '{ADMIN_HEADER}', gRPC 'triton-grpc-protocol-{ADMIN_HEADER}'; for {apis}"
            f"shared memory, logging, trace): {admin_key_shown_as}",
            "model control (load/unload) is " + ("open to the admin key: it equals code execution in the server"
                                                 if self.allow_model_control else
                                                 "off (--allow-model-control turns it on)"),
            "",
            f"  curl -s http://{self.http_url}/v2/models/{model}/generate -d '{generate}'",
            f"  curl -sN http://{self.http_url}/v2/models/{model}/generate_stream -d '{stream}'",
            f"  curl -s {self.metrics_url} | grep deepseek:",
            f"  {python_command()} -m client 'Hello' --stream --url {self.grpc_url}",
            *openai,
            "",
            "Ctrl-C stops the server.",
        ])


def parse_engine_args(text: str) -> dict:
    """--engine-args: a JSON object merged into model.json (ValueError with the reason)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"--engine-args is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError("--engine-args must be a JSON object")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m backend.serve", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="checkpoint directory (default: model.json's; 'tiny' = tiny test model)")
    parser.add_argument("--engine-args", default="{}", help='JSON object merged into model.json, e.g. '
                        '\'{"max_model_len": 8192, "engine": "vllm"}\'')
    parser.add_argument("--http-port", type=int, default=8000)
    parser.add_argument("--grpc-port", type=int, default=8001)
    parser.add_argument("--metrics-port", type=int, default=8002)
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    parser.add_argument("--admin-key", help="admin-key header value for the admin APIs; visible in the process "
                        f"list: prefer --admin-key-file or ${ADMIN_KEY_ENV} (default: random, in <workdir>/admin_key)")
    parser.add_argument("--admin-key-file", help="read the admin key from this file (e.g. /run/secrets/admin_key)")
    parser.add_argument("--print-admin-key", action="store_true", help="print the admin key when ready")
    parser.add_argument("--allow-model-control", action="store_true",
                        help="open model load/unload to the admin key (a load with override files runs code in the "
                        "server: the key then equals code execution)")
    parser.add_argument("--no-restart", action="store_true",
                        help="exit 1 when tritonserver dies instead of restarting it (an orchestrator restarts)")
    parser.add_argument("--max-restarts", type=int, default=RESTARTS_IN_A_ROW,
                        help=f"restarts in a row that may fail before the launcher gives up (default {RESTARTS_IN_A_ROW})")
    parser.add_argument("--workdir", help="keep the generated backends/, model_repository/ and log here")
    parser.add_argument("--drain-timeout-s", type=int, default=EXIT_TIMEOUT_S,
                        help="on SIGTERM / Ctrl-C: how long in-flight requests may run on (default 30)")
    parser.add_argument("--model-repository", default=str(DEFAULT_MODEL_REPOSITORY))
    # -- the OpenAI-compatible API (backend/openai), its own process beside tritonserver
    parser.add_argument("--openai-port", type=int, help="also serve the OpenAI API on this port (make serve: 9000)")
    parser.add_argument("--openai-host", default="127.0.0.1", help="address the OpenAI API binds (default loopback)")
    parser.add_argument("--openai-api-key", help="require 'Authorization: Bearer KEY' on the OpenAI API; visible in "
                        "the process list: prefer --openai-api-key-file or $DSV4_OPENAI_API_KEY (default: open)")
    parser.add_argument("--openai-api-key-file", help="read the OpenAI API key from this file (e.g. /run/secrets/...)")
    parser.add_argument("--openai-max-concurrent-requests", type=int, help="requests the OpenAI API has in progress "
                        "at once (a stream until its end); more get 503 with Retry-After (default 1024)")
    parser.add_argument("--openai-max-body-bytes-in-flight", type=int, help="request-body bytes the OpenAI API reads "
                        "or parses at once; past it, 503 with Retry-After (default 64 MiB)")
    parser.add_argument("--openai-workers", type=workers_arg, help="processes serving the OpenAI API's port: N, or auto (one per 4 "
                        "cores, at most 4); the bounds above are split between them (default auto)")
    args = parser.parse_args(argv)
    try:
        engine_args = parse_engine_args(args.engine_args)
    except ValueError as e:
        parser.error(str(e))

    if args.host not in LOOPBACK:
        print(f"warning: binding {args.host}: inference is open to every host that reaches it (only the "
              "admin APIs need the key)", file=sys.stderr)
    try:
        admin_key = read_key(args.admin_key, args.admin_key_file, ADMIN_KEY_ENV)
        openai_key = read_key(args.openai_api_key, args.openai_api_key_file, OPENAI_API_KEY_ENV)
    except OSError as e:
        parser.error(f"key file: {e}")
    server = TritonServer(model=args.model, engine_args=engine_args, host=args.host, http_port=args.http_port,
                          grpc_port=args.grpc_port, metrics_port=args.metrics_port, admin_key=admin_key,
                          workdir=args.workdir, model_repository=args.model_repository, echo=True,
                          drain_timeout_s=args.drain_timeout_s, allow_model_control=args.allow_model_control)
    try:
        if args.openai_port:  # before anything loads, with Triton's own ports (start())
            check_ports(args.openai_host, {"OpenAI API": (args.openai_port, "--openai-port")})
        server.start()
    except (ServerError, PortInUse) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # start() has stopped the server already
        return 130
    if server.printed_harmless_lines():
        print(f"note: {HARMLESS_NOTE}", flush=True)
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    if args.print_admin_key:
        shown = server.admin_key
    elif admin_key is None:
        shown = f"random, in {server.write_admin_key()} (--print-admin-key prints it)"
    else:
        shown = "as given"
    try:
        front = start_openai(server, args.openai_port, args.openai_host, openai_key, openai_bounds(args))
    except RuntimeError as e:
        cause = headline_of_front_log(server.workdir / OPENAI_LOG)
        print(f"error: {cause or e}\n({e}; work dir kept: {server.workdir})", file=sys.stderr)
        server.stop(keep_workdir=True)
        return 1
    print("\n" + server.usage(shown, front.base_url if front else None, openai_key is not None) + "\n", flush=True)
    try:
        return supervise(server, stop, RestartPolicy(enabled=not args.no_restart, max_restarts=args.max_restarts),
                         front)
    finally:
        if front is not None:
            front.stop()


# -- the OpenAI-compatible API beside tritonserver ------------------------------------------------

def openai_bounds(args) -> tuple[str, ...]:
    """The launcher's --openai-max-* and --openai-workers options, as `python -m backend.openai` takes them."""
    bounds = {"--max-concurrent-requests": args.openai_max_concurrent_requests,
              "--max-body-bytes-in-flight": args.openai_max_body_bytes_in_flight,
              "--workers": args.openai_workers}
    return tuple(part for flag, value in bounds.items() if value is not None for part in (flag, str(value)))


def start_openai(server: TritonServer, port: int | None, host: str, api_key: str | None,
                 extra_args: tuple[str, ...] = ()):
    """Start `python -m backend.openai` once Triton is ready (None without a port); it is ready
    when its /health says the model is and the engine answers (Triton's metrics tell it). It talks
    to Triton's gRPC port, so it rides out a restart."""
    if port is None:
        return None
    from backend.openai.process import OpenAIProcess, tokenizer_dir

    model_json = server.workdir / "model_repository" / "deepseek_v4" / "1" / "model.json"
    front = OpenAIProcess(server.grpc_url, port=port, host=host, tokenizer=tokenizer_dir(model_json),
                          api_key=api_key, log_path=server.workdir / OPENAI_LOG, triton_metrics=server.metrics_url,
                          model_json=model_json, extra_args=extra_args)
    front.start()
    print(f"OpenAI API ready: {front.base_url} (log {front.log_path})", flush=True)
    return front


def headline_of_front_log(path: Path) -> str | None:
    """The OpenAI front's last error line (uvicorn logs "ERROR: ..." before it exits)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return None
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith(("ERROR", "Error"))]
    return errors[-1] if errors else None


def python_command() -> str:
    """This interpreter as a user can type it from here (`.venv/bin/python`): `python` outside the
    venv lacks tritonclient."""
    relative = os.path.relpath(sys.executable)
    return sys.executable if relative.startswith("..") else relative


def read_key(given: str | None, key_file: str | None, env: str) -> str | None:
    """A key from its option, else its file, else its environment variable, else None (the admin
    key: a random one; the OpenAI key: none)."""
    if given:
        return given
    if key_file:
        return Path(key_file).read_text().strip() or None
    return os.environ.get(env) or None


if __name__ == "__main__":
    code = main()
    # Everything it started is stopped and reaped by now. The interpreter's own teardown (torch, which
    # the tiny checkpoint's writer imports) took 0.5-1.5 s of a SIGTERM's exit on a loaded machine.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
