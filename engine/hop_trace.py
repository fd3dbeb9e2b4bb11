"""Per-request timestamps along the serving path, for `tools.profile_serving --hops`: where a
request's first token, and every later one, spends its time between the client and the engine core.

Off unless the environment variable DSV4_HOP_TRACE names a file prefix (a server started with it
passes it to the Triton stub and the engine core). Then every process that marks a request appends
one JSON line per request to `<prefix>.<pid>.jsonl` once the request is done there:
`{"id": request id, "hops": [[hop, tokens, t], ...]}`. `t` is time.monotonic(): CLOCK_MONOTONIC, one
clock per host, so the client's, the stub's and the core's marks line up. `tokens` is the request's
output tokens so far (cumulative) at that hop, 0 before the first token; a token's time at a hop is
that of the hop's first mark holding it, so deltas merged on the way (several tokens in one
response) still line up with the core's steps. Off, a mark costs one global read.

The hops, in path order (HOPS): the client sends, Triton calls the model's `execute`, the front's
admission thread takes the request (the core client's `submit`), tokenizes it and writes
`AddRequest` to the core, the core reads it, the core writes the step's outputs, the front reads
them, makes their text, hands them to a response thread, that thread starts the send (rendered)
and the send returns (Triton took the response), the client receives it.
"""

from __future__ import annotations

import json
import os
import threading
import time

ENV = "DSV4_HOP_TRACE"
HOPS = ("client_sent", "execute", "admitting", "submitted", "core_received", "core_sent", "read", "detokenized", "handed",
        "send_began", "sent", "client_received")

_prefix = os.environ.get(ENV) or None
_hops: dict[str, list] = {}
_write_lock = threading.Lock()


def enabled() -> bool:
    return _prefix is not None


def mark(request_id: str, hop: str, tokens: int = 0, t: float | None = None) -> None:
    if _prefix is None:
        return
    _hops.setdefault(request_id, []).append((hop, tokens, time.monotonic() if t is None else t))


def done(request_id: str) -> None:
    """The request's last mark in this process: write its line."""
    if _prefix is None:
        return
    hops = _hops.pop(request_id, None)
    if hops:
        line = json.dumps({"id": request_id, "hops": hops}) + "\n"
        with _write_lock, open(f"{_prefix}.{os.getpid()}.jsonl", "a", encoding="utf-8") as f:
            f.write(line)
