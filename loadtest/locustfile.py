"""Locust users that stream from the server: gRPC (tritonclient's bidirectional stream) and HTTP
(server-sent events from `generate_stream`). `python -m loadtest.sweep` runs this file headless
once per concurrency level; it also runs on its own with Locust's web UI:

    locust -f loadtest/locustfile.py --web-host 127.0.0.1 --loadtest-config cfg.json GrpcStreamUser

Per request the users fire one Locust event per metric, so Locust's tables, CSV and charts show
them: `TTFT` (to the first delta that carries tokens), `ITL` (one per gap between such deltas),
`E2E` (response_length = output tokens, from the server's `num_output_tokens`; failures land
here). A JSON line per request (timings, token counts, what the server reported) goes to the
config's `records` file, which the sweep reads.

gevent: Locust monkey-patches the process, and tritonclient streams through a gRPC thread.
`grpc.experimental.gevent.init_gevent()` (before any gRPC object exists) makes gRPC's waits
cooperative; without it a streaming user hangs the process. With it, Locust could still hang
after its summary (about one run in three at 64 users): gRPC's gevent integration hands each
completion to the hub through a threadpool thread waiting on a C++ condition variable; at exit
gRPC's atexit hook wakes it, it re-takes that mutex and asks for the GIL, and Python 3.11 ends a
thread that asks for the GIL during finalization, mutex held. A tritonclient client collected by
the interpreter's last garbage collection then closes its channel from `__del__` and blocks on
the mutex forever (gdb: Py_FinalizeEx -> gc -> InferenceServerClient.__del__ -> Channel.close ->
pthread_mutex_lock). So users close their clients in `on_stop`, `test_stop` collects them while
the hub still runs, and an atexit hook (registered after gRPC's, so it runs first) ends the
process with Locust's exit code once Locust has written everything. docs/LOADTEST.md has more.
"""

from __future__ import annotations

import atexit
import gc
import itertools
import json
import logging
import os
import sys
import threading
from pathlib import Path

import gevent
import grpc.experimental.gevent as grpc_gevent
from locust import User, constant, events, task
from locust.stats import CSV_STATS_INTERVAL_SEC

grpc_gevent.init_gevent()  # after Locust's monkey-patching, before any gRPC object (tritonclient)

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `locust -f loadtest/locustfile.py` puts only loadtest/ on the path
    sys.path.insert(0, str(REPO_ROOT))

from geventhttpclient import HTTPClient  # noqa: E402

from client.grpc import GrpcClient  # noqa: E402
from client.http import request_body  # noqa: E402
from client.types import DEFAULT_RETURNS, ServerError, delta_from_outputs, sampling_json  # noqa: E402
from loadtest.measure import ERROR_BACKOFF_S, Measure, RecordWriter  # noqa: E402
from loadtest.openai_stream import DONE, ChunkReader, completion_body  # noqa: E402
from loadtest.workloads import LoadConfig, Request, WorkloadConfig, make_workload  # noqa: E402


class _State:
    config = LoadConfig()
    workload = None
    records = RecordWriter(None)
    user_ids = itertools.count()
    exit_code: int | None = None
    csv = False


STATE = _State()


@events.init_command_line_parser.add_listener
def _add_arguments(parser, **_):
    parser.add_argument("--loadtest-config", default=os.environ.get("LOADTEST_CONFIG", ""),
                        help="JSON written by loadtest.sweep (workload, url, sampling, records file)")


@events.init.add_listener
def _init(environment, **_):
    options = environment.parsed_options
    STATE.config = LoadConfig.load(getattr(options, "loadtest_config", "") if options else "")
    STATE.workload = make_workload(WorkloadConfig.from_dict(STATE.config.workload))
    STATE.csv = bool(getattr(options, "csv_prefix", None))
    records = STATE.config.records
    if records and getattr(options, "worker", False):  # `--processes N`: one file per worker process
        records = f"{records}.{os.getpid()}"
    STATE.records = RecordWriter(records or None)
    # the loading above blocked the hub: refresh its cached clock, or --run-time ends that much early
    gevent.get_hub().loop.update_now()


@events.test_start.add_listener
def _test_start(**_):
    STATE.records.mark("start")


@events.test_stopping.add_listener
def _test_stopping(**_):
    STATE.records.mark("stopping")  # the run time is over; in-flight requests may finish


@events.test_stop.add_listener
def _test_stop(**_):
    STATE.records.mark("stop")
    gc.collect()  # closed tritonclient clients are finalised now, while the gevent hub runs


@events.quit.add_listener
def _quit(exit_code, **_):
    STATE.exit_code = exit_code
    STATE.records.close()
    if STATE.csv:
        # Locust rewrites its CSV once a second and closes it right after this event: let it write
        # once more, or the requests that finished while users were stopping are missing from it
        gevent.sleep(CSV_STATS_INTERVAL_SEC + 0.2)


@atexit.register
def _exit_now():
    """After Locust's sys.exit has run its course: skip the interpreter's final garbage collection
    (see the module docstring). Only once Locust reached its `quit` event, i.e. everything is
    written; any other exit path is left alone."""
    if STATE.exit_code is None or threading.current_thread() is not threading.main_thread():
        return
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(STATE.exit_code)


class _StreamUser(User):
    """One closed-loop user: a request, its whole stream, the next request (no think time)."""

    abstract = True
    wait_time = constant(0)
    protocol = ""

    def on_start(self):
        # distinct users (and prompts) across `--processes` workers; reproducible per worker index
        self.index = getattr(self.environment.runner, "worker_index", 0) * 100_000 + next(STATE.user_ids)
        self.session = STATE.workload.session(self.index, STATE.config.level_seed)
        self.url = self.host or STATE.config.url

    def stream(self, request: Request):
        """Yield client.types.Delta as they arrive; leaving early must cancel the request."""
        raise NotImplementedError

    @task
    def generate(self):
        request = self.session.next_request()
        m = Measure()
        error = None
        try:
            for delta in self.stream(request):
                m.add(delta)
        except gevent.GreenletExit:  # stopped mid-request by Locust: recorded, no events
            STATE.records.write("request", user=self.index, **m.record(request, None, cancelled=True))
            raise
        except Exception as e:  # noqa: BLE001 - a failed request is data; the user carries on
            error = e
        rec = m.record(request, error, cancelled=False)
        STATE.records.write("request", user=self.index, **rec)
        self._fire(rec, m)
        if rec["ok"]:
            self.session.on_reply(request, "".join(m.text))
        else:
            gevent.sleep(ERROR_BACKOFF_S)

    def _fire(self, rec: dict, m: Measure) -> None:
        """One Locust event per metric: TTFT and each ITL gap for a success, E2E for every request."""
        fire = events.request.fire
        if rec["ok"]:
            fire(request_type=self.protocol, name="TTFT", response_time=rec["ttft_ms"], response_length=0,
                 exception=None, context={})
            for gap in m.itl_ms:
                fire(request_type=self.protocol, name="ITL", response_time=gap, response_length=0,
                     exception=None, context={})
        tokens = rec["server_num_output_tokens"]
        fire(request_type=self.protocol, name="E2E", response_time=rec["e2e_ms"],
             response_length=tokens if tokens is not None else rec["output_tokens"],
             exception=None if rec["ok"] else RuntimeError(rec["error"]), context={})


class GrpcStreamUser(_StreamUser):
    """tritonclient.grpc, one client (one channel) per user, one stream per request."""

    protocol = "grpc"

    def on_start(self):
        super().on_start()
        self.client = GrpcClient(self.url, model=STATE.config.model)

    def on_stop(self):
        client, self.client = getattr(self, "client", None), None
        if client is not None:
            client.close()  # while the hub runs; `test_stop` collects it (see the module docstring)

    def stream(self, request: Request):
        return self.client.generate_stream(request.prompt, timeout_s=STATE.config.request_timeout_s,
                                           **STATE.config.sampling(request))


class HttpSseUser(_StreamUser):
    """`generate_stream` (server-sent events) over geventhttpclient, one keep-alive connection per
    user; a request left early closes its connection, which makes Triton cancel it."""

    protocol = "http"

    def on_start(self):
        super().on_start()
        host, _, port = self.url.removeprefix("http://").partition(":")
        self.address = (host, int(port or 8000))
        self.http: HTTPClient | None = None

    def on_stop(self):
        if getattr(self, "http", None) is not None:
            self.http.close()
            self.http = None

    def stream(self, request: Request):
        if self.http is None:
            self.http = HTTPClient(*self.address, connection_timeout=30,
                                   network_timeout=STATE.config.request_timeout_s, concurrency=1)
        sampling = sampling_json(**STATE.config.sampling(request))
        body = request_body(request.prompt, True, sampling, True, DEFAULT_RETURNS)
        done = False
        try:
            response = self.http.post(f"/v2/models/{STATE.config.model}/generate_stream", body=json.dumps(body),
                                      headers={"Content-Type": "application/json"})
            if response.status_code != 200:
                raise ServerError(f"HTTP {response.status_code}", response.read().decode("utf-8", "replace"))
            while True:
                line = response.readline(b"\n")
                if not line:
                    done = True
                    return
                line = line.strip()
                if not line.startswith(b"data:"):
                    continue
                payload = json.loads(line[5:])
                if "error" in payload:
                    done = True  # the server ended the request
                    raise ServerError("UNKNOWN", str(payload["error"]))
                delta = delta_from_outputs(payload, 0.0)
                yield delta
                if delta.finish_reason:
                    response.read()  # the end of the chunked body: the connection is reusable
                    done = True
                    return
        finally:
            if not done:  # left early (cancelled, an error mid-stream): drop the connection
                self.http.close()
                self.http = None


class OpenAIUser(HttpSseUser):
    """The OpenAI service (backend/openai): streamed `/v1/completions`, read as
    loadtest/openai_stream.py reads it (the workload's prompt as is, a delta per chunk)."""

    protocol = "openai"

    def stream(self, request: Request):
        if self.http is None:
            self.http = HTTPClient(*self.address, connection_timeout=30,
                                   network_timeout=STATE.config.request_timeout_s, concurrency=1)
        body = completion_body(STATE.config.model, request.prompt, STATE.config.sampling(request))
        done = False
        try:
            response = self.http.post("/v1/completions", body=json.dumps(body),
                                      headers={"Content-Type": "application/json"})
            if response.status_code != 200:
                raise ServerError(f"HTTP {response.status_code}", response.read().decode("utf-8", "replace"))
            reader = ChunkReader()
            while True:
                raw = response.readline(b"\n")
                if not raw:
                    done = True
                    raise ServerError("UNKNOWN", "the stream ended without data: [DONE]")
                line = raw.strip()
                if line == DONE:
                    response.read()  # the end of the chunked body: the connection is reusable
                    done = True
                    return
                delta = reader.delta(line)
                if delta is not None:
                    yield delta
        finally:
            if not done:  # left early (cancelled, an error mid-stream): drop the connection
                self.http.close()
                self.http = None
