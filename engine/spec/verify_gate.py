"""The acceptance gate: which speculating sequences draft (so verify) next step, from how their
verifies have paid off.

A verify step costs more than a plain decode step even when it verifies one draft (DSpark on
V4-Flash: an MoE reading more experts for more rows, the drafter, the rollback; docs/DSPARK.md), so
a sequence whose drafts keep failing (random weights; stretches of a real prompt the drafter cannot
guess) is better off decoding plainly. Each sequence keeps a running mean of its accepted length
(tokens emitted per verify: accepted drafts + 1), an exponential average that starts at the most a
verify can emit (a new sequence verifies). When a verify leaves it below `min_length` (the break-even
of the verify / plain cost ratio) the sequence backs off: it drafts nothing for `backoff` steps
(plain steps for it; the drafter still absorbs its rows, so drafting restarts without a catch-up),
then drafts once more and verifies that block (the probe). A back-off of n steps is stretched to
end on a step numbered a multiple of n, so sequences that stopped verifying at different times probe
in the same steps: a step stays in flight (async scheduling) only when no sequence in it drafts, and
staggered probes in a batch of 32 would leave almost none. A probe that brings the mean back over the
break-even resumes verifying and resets the back-off; one that fails backs off twice as long, up to
`max_backoff`. At acceptance 0 the steady state is plain steps plus a probe every `max_backoff` steps.

Only whether a sequence verifies changes, never how: a verify accepts by the same rule and a step
that verifies nothing samples as plain decoding does, so greedy output stays plain greedy and
sampling keeps the target distribution.
"""

from __future__ import annotations

from dataclasses import dataclass, field

MEAN_WEIGHT = 0.5  # the running mean's weight on the newest verify: four failed verifies of a new sequence reach 1.3


@dataclass
class _Track:
    mean: float  # running mean of tokens emitted per verify
    wait: int = 0  # steps left without drafts (0: drafts this step, verifies the next)
    backoff: int = 0  # the next back-off's length
    seq: object = field(default=None, repr=False)  # whose record: a later request reusing the id starts afresh


class AcceptanceGate:
    def __init__(self, k: int, min_length: float, backoff: int, max_backoff: int):
        """k: drafts per verify (a verify emits at most k + 1 tokens); min_length 0: always draft."""
        self.k1, self.min_length, self.backoff, self.max_backoff = k + 1, min_length, backoff, max_backoff
        self.tracks: dict[str, _Track] = {}  # request id -> its record (the sequence's, see _Track.seq)
        self.backoffs = 0  # times a sequence stopped verifying (or a probe failed)
        self.step = 0  # the speculative steps so far (tick): back-offs end on its multiples

    def tick(self) -> None:
        """One speculative step began (before its drafts are chosen)."""
        self.step += 1

    def _track(self, seq) -> _Track:
        t = self.tracks.get(seq.request_id)
        if t is None or t.seq is not seq:
            t = self.tracks[seq.request_id] = _Track(float(self.k1), 0, self.backoff, seq)
        return t

    def verified(self, seq, tokens: int) -> None:
        """A verify of this sequence emitted `tokens` (accepted drafts + 1)."""
        if not self.min_length:
            return
        t = self._track(seq)
        t.mean += MEAN_WEIGHT * (tokens - t.mean)
        if t.mean >= self.min_length:
            t.backoff = self.backoff  # paying off (again): the next failure starts from the first back-off
            return
        # the probe drafts in the first step numbered a multiple of n at least n - 1 steps on (a probe every n
        # steps once it fails: its verify is one of the n), so sequences backed off as long probe in the same
        # steps and the steps between stay in flight together; this step's tick() comes after
        n = t.backoff
        t.wait = n - 1 + (-(self.step + n)) % n
        t.backoff = min(2 * n, self.max_backoff)
        self.backoffs += 1

    def drafts(self, seq, verified: bool) -> bool:
        """At the end of a step: does this sequence draft a block for the next step? verified: it
        verified drafts this step (verified() has been told how many were accepted)."""
        if not self.min_length:
            return True
        t = self._track(seq)
        if t.wait and not verified:
            t.wait -= 1
        return t.wait == 0

    def holds_back(self, seq) -> bool:
        """Before a step in which the sequence verifies nothing: it will not draft after it either
        (drafts() then says no). Host state only, so a step of such sequences needs nothing read
        back before the next one is scheduled (engine/spec/decoder.py keeps it in flight)."""
        t = self.tracks.get(seq.request_id)
        return bool(self.min_length) and t is not None and t.seq is seq and t.wait >= 2

    def forget(self, live) -> None:
        """Drop the records of requests no longer in `live` (finished, aborted), once they outnumber
        the live ones: called every step, it sweeps only now and then."""
        if len(self.tracks) <= 2 * len(live) + 64:
            return
        for rid in [r for r in self.tracks if r not in live]:
            del self.tracks[rid]
