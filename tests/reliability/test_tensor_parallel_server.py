"""A real tritonserver serving a tiny checkpoint with `tensor_parallel_size: 2` (gloo, CPU), once
for DeepSeek-V4 and once for V4.1 (its Engram tables memory-mapped, each rank its rows):
streaming equals the one-rank engine token for token (float32), cancel aborts the engine request,
bad input is INVALID_ARG while a good request completes; killing rank 1 mid-stream fails the
requests in flight UNAVAILABLE within seconds, the core restarts with new ranks and serves again,
and no rank outlives the server."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from backend.process_tree import alive
from backend.serve import TritonServer
from client.grpc import GrpcClient
from engine.llm import LLM
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint
from engine.request import SamplingParams
from loadtest.chaos import error_code
from loadtest.scrape import metric, metrics_text
from tests.reliability.test_core_process_server import _children, _core_pid, _run, await_recovery

pytestmark = pytest.mark.slow

ENGINE_ARGS = {"max_model_len": 256, "max_num_seqs": 4, "dtype": "float32", "tensor_parallel_size": 2,
               "enable_expert_parallel": True, "core_restart_backoff_s": 0.1}
PROMPT = "The quick brown fox"
KILL_TO_ERROR_S = 5.0  # the in-flight requests' errors arrive within this of the kill


def _ranks(core: int) -> list[int]:
    return [pid for pid in _children(core) if alive(pid)]


@pytest.fixture(scope="module", params=["v4", "v41"])
def family(request, tmp_path_factory) -> tuple[str, dict]:
    """(model, engine args) of one family's tiny checkpoint."""
    if request.param == "v4":
        return "tiny", ENGINE_ARGS
    path = write_v41_checkpoint(tmp_path_factory.mktemp("v41"), "v41-tiny", seed=7)
    return str(path), {**ENGINE_ARGS, "engram_tables": "mmap"}


@pytest.fixture(scope="module")
def server(family):
    model, args = family
    with TritonServer(model=model, engine_args=args, http_port=0, grpc_port=0, metrics_port=0,
                      startup_timeout_s=300) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    with GrpcClient(server.grpc_url) as c:
        yield c


def test_streams_equal_the_one_rank_engine(family, server, client):
    deltas = list(client.generate_stream(PROMPT, max_tokens=12, temperature=0.0, ignore_eos=True))
    assert len(deltas) > 1 and deltas[-1].finish_reason == "length"
    model, args = family
    args = {k: v for k, v in args.items() if k not in ("tensor_parallel_size", "enable_expert_parallel", "engram_tables")}
    want = LLM(model, **args).generate([PROMPT], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    assert "".join(d.text for d in deltas) == want.text


def test_cancel_aborts_and_bad_input_is_invalid_arg(server, client):
    before = metric(metrics_text(server.metrics_url), "deepseek:request_success_total", finished_reason="abort") or 0
    stream = client.generate_stream(PROMPT, max_tokens=200, ignore_eos=True)
    received = sum(1 for _, _ in zip(stream, range(3)))
    stream.close()  # gRPC stream cancel
    assert received == 3
    deadline = time.monotonic() + 10
    while (metric(metrics_text(server.metrics_url), "deepseek:request_success_total", finished_reason="abort")
           or 0) < before + 1:
        assert time.monotonic() < deadline, server.log_tail()
        time.sleep(0.2)
    outcome, message, _, _ = _run(server, "x", 10**9)  # max_tokens out of range
    assert outcome == "error" and error_code(message) == "INVALID_ARG", message
    assert _run(server, PROMPT, 4)[0] == "completed"


def test_a_killed_rank_fails_in_flight_requests_fast_and_the_engine_recovers(server):
    assert _run(server, "warm up", 4)[0] == "completed"
    core = _core_pid(server)
    ranks = _ranks(core)
    assert len(ranks) == 1, ranks  # rank 1 (rank 0 is the core itself)
    results, ended = {}, {}

    def call(i):
        results[i] = _run(server, f"long {i}", 200)
        ended[i] = time.monotonic()

    threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    time.sleep(1.5)  # both decoding
    killed_at = time.monotonic()
    os.kill(ranks[0], signal.SIGKILL)
    for t in threads:
        t.join(timeout=60)
    assert all(r[0] == "error" and error_code(r[1]) == "UNAVAILABLE" for r in results.values()), results
    assert max(ended.values()) - killed_at < KILL_TO_ERROR_S
    await_recovery(server)  # the core restarts with new ranks
    new_core = _core_pid(server)
    assert new_core != core and not alive(core) and not alive(ranks[0])
    new_ranks = _ranks(new_core)
    assert len(new_ranks) == 1
    server.stop()
    assert not alive(new_core) and not any(alive(p) for p in new_ranks)
