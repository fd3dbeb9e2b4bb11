"""The engine core process's failures, through CoreClient with real processes (no server): a core
killed mid-stream or hung fails every request in flight with EngineDead, health turns false while
it restarts, the next request is served; a spent restart budget leaves it dead for good; no core
process outlives its client, neither after shutdown nor after `kill -9` of the parent."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time

import pytest

from backend.serve import REPO_ROOT
from engine.core_client import CoreClient
from engine.request import EngineDead, GenerationRequest, SamplingParams

pytestmark = pytest.mark.slow

MARKER = "INJECT-FAULT-7f3a"
ARGS = {"max_model_len": 256, "dtype": "float32", "fault_injection_marker": MARKER, "core_restart_backoff_s": 0.1}
GUARD_S = 30  # a hang guard, not a latency bound (docs/PERF.md has the measured time to fail)


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)


async def _collect(engine, rid: str, prompt: str, n: int):
    try:
        outs = [o async for o in engine.add(GenerationRequest(rid, prompt=prompt, sampling=_greedy(n)))]
        return outs[-1].finish_reason
    except Exception as e:  # noqa: BLE001 - the result under test
        return e


async def _until(predicate, timeout_s: float = 120.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never held"
        await asyncio.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purpose
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


async def _in_flight(engine, n: int) -> list[asyncio.Task]:
    tasks = [asyncio.create_task(_collect(engine, f"long-{i}", f"a long request {i}", 240)) for i in range(n)]
    await _until(lambda: engine.stats().get("generation_tokens", 0) >= 2 * n)
    return tasks


async def _fails_restarts_and_serves(engine, break_it) -> None:
    old_pid = engine.core_pid
    assert await _collect(engine, "warm", "a fresh process's first step is slow", 2) == "length"
    tasks = await _in_flight(engine, 3)
    await break_it()
    results = await asyncio.wait_for(asyncio.gather(*tasks), GUARD_S)
    assert all(isinstance(r, EngineDead) for r in results), results
    assert not engine.health()
    assert isinstance(await _collect(engine, "meanwhile", "anyone?", 4), EngineDead)
    await _until(engine.health)  # restarted: weights reloaded in a new process
    assert engine.core_pid != old_pid and not _alive(old_pid)
    assert await _collect(engine, "after", "served again", 4) == "length"
    assert engine.stats()["num_core_restarts"] == 1


def test_a_killed_core_fails_in_flight_requests_restarts_and_serves():
    async def main():
        async with CoreClient(ARGS) as engine:
            async def kill():
                os.kill(engine.core_pid, signal.SIGKILL)

            await _fails_restarts_and_serves(engine, kill)

    asyncio.run(main())


def test_a_hung_core_is_killed_and_restarted():
    async def main():
        async with CoreClient({**ARGS, "step_timeout_s": 5.0}) as engine:  # above a loaded CPU's slowest step
            async def hang():
                hung = await asyncio.wait_for(_collect(engine, "hung", f"{MARKER}:hang", 4), GUARD_S)
                assert isinstance(hung, EngineDead) and "step_timeout_s" in str(hung), hung

            await _fails_restarts_and_serves(engine, hang)

    asyncio.run(main())


def test_a_fatal_error_in_the_core_restarts_it_and_a_spent_budget_leaves_it_dead():
    async def main():
        async with CoreClient({**ARGS, "core_restart_limit": 1}) as engine:
            fatal = await _collect(engine, "fatal", f"{MARKER}:fatal", 4)
            assert isinstance(fatal, EngineDead) and "InjectedFatalFault" in str(fatal), fatal
            await _until(engine.health)
            pid = engine.core_pid
            os.kill(pid, signal.SIGKILL)  # the second death: the budget (1 restart) is spent
            await _until(lambda: not engine.health() and not engine.restarting)
            await asyncio.sleep(0.5)  # no restart comes
            assert not engine.health() and not engine.restarting and engine.core_pid is None
            late = await _collect(engine, "late", "anyone?", 4)
            assert isinstance(late, EngineDead) and "core_restart_limit=1" in str(late), late

    asyncio.run(main())


# Planted in the core's interpreter (spawn imports sitecustomize from PYTHONPATH at start-up): an
# exit handler that records that the interpreter's teardown ran.
TEARDOWN_PROBE = """
import atexit, os, pathlib
atexit.register(lambda: pathlib.Path(os.environ["DSV4_TEARDOWN_PROBE"]).write_text("torn down"))
"""


def test_no_core_outlives_its_client_shutdown_and_its_exit_skips_the_interpreters_teardown(tmp_path, monkeypatch):
    """The core's stop waits on nothing after its last message: the teardown (torch, the model's
    tensors, a grammar compile still running) took seconds on a loaded machine inside the drain budget."""
    (tmp_path / "sitecustomize.py").write_text(TEARDOWN_PROBE)
    probe = tmp_path / "torn-down"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    monkeypatch.setenv("DSV4_TEARDOWN_PROBE", str(probe))

    async def main():
        engine = CoreClient(ARGS)
        await engine.start()
        pid = engine.core_pid
        assert _alive(pid)
        await engine.shutdown()
        return pid, engine.core_exit_code

    pid, code = asyncio.run(main())
    assert not _alive(pid)
    assert code == 0  # it ended itself: not killed after STOP_GRACE_S
    assert not probe.exists(), "the core ran the interpreter's teardown on its way out"


PARENT = """
import asyncio, sys
from engine.core_client import CoreClient
async def main():
    engine = CoreClient({"max_model_len": 128, "dtype": "float32"})
    await engine.start()
    print(engine.core_pid, flush=True)
    await asyncio.sleep(600)
asyncio.run(main())
"""


def test_no_core_outlives_a_parent_killed_with_sigkill():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True)
    try:
        core_pid = int(parent.stdout.readline())
        assert _alive(core_pid)
        parent.kill()  # kill -9: no finalizer, no atexit runs
        parent.wait(GUARD_S)
        deadline = time.monotonic() + GUARD_S
        while _alive(core_pid):
            assert time.monotonic() < deadline, f"the core {core_pid} outlived its parent"
            time.sleep(0.05)
    finally:
        if parent.poll() is None:
            parent.kill()
