"""Client request ids are the client's text: an absurd one is refused with INVALID_ARG, and what
the server logs of any id is bounded (a 1 MB id once made a 1 MB log line per cancel)."""

from __future__ import annotations

import pytest

from backend.protocol import LOGGED_REQUEST_ID_CHARS, MAX_REQUEST_ID_CHARS
from loadtest.chaos import GrpcCall, error_code, good_tensors

pytestmark = pytest.mark.slow


def _run(server, request_id: str, max_tokens: int = 64, **kwargs):
    call = GrpcCall(server.grpc_url)
    try:
        return call.run(good_tensors("an id test", {"max_tokens": max_tokens, "ignore_eos": True}),
                        request_id=request_id, **kwargs)
    finally:
        call.close()


def test_an_absurd_request_id_is_refused(server):
    outcome, message, _, _ = _run(server, "i" * (MAX_REQUEST_ID_CHARS + 1))
    assert outcome == "error" and error_code(message) == "INVALID_ARG", message
    assert f"at most {MAX_REQUEST_ID_CHARS}" in message
    outcome, message, _, _ = _run(server, "ok-id")
    assert outcome == "completed", message


def test_what_the_log_holds_of_a_long_id_is_bounded(server):
    long_id = "L" * MAX_REQUEST_ID_CHARS
    # a cancel logs its request's id; long enough that it cannot finish before the cancel is seen
    # (cancels are polled every 0.1 s: a 64-token request on a loaded CPU sometimes ended first)
    outcome, _, _, _ = _run(server, long_id, max_tokens=400, cancel_after_responses=1)
    assert outcome == "cancelled"
    outcome, message, _, _ = _run(server, "after the long id", timeout_s=60)
    assert outcome == "completed", message  # the cancel has been handled by now
    log = server.log_path.read_text(errors="replace")
    assert "L" * LOGGED_REQUEST_ID_CHARS in log  # the id's head is there to find the request by
    assert "L" * (LOGGED_REQUEST_ID_CHARS + 1) not in log
