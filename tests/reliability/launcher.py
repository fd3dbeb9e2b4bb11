"""`python -m backend.serve` as a child process, for the tests of what the launcher does on its own:
readiness as it reports it, the server's processes and shared-memory regions, its output."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

from backend.process_tree import SHM_DIR, alive, processes_with_arg
from backend.serve import REPO_ROOT, free_port

ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 4}


class Launcher:
    def __init__(self, workdir: Path, *flags: str, engine_args: dict | None = None, drain_s: int = 5):
        self.workdir = workdir
        self.http_port, grpc_port, metrics_port = free_port(), free_port(), free_port()
        self.http_url, self.grpc_url = f"127.0.0.1:{self.http_port}", f"127.0.0.1:{grpc_port}"
        self.metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "backend.serve", "--http-port", str(self.http_port), "--grpc-port",
             str(grpc_port), "--metrics-port", str(metrics_port), "--workdir", str(workdir), "--drain-timeout-s",
             str(drain_s), "--engine-args", json.dumps(engine_args or ENGINE_ARGS), *flags],
            cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.output: list[str] = []
        self.reader = threading.Thread(target=lambda: self.output.extend(self.process.stdout), daemon=True)
        self.reader.start()
        self.shm_prefix = f"dsv4_{self.process.pid}_{self.http_port}_"
        self.readies = 0

    def wait_exit(self, timeout_s: float) -> int:
        """The launcher's exit code, once what it printed last is read too (the reader thread can lag behind the
        exit on a loaded machine; it ends at the pipe's end, or gives up after 10 s where a child holds the pipe)."""
        code = self.process.wait(timeout_s)
        self.reader.join(10)
        return code

    def log(self) -> str:
        """What the launcher printed (tritonserver's log included)."""
        return "".join(self.output)

    def tail(self, lines: int = 40) -> str:
        """The launcher's last lines, without Triton's start-up tables (for assertion messages)."""
        kept = [line for line in self.log().splitlines() if not line.startswith(("|", "+"))]
        return "\n".join(kept[-lines:])

    def server_log(self) -> str:
        return (self.workdir / "tritonserver.log").read_text(errors="replace")

    def ready(self) -> bool:
        try:
            url = f"http://{self.http_url}/v2/models/deepseek_v4/ready"
            with urllib.request.urlopen(url, timeout=2) as r:
                return r.status == 200
        except OSError:
            return False

    def wait_ready(self, timeout_s: float = 240) -> None:
        """Ready as the launcher sees it (it prints its usage or says it serves again), and as a client sees it."""
        deadline = time.monotonic() + timeout_s
        marks = ("Triton is ready", "serving again")
        while not (sum(self.log().count(m) for m in marks) > self.readies and self.ready()):
            assert self.process.poll() is None and time.monotonic() < deadline, self.tail()
            time.sleep(0.25)
        self.readies += 1

    def server_pids(self) -> list[int]:
        """tritonserver and its stubs: every process naming this server's shared-memory prefix."""
        return [pid for pid in processes_with_arg(self.shm_prefix) if alive(pid)]

    def regions(self) -> list[Path]:
        """This server's regions in the host's /dev/shm (none while the server has its own)."""
        return sorted(SHM_DIR.glob(f"{self.shm_prefix}*"))

    def server_regions(self) -> list[Path]:
        """This server's regions where its processes see them: their own /dev/shm, else the host's."""
        for pid in self.server_pids():
            found = sorted(Path(f"/proc/{pid}/root{SHM_DIR}").glob(f"{self.shm_prefix}*"))
            if found:
                return found
        return []

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
