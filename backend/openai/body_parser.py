"""A request body's bytes -> its JSON value, checked (nesting, the forwarded fields' caps, valid
Unicode), off the event loop when the body is large.

Parsing holds the GIL for its whole run (json.loads and the nesting scan are single C calls: a
16 MiB list of ints takes about 0.7 s), so a thread would still stall every other request; a
large body is parsed in one of a few worker processes instead, and what comes back is already
within the caps (a long list never crosses the pipe). Small bodies, nearly all of them, are
parsed in place: a process hop costs more than their parse."""

from __future__ import annotations

import asyncio
import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool

from backend.openai import body_limits
from backend.openai.errors import OpenAIError, bad_request
from backend.openai.forward_limits import ForwardLimits, check_fields
from backend.process_tree import die_with_parent

LARGE_BODY_BYTES = 256 << 10  # parsed in a worker process from this size up
PARSE_WORKERS = 2  # what parsing may hold at once: each worker about 20x the body it parses


def decode(body: bytes, max_depth: int, limits: ForwardLimits) -> object:
    """The checked JSON value of `body`; OpenAIError (400) naming what is wrong."""
    body_limits.check_depth(body, max_depth)
    try:
        parsed = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise bad_request(f"the request body is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):  # every route takes an object: a long array never leaves the worker
        raise bad_request("the request body must be a JSON object")
    check_fields(parsed, limits)  # before the walk below, which is slow on a long list
    body_limits.check_text(parsed)
    return parsed


def _decode_in_worker(body: bytes, max_depth: int, limits: ForwardLimits) -> tuple[object, dict | None]:
    """decode's result, or its error as plain fields (OpenAIError's constructor does not unpickle)."""
    try:
        return decode(body, max_depth, limits), None
    except OpenAIError as e:
        return None, {"status": e.status, "message": e.message, "type": e.type, "param": e.param, "code": e.code}


class BodyParser:
    def __init__(self, max_depth: int, limits: ForwardLimits, large_bytes: int = LARGE_BODY_BYTES,
                 workers: int = PARSE_WORKERS):
        self.max_depth, self.limits, self.large_bytes, self.workers = max_depth, limits, large_bytes, workers
        self._pool: ProcessPoolExecutor | None = None

    async def parse(self, body: bytes) -> object:
        if len(body) < self.large_bytes:
            return decode(body, self.max_depth, self.limits)
        if self._pool is None:  # spawned (not forked: this process runs gRPC's threads) on first use
            self._pool = ProcessPoolExecutor(self.workers, mp_context=multiprocessing.get_context("spawn"),
                                             initializer=die_with_parent)  # none outlives a SIGKILLed front
        loop = asyncio.get_running_loop()
        try:
            parsed, error = await loop.run_in_executor(self._pool, _decode_in_worker, body, self.max_depth,
                                                       self.limits)
        except BrokenProcessPool:  # a worker died (killed, out of memory): the next body gets new ones
            self.close()
            raise OpenAIError(503, "the request body's parser failed; retry", type="service_unavailable",
                              code="service_unavailable") from None
        if error is not None:
            raise OpenAIError(**error)
        return parsed

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
