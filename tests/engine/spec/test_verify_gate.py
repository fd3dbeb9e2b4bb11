"""The acceptance gate's record belongs to a sequence, not to its request id: a later request that
reuses an id (clients choose Triton's ids) starts as a new sequence does, verifying."""

from types import SimpleNamespace

from engine.spec.verify_gate import AcceptanceGate


def test_reused_request_id_starts_afresh():
    gate = AcceptanceGate(k=5, min_length=1.6, backoff=4, max_backoff=64)
    first = SimpleNamespace(request_id="r")
    for _ in range(4):  # four failed verifies: the running mean falls under the break-even
        gate.verified(first, 1)
    assert gate.backoffs == 1 and not gate.drafts(first, verified=False)
    again = SimpleNamespace(request_id="r")  # the same id, a new sequence
    assert gate.drafts(again, verified=False)
    gate.verified(again, 1)
    assert gate.backoffs == 1  # one failed verify of a fresh record stays above the break-even
