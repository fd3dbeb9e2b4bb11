"""Chaos and soak runs against a real server: loopback only, bounded in time.

    python -m loadtest.chaos                                   # every scenario, short (~2 min)
    python -m loadtest.chaos --scenarios soak --soak-s 600 --concurrency 32    # the documented soak
    python -m loadtest.chaos --http 127.0.0.1:8000 --grpc 127.0.0.1:8001 \\
        --metrics http://127.0.0.1:8002/metrics --server-pid PID  # a server that is already up

Without --http/--grpc it starts its own server (backend.serve, tiny checkpoint, free loopback
ports, CHAOS_ENGINE_ARGS + --engine-args). Scenarios, in this order:

  fuzz        hypothesis-generated bad sampling JSON and tensors: each must get INVALID_ARG,
              while a good stream completes
  cancel      a cancellation storm: gRPC streams cancelled while queued, in prefill, in decode
  disconnect  a disconnect storm: HTTP streams and requests whose sockets close mid-way
  overload    a burst beyond max_num_seqs + max_waiting_requests: UNAVAILABLE at once for the
              excess, every admitted request completes, then a new request succeeds
  soak        --concurrency clients for --soak-s seconds sending a mix of all of the above;
              server RSS and engine gauges sampled every --sample-s seconds

After each scenario the engine must come back to zero running / waiting requests and every
KV block free (the deepseek: gauges). Prints a report, writes JSON (--out), exits 1 on any
violation. Error codes come from the message (the backend starts each error message with its
Triton code; see docs/RELIABILITY.md), or from Triton's own input-check messages.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import http.client
import json
import os
import random
import re
import socket
import statistics
import string
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from loadtest.scrape import metric, metrics_text

LOOPBACK = ("127.0.0.1", "localhost", "::1", "[::1]")
MODEL = "deepseek_v4"
# The chaos server: small enough that a burst overflows it; 32 soak clients and a 50-request
# cancel storm fit (16 running + up to 64 waiting or arriving).
CHAOS_ENGINE_ARGS = {"max_model_len": 512, "max_num_seqs": 16, "max_waiting_requests": 64}
CODES = ("INVALID_ARG", "UNAVAILABLE", "INTERNAL", "CANCELLED", "NOT_FOUND", "UNSUPPORTED", "UNKNOWN")
# Triton rejects these before the model sees the request (its own INVALID_ARG checks on the
# model config and the HTTP JSON); they carry no code prefix.
TRITON_INPUT_ERRORS = ("Converting keyword", "Unable to parse", "unexpected shape", "data-type is",
                       "unexpected inference input", "The schema can not convert",
                       "failed to parse the request JSON", "expected input", "missing inputs")
WORDS = ("the quick brown fox jumps over a lazy dog while seven wise owls count stars near "
         "quiet rivers and bright cities hum with distant trains").split()


def error_code(message: str) -> str:
    """The Triton code of an error message from this server (see the module docstring)."""
    head = message.split(":", 1)[0].strip()
    if head in CODES:
        return head
    if any(p in message for p in TRITON_INPUT_ERRORS):
        return "INVALID_ARG"
    if "unknown model" in message or "no available versions" in message or "not ready" in message:
        return "UNAVAILABLE"
    return "UNKNOWN"


def check_loopback(address: str, what: str) -> None:
    host = address.removeprefix("http://").rsplit(":", 1)[0].split("/")[0]
    if host not in LOOPBACK:
        raise SystemExit(f"error: {what} {address!r} is not a loopback address; chaos runs against "
                         "127.0.0.1 / localhost / ::1 only")


# ------------------------------------------------------------------------------------- inputs
# Hypothesis strategies for requests that must be refused. Each defect is invalid by the
# documented limits (docs/USAGE.md), whatever valid keys surround it.


def _strategies():
    from hypothesis import strategies as st

    return st


def _letters(st, exclude=("true", "false", "nan", "inf", "infinity", "e")):
    # letters only: never a number, never a boolean word (those would be valid)
    return st.text(alphabet=string.ascii_letters, min_size=1, max_size=12).filter(
        lambda s: s.strip().lower() not in exclude)


def valid_sampling():
    """Sampling keys at valid values (the surroundings of a defect, and good requests)."""
    st = _strategies()
    return st.fixed_dictionaries({}, optional={
        "max_tokens": st.integers(1, 8),
        "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1),
        "top_k": st.integers(-1, 40),
        "min_p": st.floats(0, 0.5),
        "seed": st.integers(0, 2**31),
        "ignore_eos": st.booleans(),
        "stop": st.lists(_letters(st), min_size=1, max_size=3),
        "n": st.just(1),
    })


def sampling_defect(max_model_len: int = 512):
    """One invalid sampling setting, as a dict to merge (it may set two keys)."""
    st = _strategies()
    non_number = st.one_of(_letters(st), st.booleans(), st.lists(st.integers(), max_size=2),
                           st.dictionaries(_letters(st), st.integers(), max_size=2))
    non_integral = st.floats(allow_nan=False, allow_infinity=False).filter(lambda f: not f.is_integer())
    known = {"max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop",
             "stop_token_ids", "ignore_eos", "logprobs", "skip_special_tokens", "n", "best_of",
             "presence_penalty", "frequency_penalty", "repetition_penalty", "use_beam_search",
             "include_stop_str_in_output"}
    one = lambda key, values: values.map(lambda v: {key: v})
    return st.one_of(
        one("max_tokens", st.one_of(st.integers(max_value=0), st.integers(min_value=max_model_len + 1),
                                    non_integral, non_number, st.just(float("nan")))),
        one("temperature", st.one_of(st.floats(max_value=-1e-6), non_number, st.sampled_from(
            [float("inf"), float("nan"), "inf", "NaN"]))),
        one("top_p", st.one_of(st.floats(max_value=0), st.floats(min_value=1.000001), non_number)),
        one("top_k", st.one_of(st.integers(max_value=-2), non_integral, non_number)),
        one("min_p", st.one_of(st.floats(max_value=-1e-6), st.floats(min_value=1.000001))),
        one("logprobs", st.one_of(st.integers(min_value=21), st.integers(max_value=-1))),
        one("seed", st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63))),
        st.integers(1, 8).flatmap(lambda m: st.integers(m + 1, 10 * m + 10).map(
            lambda k: {"max_tokens": m, "min_tokens": k})),
        one("stop", st.one_of(st.just(""), st.lists(st.integers(), min_size=1, max_size=3),
                              st.lists(_letters(st), min_size=17, max_size=20),
                              st.text(alphabet="xyz", min_size=257, max_size=300).map(lambda s: [s]))),
        one("stop_token_ids", st.one_of(st.lists(st.integers(max_value=-1), min_size=1, max_size=3),
                                        st.lists(st.integers(min_value=2**40), min_size=1, max_size=3),
                                        _letters(st))),
        one("ignore_eos", st.one_of(_letters(st), st.integers(min_value=2))),
        st.tuples(st.text(min_size=1, max_size=16).filter(lambda k: k not in known),
                  st.one_of(st.integers(), _letters(st), st.booleans())).map(lambda kv: {kv[0]: kv[1]}),
        one("n", st.integers(min_value=2, max_value=64)),
        one("best_of", st.integers(min_value=2, max_value=8)),
        one("presence_penalty", st.floats(min_value=0.01, max_value=2)),
        one("use_beam_search", st.just(True)),
    )


def bad_sampling(max_model_len: int = 512):
    """A sampling_parameters object with valid keys around one defect."""
    st = _strategies()
    return st.tuples(valid_sampling(), sampling_defect(max_model_len)).map(lambda p: {**p[0], **p[1]})


@dataclass
class BadRequest:
    """A request the server must refuse: gRPC tensors (name -> (numpy array, datatype))."""

    tensors: dict
    why: str


def bad_request(max_model_len: int = 512):
    """Any refused request: bad sampling JSON, bad text, bad flags, or tensors Triton rejects."""
    st = _strategies()

    def text(prompt: bytes) -> dict:
        return {"text_input": (np.array([prompt], dtype=np.object_), "BYTES")}

    def sampling(raw: bytes) -> dict:
        return {"sampling_parameters": (np.array([raw], dtype=np.object_), "BYTES")}

    def not_a_json_object(s: str) -> bool:
        if not s.strip():
            return False  # empty: no sampling parameters, which is valid
        try:
            return not isinstance(json.loads(s), dict)
        except (ValueError, RecursionError):
            return True

    def invalid_utf8(b: bytes) -> bool:
        try:
            b.decode("utf-8")
            return False
        except UnicodeDecodeError:
            return True

    prompt = st.text(alphabet=string.ascii_letters + " ", min_size=1, max_size=40).map(str.encode)
    return st.one_of(
        st.tuples(prompt, bad_sampling(max_model_len)).map(lambda p: BadRequest(
            {**text(p[0]), **sampling(json.dumps(p[1]).encode())}, f"sampling {p[1]!r}")),
        st.tuples(prompt, st.text(max_size=40).filter(not_a_json_object)).map(lambda p: BadRequest(
            {**text(p[0]), **sampling(p[1].encode())}, f"sampling_parameters text {p[1]!r}")),
        st.binary(min_size=1, max_size=40).filter(invalid_utf8).map(lambda b: BadRequest(
            text(b), "text_input not UTF-8")),
        st.just(BadRequest(text(b""), "empty text_input")),
        st.integers(max_model_len + 8, 2 * max_model_len).map(lambda n: BadRequest(
            text(b"token " * n), f"prompt of {n} words > max_model_len")),
        st.just(BadRequest({**text(b"hi"), "stream": (np.array([True]), "BOOL"),
                            "exclude_input_in_output": (np.array([False]), "BOOL")},
                           "stream with exclude_input_in_output=false")),
        # Triton's own checks against config.pbtxt: datatype, shape, unknown input
        st.sampled_from(["FP32", "INT64", "BOOL"]).map(lambda dt: BadRequest(
            {"text_input": (np.array([1], dtype={"FP32": np.float32, "INT64": np.int64, "BOOL": bool}[dt]), dt)},
            f"text_input as {dt}")),
        st.integers(2, 4).map(lambda n: BadRequest(
            {"text_input": (np.array([b"a"] * n, dtype=np.object_), "BYTES")}, f"text_input shape [{n}]")),
        st.just(BadRequest({**text(b"hi"), "bogus_input": (np.array([1], dtype=np.int32), "INT32")},
                           "unknown input")),
    )


def draw(strategy, n: int, seed: int = 0) -> list:
    """n examples of a strategy, reproducibly (for load generation, outside a test)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed

    out = []

    @hseed(seed)
    @settings(max_examples=n, database=None, deadline=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(strategy)
    def collect(x):
        out.append(x)

    collect()
    return out[:n]


def random_prompt(rng: random.Random, max_words: int = 120) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, max_words)))


# ------------------------------------------------------------------------------------- server


@dataclass
class Target:
    http: str
    grpc: str
    metrics: str | None
    pid: int | None


def engine_gauges(metrics_url: str) -> dict:
    text = metrics_text(metrics_url)
    out = {"running": metric(text, "deepseek:num_requests_running"),
           "waiting": metric(text, "deepseek:num_requests_waiting")}
    for pool in ("window", "compressed"):
        out[f"free_{pool}"] = metric(text, "deepseek:kv_cache_free_blocks", pool=pool)
        out[f"total_{pool}"] = metric(text, "deepseek:kv_cache_blocks", pool=pool)
    return out


def server_counts(metrics_url: str | None) -> dict:
    """Cumulative per-request counters: finished by reason, refused / failed by code."""
    if metrics_url is None:
        return {}
    text = metrics_text(metrics_url)
    out = {}
    for line in text.splitlines():
        m = re.match(r'^deepseek:request_(success|failure)_total\{(.*)\} (\S+)$', line)
        if m:
            labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2)))
            key = labels.get("finished_reason") or labels.get("code")
            out[f"{m.group(1)}:{key}"] = out.get(f"{m.group(1)}:{key}", 0) + float(m.group(3))
    out["step_failures"] = metric(text, "deepseek:engine_step_failures_total") or 0.0
    return out


def counts_delta(before: dict, after: dict) -> dict:
    return {k: int(after[k] - before.get(k, 0)) for k in sorted(after) if after[k] - before.get(k, 0)}


def is_idle(g: dict) -> bool:
    """Zero running and waiting requests, and every block of every pool free."""
    pools_full = all(g.get(f"free_{p}") is not None and g[f"free_{p}"] == g[f"total_{p}"]
                     for p in ("window", "compressed"))
    return g.get("running") == 0 and g.get("waiting") == 0 and pools_full


def wait_idle(metrics_url: str, timeout_s: float = 30.0) -> dict:
    """Poll the gauges (updated every 0.5 s) until the engine is idle, or give up."""
    deadline = time.monotonic() + timeout_s
    g = {}
    while time.monotonic() < deadline:
        g = engine_gauges(metrics_url)
        if is_idle(g):
            time.sleep(0.6)  # one more poll period: idle twice in a row
            g = engine_gauges(metrics_url)
            if is_idle(g):
                return g
        time.sleep(0.25)
    return g


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of a process and its descendants (tritonserver + the python backend stub)."""
    if pid is None:
        return None
    children: dict[int, list[int]] = collections.defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
                children[int(fields[1])].append(int(entry))
            except (OSError, IndexError, ValueError):
                continue
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
        todo.extend(children.get(p, []))
    return total


# ------------------------------------------------------------------------------------- clients


@dataclass
class Tally:
    """Outcomes of one scenario; thread-safe."""

    sent: int = 0
    completed: int = 0
    cancelled: int = 0  # by us (stream cancelled)
    disconnected: int = 0  # by us (socket closed)
    rejected: collections.Counter = field(default_factory=collections.Counter)  # expected errors by code
    errors: collections.Counter = field(default_factory=collections.Counter)  # unexpected, by code
    error_samples: list = field(default_factory=list)
    latencies: dict = field(default_factory=lambda: collections.defaultdict(list))
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, code: str | None = None, expected: bool = True, latency_s: float | None = None,
            message: str = "") -> None:
        with self.lock:
            self.sent += 1
            if outcome == "completed":
                self.completed += 1
            elif outcome == "cancelled":
                self.cancelled += 1
            elif outcome == "disconnected":
                self.disconnected += 1
            elif expected:
                self.rejected[code] += 1
            else:
                self.errors[code] += 1
                if len(self.error_samples) < 10:
                    self.error_samples.append(f"{code}: {message[:300]}")
            if latency_s is not None:
                self.latencies[code or outcome].append(latency_s)

    def summary(self) -> dict:
        lat = {k: {"n": len(v), "p50_s": round(statistics.median(v), 4), "max_s": round(max(v), 4)}
               for k, v in self.latencies.items() if v}
        return {"sent": self.sent, "completed": self.completed, "cancelled": self.cancelled,
                "disconnected": self.disconnected, "rejected": dict(self.rejected),
                "errors": dict(self.errors), "error_samples": list(self.error_samples), "latency": lat}


def grpc_tensors(tensors: dict):
    import tritonclient.grpc as grpcclient

    inputs = []
    for name, (array, datatype) in tensors.items():
        t = grpcclient.InferInput(name, list(array.shape), datatype)
        t.set_data_from_numpy(array)
        inputs.append(t)
    return inputs


def good_tensors(prompt: str, sampling: dict, stream: bool = True) -> dict:
    return {"text_input": (np.array([prompt.encode()], dtype=np.object_), "BYTES"),
            "stream": (np.array([stream]), "BOOL"),
            "sampling_parameters": (np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
            "return_finish_reason": (np.array([True]), "BOOL"),
            "return_num_output_tokens": (np.array([True]), "BOOL")}


class GrpcCall:
    """One request over tritonclient's stream, with the control chaos needs: cancel after a delay
    or after k responses, or drop the whole connection."""

    def __init__(self, url: str):
        import tritonclient.grpc as grpcclient

        self.client = grpcclient.InferenceServerClient(url)

    def close(self) -> None:
        try:
            self.client.close()
        except Exception:
            pass

    def run(self, tensors: dict, timeout_s: float = 120.0, cancel_after_s: float | None = None,
            cancel_after_responses: int | None = None, barrier: threading.Barrier | None = None,
            request_id: str = "") -> tuple[str, str | None, list, float]:
        """-> (outcome, error message, responses, seconds from the send). outcome: completed |
        error | cancelled. `barrier`: wait there with the stream open, then send."""
        import queue

        responses: queue.Queue = queue.Queue()
        got = []
        self.client.start_stream(callback=lambda result, error: responses.put((result, error)))
        inputs = grpc_tensors(tensors)
        finished = False
        try:
            if barrier is not None:
                barrier.wait(timeout=120)
            start = time.monotonic()
            self.client.async_stream_infer(MODEL, inputs, request_id=request_id, enable_empty_final_response=True)
            deadline = start + timeout_s
            cancel_at = None if cancel_after_s is None else start + cancel_after_s
            while True:
                now = time.monotonic()
                if cancel_at is not None and now >= cancel_at:
                    return "cancelled", None, got, now - start
                if cancel_after_responses is not None and len(got) >= cancel_after_responses:
                    return "cancelled", None, got, now - start
                if now >= deadline:
                    return "error", f"TIMEOUT: no final response after {timeout_s} s", got, now - start
                wait = min(deadline, cancel_at or deadline) - now
                try:
                    result, error = responses.get(timeout=max(0.001, wait))
                except queue.Empty:
                    continue
                if error is not None:
                    finished = True
                    return "error", error.message(), got, time.monotonic() - start
                got.append(result)
                if result.get_response().parameters["triton_final_response"].bool_param:
                    finished = True
                    return "completed", None, got, time.monotonic() - start
        finally:
            self.client.stop_stream(cancel_requests=not finished)


def http_disconnect(http_url: str, prompt: str, max_tokens: int, stream: bool, read_bytes: int,
                    rng: random.Random) -> None:
    """Send a generate request and close the socket without reading the whole answer (an RST
    half the time, a FIN otherwise)."""
    host, port = http_url.rsplit(":", 1)
    body = json.dumps({"text_input": prompt, "stream": stream,
                       "parameters": {"max_tokens": max_tokens, "ignore_eos": True}})
    path = f"/v2/models/{MODEL}/generate_stream" if stream else f"/v2/models/{MODEL}/generate"
    conn = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        if read_bytes and stream:
            response = conn.getresponse()
            response.read1(read_bytes)
        if rng.random() < 0.5:
            conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
        conn.sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    finally:
        conn.close()


# ------------------------------------------------------------------------------------- scenarios


@dataclass
class Report:
    scenarios: dict = field(default_factory=dict)
    violations: list = field(default_factory=list)

    def check(self, ok: bool, message: str) -> None:
        if not ok:
            self.violations.append(message)
            print(f"  VIOLATION: {message}", flush=True)


def _idle_check(report: Report, target: Target, scenario: str, timeout_s: float = 30.0) -> dict | None:
    if target.metrics is None:
        return None
    g = wait_idle(target.metrics, timeout_s)
    report.check(is_idle(g), f"{scenario}: the engine did not return to idle with a full block pool: {g}")
    return g


def _long_stream(target: Target, max_tokens: int, out: dict) -> None:
    call = GrpcCall(target.grpc)
    try:
        outcome, message, responses, seconds = call.run(
            good_tensors("A good stream runs through the chaos", {"max_tokens": max_tokens, "ignore_eos": True,
                                                                  "temperature": 0}))
        tokens = sum(int(r.as_numpy("num_output_tokens")[0]) for r in responses
                     if r.as_numpy("num_output_tokens") is not None)
        out.update(outcome=outcome, message=message, tokens=tokens, seconds=round(seconds, 2))
    finally:
        call.close()


def scenario_fuzz(target: Target, report: Report, args) -> dict:
    """Every fuzzed bad request gets INVALID_ARG; a good stream completes meanwhile."""
    examples = draw(bad_request(args.max_model_len), args.fuzz_examples, seed=args.seed)
    tally = Tally()
    good: dict = {}
    stream = threading.Thread(target=_long_stream, args=(target, 96, good))
    stream.start()
    by_why = collections.Counter()

    def send(example: BadRequest):
        call = GrpcCall(target.grpc)
        try:
            outcome, message, _, seconds = call.run(example.tensors, timeout_s=60)
        finally:
            call.close()
        code = error_code(message) if message else None
        ok = outcome == "error" and code == "INVALID_ARG"
        tally.add(outcome, code or outcome, expected=ok, latency_s=seconds,
                  message=f"{example.why} -> {outcome} {message}")
        by_why[example.why.split(" ")[0]] += 1

    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        list(pool.map(send, examples))
    stream.join(timeout=180)
    summary = tally.summary()
    summary["good_stream"] = good
    report.check(not tally.errors, f"fuzz: requests not answered INVALID_ARG: {summary['error_samples']}")
    report.check(good.get("outcome") == "completed" and good.get("tokens") == 96,
                 f"fuzz: the concurrent good stream did not complete: {good}")
    summary["idle_after"] = _idle_check(report, target, "fuzz")
    return summary


def scenario_cancel(target: Target, report: Report, args) -> dict:
    """Start --storm streams at once (more than max_num_seqs: some queue), cancel each at a random
    moment: before its first token (queued or in prefill) or after a few (decode)."""
    rng = random.Random(args.seed)
    tally = Tally()
    stages = collections.Counter()

    def one(i: int):
        call = GrpcCall(target.grpc)
        try:
            long_prompt = rng.random() < 0.3
            prompt = random_prompt(rng, 200 if long_prompt else 20)
            if i % 2:
                outcome, message, got, s = call.run(good_tensors(prompt, {"max_tokens": 400, "ignore_eos": True}),
                                                    cancel_after_s=rng.uniform(0.0, 1.5))
            else:
                outcome, message, got, s = call.run(good_tensors(prompt, {"max_tokens": 400, "ignore_eos": True}),
                                                    cancel_after_responses=rng.randint(1, 6))
        finally:
            call.close()
        stages["before first token" if not got else "decoding"] += outcome == "cancelled"
        code = error_code(message) if message else None
        tally.add(outcome, code or outcome, expected=outcome in ("cancelled", "completed") or code == "UNAVAILABLE",
                  latency_s=s, message=message or "")

    with concurrent.futures.ThreadPoolExecutor(args.storm) as pool:
        list(pool.map(one, range(args.storm)))
    summary = tally.summary()
    summary["cancelled_at"] = dict(stages)
    report.check(not tally.errors, f"cancel: unexpected errors: {summary['error_samples']}")
    summary["idle_after"] = _idle_check(report, target, "cancel")
    return summary


def scenario_disconnect(target: Target, report: Report, args) -> dict:
    """--storm HTTP requests whose sockets close early, streaming or not, some before any byte."""
    rng = random.Random(args.seed + 1)
    tally = Tally()

    def one(i: int):
        start = time.monotonic()
        http_disconnect(target.http, random_prompt(rng, 60), 300, stream=i % 3 != 0,
                        read_bytes=rng.choice([0, 1, 64]), rng=rng)
        tally.add("disconnected", latency_s=time.monotonic() - start)

    with concurrent.futures.ThreadPoolExecutor(args.storm) as pool:
        list(pool.map(one, range(args.storm)))
    summary = tally.summary()
    summary["idle_after"] = _idle_check(report, target, "disconnect", timeout_s=60)
    return summary


def scenario_overload(target: Target, report: Report, args) -> dict:
    """A burst of --burst requests at once: the excess gets UNAVAILABLE without waiting for a slot,
    every admitted request completes, and once the burst is over a new request succeeds."""
    tally = Tally()
    barrier = threading.Barrier(args.burst)

    def one(i: int):
        call = GrpcCall(target.grpc)
        try:
            outcome, message, _, s = call.run(good_tensors(f"burst {i} " + "go " * (i % 20),
                                                           {"max_tokens": 24, "ignore_eos": True}, stream=False),
                                              barrier=barrier)
        finally:
            call.close()
        code = error_code(message) if message else None
        tally.add(outcome, code or outcome, expected=outcome == "completed" or code == "UNAVAILABLE",
                  latency_s=s, message=message or "")

    with concurrent.futures.ThreadPoolExecutor(args.burst) as pool:
        list(pool.map(one, range(args.burst)))
    summary = tally.summary()
    rejected = tally.latencies.get("UNAVAILABLE", [])
    completed = tally.latencies.get("completed", [])
    report.check(not tally.errors, f"overload: unexpected errors: {summary['error_samples']}")
    report.check(bool(rejected), "overload: the burst got no UNAVAILABLE (raise --burst)")
    if rejected and completed:
        report.check(max(rejected) < statistics.median(completed),
                     f"overload: refusals were not fast (slowest {max(rejected):.2f} s, admitted p50 "
                     f"{statistics.median(completed):.2f} s)")
    summary["idle_after"] = _idle_check(report, target, "overload")
    call = GrpcCall(target.grpc)
    try:
        outcome, message, _, _ = call.run(good_tensors("after the burst", {"max_tokens": 4}, stream=False))
    finally:
        call.close()
    summary["after_burst"] = outcome if message is None else f"{outcome}: {message}"
    report.check(outcome == "completed", f"overload: a request after the burst failed: {message}")
    return summary


def scenario_soak(target: Target, report: Report, args) -> dict:
    """--concurrency clients for --soak-s seconds; each loops over a weighted mix of requests."""
    tally = Tally()
    bad = draw(bad_request(args.max_model_len), 200, seed=args.seed + 2)
    stop_at = time.monotonic() + args.soak_s
    samples = []
    sample_stop = threading.Event()
    t0 = time.monotonic()

    def sampler():
        while True:
            point = {"t_s": round(time.monotonic() - t0, 1), "rss_mb": None, "completed": tally.completed,
                     "sent": tally.sent}
            rss = rss_bytes(target.pid)
            if rss is not None:
                point["rss_mb"] = round(rss / 2**20, 1)
            if target.metrics:
                try:
                    point.update(engine_gauges(target.metrics))
                except OSError:
                    pass
            samples.append(point)
            print(f"  soak t={point['t_s']:>6.1f}s sent={point['sent']} completed={point['completed']} "
                  f"rss={point['rss_mb']} MB running={point.get('running')} waiting={point.get('waiting')}",
                  flush=True)
            if sample_stop.wait(args.sample_s):
                return

    def worker(w: int):
        rng = random.Random(args.seed * 1000 + w)
        call = GrpcCall(target.grpc)
        try:
            while time.monotonic() < stop_at:
                kind = rng.choices(["stream", "unary", "http", "cancel", "disconnect", "bad"],
                                   weights=[50, 15, 12, 10, 5, 8])[0]
                prompt = random_prompt(rng, rng.choice([8, 40, 160]))
                sampling = {"max_tokens": rng.randint(1, 64), "temperature": rng.choice([0, 0.7, 1.0]),
                            "top_p": rng.choice([1.0, 0.9]), "seed": rng.randint(0, 1000)}
                start = time.monotonic()
                if kind in ("stream", "unary"):
                    outcome, message, _, s = call.run(good_tensors(prompt, sampling, stream=kind == "stream"))
                    code = error_code(message) if message else None
                    # UNAVAILABLE is a correct answer when the queue is full
                    tally.add(outcome, code or outcome, expected=outcome == "completed" or code == "UNAVAILABLE",
                              latency_s=s, message=message or "")
                    if code == "UNAVAILABLE":
                        time.sleep(rng.uniform(0.1, 0.5))  # a client backs off when told to
                elif kind == "http":
                    from client.http import HttpClient
                    from client.types import ServerError

                    try:
                        HttpClient(target.http, timeout_s=120).generate(prompt, **sampling)
                        tally.add("completed", latency_s=time.monotonic() - start)
                    except ServerError as e:
                        code = error_code(e.message)
                        tally.add("error", code, expected=code == "UNAVAILABLE", message=e.message,
                                  latency_s=time.monotonic() - start)
                    except OSError as e:
                        tally.add("error", "CONNECTION", expected=False, message=repr(e))
                elif kind == "cancel":
                    outcome, message, _, s = call.run(good_tensors(prompt, {**sampling, "max_tokens": 200}),
                                                      cancel_after_s=rng.uniform(0, 1.0))
                    code = error_code(message) if message else None
                    tally.add(outcome, code or outcome,
                              expected=outcome in ("cancelled", "completed") or code == "UNAVAILABLE",
                              message=message or "")
                elif kind == "disconnect":
                    http_disconnect(target.http, prompt, 200, stream=rng.random() < 0.7,
                                    read_bytes=rng.choice([0, 1, 64]), rng=rng)
                    tally.add("disconnected")
                else:
                    example = rng.choice(bad)
                    outcome, message, _, s = call.run(example.tensors, timeout_s=60)
                    code = error_code(message) if message else outcome
                    # under overload a request may be refused before its content is checked
                    tally.add(outcome, code, expected=code in ("INVALID_ARG", "UNAVAILABLE"), latency_s=s,
                              message=f"{example.why} -> {message}")
        finally:
            call.close()

    sample_thread = threading.Thread(target=sampler, daemon=True)
    sample_thread.start()
    with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
        list(pool.map(worker, range(args.concurrency)))
    summary = tally.summary()
    summary["idle_after"] = _idle_check(report, target, "soak", timeout_s=60)
    sample_stop.set()
    sample_thread.join()
    summary["samples"] = samples
    rss = [p["rss_mb"] for p in samples if p["rss_mb"] is not None]
    if rss:
        summary["rss_mb"] = {"start": rss[0], "end": rss[-1], "max": max(rss)}
    summary["duration_s"] = round(time.monotonic() - t0, 1)
    summary["concurrency"] = args.concurrency
    report.check(not tally.errors, f"soak: unexpected errors {dict(tally.errors)}: {summary['error_samples']}")
    report.check(tally.completed > 0, "soak: nothing completed")
    return summary


SCENARIOS = {"fuzz": scenario_fuzz, "cancel": scenario_cancel, "disconnect": scenario_disconnect,
             "overload": scenario_overload, "soak": scenario_soak}


# ------------------------------------------------------------------------------------- main


def print_report(report: Report) -> None:
    rows = []
    for name, s in report.scenarios.items():
        rejected = ", ".join(f"{k} {v}" for k, v in sorted(s.get("rejected", {}).items())) or "-"
        errors = ", ".join(f"{k} {v}" for k, v in sorted(s.get("errors", {}).items())) or "0"
        rows.append((name, s.get("sent", 0), s.get("completed", 0), s.get("cancelled", 0) + s.get("disconnected", 0),
                     rejected, errors))
    header = ("scenario", "sent", "completed", "cancel/disc", "rejected (code n)", "unexpected")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    print()
    for r in [header, *rows]:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))
    soak = report.scenarios.get("soak")
    if soak and soak.get("rss_mb"):
        print(f"\nsoak: {soak['duration_s']} s at concurrency {soak['concurrency']}; server RSS start "
              f"{soak['rss_mb']['start']} MB, end {soak['rss_mb']['end']} MB, max {soak['rss_mb']['max']} MB")
    print(f"\n{len(report.violations)} violation(s)")
    for v in report.violations:
        print(f"  - {v}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtest.chaos", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated, in order")
    parser.add_argument("--http", help="HTTP host:port of a running server (loopback); default: start one")
    parser.add_argument("--grpc", help="gRPC host:port of a running server (loopback)")
    parser.add_argument("--metrics", help="metrics URL of a running server (leak checks need it)")
    parser.add_argument("--server-pid", type=int, help="tritonserver's pid (RSS is summed over its tree)")
    parser.add_argument("--engine-args", default="{}", help="JSON merged into CHAOS_ENGINE_ARGS (own server)")
    parser.add_argument("--max-model-len", type=int, help="the server's max_model_len (default: from engine args)")
    parser.add_argument("--fuzz-examples", type=int, default=150)
    parser.add_argument("--storm", type=int, default=50, help="requests in the cancel / disconnect storms")
    parser.add_argument("--burst", type=int, help="overload burst size (default 3 x (max_num_seqs + "
                        "max_waiting_requests) of the own server, else 200)")
    parser.add_argument("--soak-s", type=float, default=60.0, help="soak duration (documented run: 600)")
    parser.add_argument("--concurrency", type=int, default=32, help="soak clients")
    parser.add_argument("--sample-s", type=float, default=10.0, help="soak: RSS / gauge sampling period")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="chaos-report.json", help="JSON report")
    args = parser.parse_args(argv)

    scenarios = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    unknown = [s for s in scenarios if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}; known: {', '.join(SCENARIOS)}")
    engine_args = {**CHAOS_ENGINE_ARGS, **json.loads(args.engine_args)}
    args.max_model_len = args.max_model_len or engine_args["max_model_len"]
    if args.burst is None:
        args.burst = 200 if args.http else 3 * (engine_args.get("max_num_seqs", 64)
                                                 + engine_args.get("max_waiting_requests", 1024))

    server = None
    if args.http or args.grpc:
        if not (args.http and args.grpc):
            parser.error("--http and --grpc go together")
        for what, address in (("--http", args.http), ("--grpc", args.grpc), ("--metrics", args.metrics)):
            if address:
                check_loopback(address, what)
        target = Target(args.http, args.grpc, args.metrics, args.server_pid)
    else:
        from backend.serve import TritonServer

        print(f"starting a server: {json.dumps(engine_args)}", flush=True)
        server = TritonServer(engine_args=engine_args, http_port=0, grpc_port=0, metrics_port=0,
                              startup_timeout_s=600).start()
        target = Target(server.http_url, server.grpc_url, server.metrics_url, server.process.pid)

    report = Report()
    started = time.monotonic()
    try:
        for name in scenarios:
            print(f"== {name}", flush=True)
            t = time.monotonic()
            before = server_counts(target.metrics)
            report.scenarios[name] = SCENARIOS[name](target, report, args)
            report.scenarios[name]["seconds"] = round(time.monotonic() - t, 1)
            report.scenarios[name]["server_counts"] = counts_delta(before, server_counts(target.metrics))
    finally:
        if server is not None:
            server.stop()
    print_report(report)
    out = {"engine_args": engine_args if server is not None else None, "seconds": round(time.monotonic() - started, 1),
           "scenarios": report.scenarios, "violations": report.violations}
    Path(args.out).write_text(json.dumps(out, indent=2, default=str) + "\n")
    print(f"report: {args.out}")
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main())
