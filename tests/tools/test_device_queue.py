"""tools/device_queue.sh on the CPU: a queue started by one call runs on after that call returns, a second start is
refused while it runs, and a later follow finds it ended and copies the suite's result with the queue's log and rc."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _queue(env: dict, *args: str, out: Path, follow_s: int) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "tools/device_queue.sh", *args], cwd=ROOT, capture_output=True, text=True,
                          env={**env, "OUT": str(out), "FOLLOW_S": str(follow_s)}, timeout=follow_s + 60)


def test_a_queue_outlives_the_call_that_started_it(tmp_path):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "DEVICE_QUEUE_DIR": str(tmp_path / "queue"), "CKPT": str(tmp_path / "ckpt")}
    first = _queue(env, "start", "smoke", out=tmp_path / "out1", follow_s=0)
    assert first.returncode == 0 and "still running" in first.stdout
    again = _queue(env, "start", "smoke", out=tmp_path / "out2", follow_s=0)
    assert again.returncode == 2 and "a queue is running" in again.stderr
    done = _queue(env, "follow", out=tmp_path / "out3", follow_s=300)
    assert done.returncode == 0 and "queue ended: rc 0" in done.stdout, done.stdout + done.stderr
    assert (tmp_path / "out3" / "QUEUE.rc").read_text().strip() == "0"
    assert '"suite": "smoke"' in (tmp_path / "out3" / "smoke.json").read_text()
    assert "smoke" in (tmp_path / "out3" / "QUEUE.log").read_text()
