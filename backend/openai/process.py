"""The OpenAI service as a child process of the launcher (or of a test): started once Triton is
ready, and ready itself only when its /health says the Triton model is."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from backend.process_tree import exec_dying_with_this_process, free_port

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PORT = 9000
API_KEY_ENV = "DSV4_OPENAI_API_KEY"  # the key travels here, not on the command line (ps shows that)


class OpenAIProcess:
    """`python -m backend.openai` beside a Triton server. Port 0 picks a free port. Use as a
    context manager, or start() / stop()."""

    def __init__(self, triton_grpc: str, port: int = DEFAULT_PORT, host: str = "127.0.0.1",
                 tokenizer: str | None = None, api_key: str | None = None, chat_template: str | None = None,
                 model: str = "deepseek_v4", log_path: str | os.PathLike | None = None,
                 startup_timeout_s: float = 60.0, triton_metrics: str | None = None,
                 model_json: str | os.PathLike | None = None, extra_args: tuple[str, ...] = (),
                 launcher: tuple[str, ...] = ()):
        self.triton_grpc, self.host, self.tokenizer = triton_grpc, host, tokenizer
        local = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        self.port = port or free_port(local)
        self.api_key, self.chat_template, self.model = api_key, chat_template, model
        self.triton_metrics = triton_metrics  # Triton's /metrics URL, served again on the API port
        self.model_json = model_json  # the served model's limits, checked before a request is sent
        self.extra_args = tuple(extra_args)  # more of `python -m backend.openai`'s options (its bounds)
        self.launcher = tuple(launcher)  # python's own options before `-m backend.openai` (e.g. -m cProfile -o F)
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None
        self._local = local

    @property
    def base_url(self) -> str:
        """What the openai SDK takes as base_url."""
        return f"http://{self._local}:{self.port}/v1"

    def command(self) -> list[str]:
        command = [sys.executable, *self.launcher, "-m", "backend.openai", "--triton-grpc", self.triton_grpc,
                   "--host", self.host, "--port", str(self.port), "--model", self.model]
        if self.tokenizer:
            command += ["--tokenizer", self.tokenizer]
        if self.chat_template:
            command += ["--chat-template", self.chat_template]
        if self.triton_metrics:
            command += ["--triton-metrics", self.triton_metrics]
        if self.model_json:
            command += ["--model-json", str(self.model_json)]
        return command + list(self.extra_args)

    def start(self) -> OpenAIProcess:
        env = dict(os.environ)
        env.pop(API_KEY_ENV, None)
        if self.api_key:
            env[API_KEY_ENV] = self.api_key  # not on the command line, where ps shows it
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        log = open(self.log_path, "ab") if self.log_path else None  # noqa: SIM115 (the child holds it)
        try:
            self.process = subprocess.Popen(exec_dying_with_this_process(self.command()), env=env, cwd=REPO_ROOT,
                                            stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT if log else None)
        finally:
            if log:
                log.close()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def is_ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://{self._local}:{self.port}/health", timeout=2) as response:
                return response.status == 200
        except (urllib.error.URLError, OSError):
            return False

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"the OpenAI service exited with code {self.process.returncode} before it "
                                   f"was ready (log: {self.log_path or 'stderr'})")
            if self.is_ready():
                return
            time.sleep(0.2)
        raise RuntimeError(f"the OpenAI service was not ready after {self.startup_timeout_s:.0f} s")

    def stop(self) -> int | None:
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)  # uvicorn: stop accepting, finish responses (10 s at most)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        return process.returncode

    def __enter__(self) -> OpenAIProcess:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def tokenizer_dir(model_json: str | os.PathLike) -> str | None:
    """The checkpoint directory whose tokenizer_config.json holds the chat template, from the
    model.json Triton serves (model and tokenizer resolved as the backend resolves them)."""
    from backend.engine_setup import load_engine_args

    tokenizer = load_engine_args(model_json).get("tokenizer")
    return tokenizer if tokenizer and Path(tokenizer).is_dir() else None


# each streamed token is an SSE write (a syscall) and a gRPC read in the front's one event loop: on a
# many-core GPU host several processes share the port, so the front does not cap the server's tok/s
AUTO_WORKERS_MAX = 4


def auto_workers() -> int:
    """One process per 4 cores, 1 to AUTO_WORKERS_MAX: Triton, the engine and the clients need the rest."""
    return max(1, min(AUTO_WORKERS_MAX, (os.cpu_count() or 1) // 4))


def workers_arg(value: str) -> int:
    """--workers' value (here and the launcher's --openai-workers): 'auto' or a count of 1 or more."""
    if value == "auto":
        return auto_workers()
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: a number of processes, 1 or more, or auto")
    return n
