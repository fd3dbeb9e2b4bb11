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


def test_holds_back_foretells_each_plain_step_of_a_failing_sequence():
    """holds_back (asked before a step, so the step may stay in flight) says no draft comes after a
    step without a verify exactly when drafts() then says so, through every back-off and probe of a
    sequence whose verifies all fail."""
    gate = AcceptanceGate(k=5, min_length=1.6, backoff=4, max_backoff=16)
    seq = SimpleNamespace(request_id="r")
    drafted, held = True, 0
    for _ in range(120):
        if drafted:  # it verifies this step: one token, its drafts rejected
            assert not gate.holds_back(seq)
            gate.verified(seq, 1)
            drafted = gate.drafts(seq, verified=True)
        else:
            foretold = gate.holds_back(seq)
            drafted = gate.drafts(seq, verified=False)
            assert foretold == (not drafted)
            held += foretold
    assert gate.backoffs >= 6 and held > 80  # mostly held-back steps once the back-off reaches 16


def test_sequences_backing_off_at_different_steps_probe_together():
    """Back-offs end on the same steps, so a batch's steps between probes can all stay in flight. Each step
    as the engine runs it: the verifies of last step's drafts are counted, then tick(), then who drafts."""
    gate = AcceptanceGate(k=5, min_length=1.6, backoff=4, max_backoff=16)
    seqs = [SimpleNamespace(request_id=f"r{i}") for i in range(3)]
    drafted = {i: [] for i in range(3)}
    verifying = {i: True for i in range(3)}  # a new sequence drafts, so verifies, from its first step
    for step in range(200):
        live = [i for i in range(3) if step >= 7 * i]  # r1 and r2 start later: their back-offs begin elsewhere
        for i in live:
            if verifying[i]:
                gate.verified(seqs[i], 1)  # every draft rejected
        gate.tick()
        for i in live:
            verifying[i] = gate.drafts(seqs[i], verifying[i])
            if verifying[i]:
                drafted[i].append(step)
    late = [{d for d in drafted[i] if d >= 100} for i in range(3)]
    assert late[0] and late[0] == late[1] == late[2]  # at the longest back-off, the same probe steps
    assert all(b - a == 16 for a, b in zip(sorted(late[0]), sorted(late[0])[1:]))  # one probe every 16 steps
