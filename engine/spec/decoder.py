"""Speculative decoding with the checkpoint's own drafter: one engine step that verifies drafts.

Two drafters (speculative_config's method): the preview release's MTP layer (k chained
single-token steps) or 0731's DSpark stages (engine/spec/dspark.py: a block per step from the
target's features, the confidence head choosing how much of it to verify; docs/DSPARK.md).

A step in which some scheduled sequence speculates runs here instead of LLMEngine._step:

1. every decoding sequence holding drafts (spec_token_ids, proposed by the previous step) runs
   its last token plus its k drafts: k + 1 positions in one forward of the main model, packed
   with the step's prefill chunks and plain decodes;
2. the target's logits at those positions accept a prefix of the drafts (greedy: exact argmax
   match; sampled: rejection sampling, engine/spec/rejection_sampler.py) plus one token of its own;
3. the paged hybrid cache rolls back what was rejected: window KV and compressed entries are
   addressed by position and rewritten when those positions run again, so only the
   compressors' rolling state needs it: the block holding the first rejected position, if the
   step closed it, is reopened (its rows put back into the open-block state, the CSA overlap state
   set to the block before it); blocks the step closed after it hold only rejected positions and
   are rewritten before anything reads them; num_computed_tokens / compress_from move only over
   accepted positions, so nothing rejected reaches the prefix cache;
4. the drafter catches up over the step's accepted positions (the MTP: its window KV; DSpark: the
   main context of those positions) and drafts up to k tokens for the next step;
5. the scheduler advances by what was accepted and the tokens are emitted in order (stops,
   lengths and stop strings cut them as usual).

Per engine `num_speculative_tokens` = k; a request speculates unless its parameters need the
plain sampler at every token (penalties, logit bias, bad words, allowed ids, structured outputs,
logprobs, a seed, or min_tokens not yet reached): those take k = 0 and keep their exact
per-token semantics. A step with no speculating sequence takes the ordinary path (CUDA graphs,
async scheduling). A speculative step in which every sequence decodes replays a verify graph and
then a draft graph per batch bucket when decode graphs are captured: the MTP's
(engine/spec/verify_graphs.py, engine/spec/draft_graphs.py), or DSpark's, whose verify graphs also
leave the target features (engine/spec/dspark_graphs.py); others (prefill chunks in the batch) run
eagerly (step_paths counts both). Either way the step reads back before the next one is scheduled,
except DSpark's steps that verify nothing and after which nobody drafts (every speculating sequence
held back by the acceptance gate, host state known before the step): under async scheduling such a
step stays in flight as a plain decode step does (its greedy tokens on the device for the next
step's inputs; step_paths' plain_async), and the first step that verifies or drafts again reads it
back first.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.args import InvalidEngineArgs
from engine.forward_batch import ForwardBatch
from engine.graphs.capture import capture
from engine.in_flight import InFlight
from engine.prompt_logprobs import prompt_logprob_rows
from engine.sampler import sampling_probs
from engine.sequence import PENDING_TOKEN, Sequence, Status
from engine.spec.config import SpeculativeConfig
from engine.spec.draft_graphs import DraftGraphs
from engine.spec.dspark import DSparkProposer
from engine.spec.dspark_graphs import DSparkGraphs
from engine.spec.plain_graphs import PlainStepGraphs
from engine.spec.rejection_sampler import greedy_accept, rejection_sample
from engine.spec.rollback_graphs import reopen
from engine.spec.verify_gate import AcceptanceGate
from engine.spec.verify_graphs import VerifyGraphs


def speculates(seq: Sequence) -> bool:
    """Parameters rejection sampling reproduces exactly (the target's distribution per token)."""
    p = seq.sampling
    return not p.processes_logits and p.logprobs is None and p.seed is None


def graph_buckets(engine, k: int) -> list[int]:
    """The batch buckets the decode graphs have whose verify of k + 1 rows per sequence fits the
    token budget; none when the runner captured no decode graphs (speculative steps run eagerly)."""
    if engine.device.type != "cuda" or not any(g.graph is not None for g in engine.runner.graphs.values()):
        return []
    return [b for b in engine.runner.graphs if b * (k + 1) <= engine.args.max_num_batched_tokens]


def spec_graphs(engine, k: int, mtp, mtp_cache) -> tuple[VerifyGraphs | None, DraftGraphs | None]:
    """The MTP's verify graphs and its draft graphs for the same buckets, captured when the runner
    captured decode graphs; else None."""
    buckets = graph_buckets(engine, k)
    if not buckets:
        return None, None
    pool = torch.cuda.graph_pool_handle()
    verify = VerifyGraphs(engine.model, engine.cache, engine.max_model_len, k, buckets, pool)
    return verify, DraftGraphs(mtp, engine.model, mtp_cache, verify, pool)


@dataclass
class DSparkStepGraphs:
    verify: VerifyGraphs  # verify graphs that also leave the target features
    draft: DSparkGraphs  # the drafter after a verify graph
    plain: PlainStepGraphs  # a step that verifies nothing: the decode graph with the target features
    plain_draft: DSparkGraphs  # the drafter after it


def dspark_graphs(engine, k: int, dspark: DSparkProposer, buckets: list[int], pool=None,
                  capture_fn=capture) -> DSparkStepGraphs:
    """DSpark's graphs for `buckets` (each needs the runner's static decode batch), captured into
    `pool` (None: static batches run eagerly, the CPU tests' way; capture_fn: their emulation)."""
    verify = VerifyGraphs(engine.model, engine.cache, engine.max_model_len, k, buckets, pool, capture_fn,
                          features=True)
    plain = PlainStepGraphs(engine.runner, buckets, pool, capture_fn)
    return DSparkStepGraphs(verify, DSparkGraphs(dspark, engine.model, verify, pool, capture_fn), plain,
                            DSparkGraphs(dspark, engine.model, plain, pool, capture_fn))


class SpecDecoder:
    def __init__(self, engine, spec: SpeculativeConfig):
        self.engine, self.method = engine, spec.method
        if spec.method not in engine.model.speculative_methods:
            raise InvalidEngineArgs(f"speculative_config: {type(engine.model).__name__} has no {spec.method} draft "
                                    f"(speculative methods: {list(engine.model.speculative_methods) or 'none'})")
        cfg = engine.cfg
        self.dspark = None
        if spec.method == "dspark":
            if cfg.dspark is None:
                raise InvalidEngineArgs("speculative_config: method 'dspark' needs a checkpoint with DSpark draft "
                                        "stages (the 0731 layout); this one has none")
            self.k = spec.num_speculative_tokens or cfg.dspark.block_size  # default: the checkpoint's whole block
            if self.k > cfg.dspark.block_size:
                raise InvalidEngineArgs(f"speculative_config: num_speculative_tokens={self.k} exceeds the checkpoint's "
                                        f"dspark_block_size ({cfg.dspark.block_size})")
        else:
            self.k = spec.num_speculative_tokens
        self.forced_drafts: dict[str, list[int]] | None = None  # benchmarks: see force_drafts
        self.mtp_drafts: dict[str, list[int]] = {}  # the last step's own drafts (before force_drafts)
        self.gate = None  # which sequences draft (so verify) next step; None: every speculating one
        self.plain_steps = self.plain_draft_steps = None  # DSpark: steps that verify nothing, graphed
        if spec.method == "dspark":
            self.mtp = self.mtp_cache = None
            self.dspark = DSparkProposer(engine, engine.model.dspark_draft(), self.k, spec.confidence_threshold)
            self.gate = AcceptanceGate(self.k, spec.min_acceptance_length, spec.backoff_steps, spec.max_backoff_steps)
            self.verify_steps = self.draft_steps = None
            buckets = graph_buckets(engine, self.k)
            if buckets:
                self.use_dspark_graphs(dspark_graphs(engine, self.k, self.dspark, buckets, torch.cuda.graph_pool_handle()))
        else:
            self.mtp = engine.model.mtp_draft()
            self.mtp_cache = self.mtp.make_cache(engine.cache)
            # steps in which every sequence decodes replay a verify graph and an MTP graph per batch bucket
            self.verify_steps, self.draft_steps = spec_graphs(engine, self.k, self.mtp, self.mtp_cache)
        self.use_graphs = True  # benchmarks switch it off to time the eager path on the same engine
        # plain_async: of the steps that verify nothing (plain_graph, or verify_eager on the eager path),
        # those left in flight (async scheduling)
        self.step_paths = {"verify_graph": 0, "verify_eager": 0, "plain_graph": 0, "plain_async": 0,
                           "draft_graph": 0, "draft_eager": 0}
        self.reset_counters()

    def use_dspark_graphs(self, g: DSparkStepGraphs) -> None:
        self.verify_steps, self.draft_steps = g.verify, g.draft
        self.plain_steps, self.plain_draft_steps = g.plain, g.plain_draft

    def reset_counters(self) -> None:
        self.counters = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                         "spec_decode_num_accepted_tokens": 0,
                         "spec_decode_num_steps_without_verify": 0}  # speculative steps in which no sequence verified
        if self.gate is not None:
            self.gate.backoffs = 0
        self.accepted_per_pos = [0] * self.k
        self.accepted_lengths = [0] * (self.k + 1)  # index a: verifies that accepted a drafts (a + 1 tokens)
        if self.dspark is not None:
            self.dspark.chosen_lengths.clear()

    def force_drafts(self, outputs: dict[str, list[int]] | None) -> None:
        """Benchmarks: the MTP runs as usual but its drafts are replaced by these tokens (request id ->
        the output of an earlier run of the same prompt): the cost of a draft that always agrees."""
        self.forced_drafts = outputs

    def wants(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        return any(speculates(s) for s, _ in scheduled)

    def stats(self) -> dict:
        c = self.counters
        drafts, tokens, acc = c["spec_decode_num_drafts"], c["spec_decode_num_draft_tokens"], c["spec_decode_num_accepted_tokens"]
        out = {**c, "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
               "spec_decode_acceptance_rate": acc / tokens if tokens else 0.0,
               "spec_decode_mean_acceptance_length": 1 + acc / drafts if drafts else 0.0,
               "spec_decode_accepted_length_counts": list(self.accepted_lengths)}
        if self.dspark is not None:  # index i: blocks whose confidence head chose i + 1 drafts
            chosen = self.dspark.chosen_lengths
            out["spec_decode_dspark_chosen_length_counts"] = [chosen[n] for n in range(1, self.engine.cfg.dspark.block_size + 1)]
            out["spec_decode_num_confidence_skips"] = chosen[0]  # blocks the confidence head chose not to verify
        if self.gate is not None:
            out["spec_decode_num_backoffs"] = self.gate.backoffs
        return out

    # --- the step -----------------------------------------------------------------------------

    def step(self, scheduled: list[tuple[Sequence, int]]) -> list:
        eng = self.engine
        if self._stays_in_flight(scheduled):
            return self._plain_step_in_flight(scheduled)
        outputs = eng.flush()  # a plain step still in flight: its tokens become real first
        scheduled = [(s, n) for s, n in scheduled if s.request_id in eng.requests]
        if not scheduled:
            return outputs
        batch = self._attach_drafts(scheduled)
        verifying = any(s.spec_token_ids for s, _ in batch)
        if not verifying:
            self.counters["spec_decode_num_steps_without_verify"] += 1
        # nobody verifies and every sequence decodes: a plain decode step's graph (with the features)
        plain_graphed = not verifying and self._plain_graphed(batch)
        graphed = (not plain_graphed and self.verify_steps is not None and self.use_graphs
                   and self.verify_steps.fits(batch))
        if plain_graphed:
            self.step_paths["plain_graph"] += 1
            logits, features = self.plain_steps.run(batch)
            hidden = closed = snapshot = blocks = None
        elif graphed:
            self.step_paths["verify_graph"] += 1  # every sequence decodes: the bucket's padded batch
            out = self.verify_steps.run(batch)
            logits, hidden, features = out.logits, out.hidden, out.features
            closed, snapshot = out.closed_blocks, out.snapshot
            blocks = out.blocks
        else:
            self.step_paths["verify_eager"] += 1
            fb = eng.runner.build_batch(batch)
            snapshot = closed = None
            if verifying:
                closed = fb.closed_blocks = {}
                snapshot = self._snapshot([s.blocks.state_slot for s, _ in batch])
            if self.dspark is not None:  # the target's features at the DSpark target layers too
                hidden, features = eng.model.dspark_features(fb, eng.cache)
            else:
                hidden, features = eng.model.hidden_states(fb, eng.cache), None
            logits = eng.model.compute_logits(hidden[fb.logits_rows])
            prompt_rows = prompt_logprob_rows(batch, eng.device)  # prompt_logprobs of this step's prefill rows
            if prompt_rows is not None:
                prompt_rows.hidden = hidden[prompt_rows.rows]
                eng._score_prompts(prompt_rows)
            blocks = None

        # logits rows: per sequence in batch order, from its last known token on
        plain, plain_rows, verify, verify_rows, row = [], [], [], [], 0
        for seq, n in batch:
            m = seq.num_computed_tokens + n - seq.num_tokens + 1
            if m <= 0:
                continue
            (verify if seq.spec_token_ids else plain).append(seq)
            (verify_rows if seq.spec_token_ids else plain_rows).append(row)
            row += m
        plain, samples = eng._draw(plain, logits[plain_rows]) if plain else ([], [])
        emitted = self._verify(verify, verify_rows, logits) if verify else {}
        if verifying:
            if blocks is None:  # the eager plan's closed blocks, read back after _verify's sync
                blocks = {m: (plan.blk_seq.tolist(), plan.blk_entry.tolist()) for (kind, m), plan in fb.plans.items()
                          if kind == "compress" and plan.num_blocks}
            self._rollback(batch, emitted, blocks, closed, snapshot, graphed)

        # the MTP follows every speculating sequence over this step's accepted positions
        nxt = {id(s): [smp.token_id] for s, smp in zip(plain, samples) if smp.error is None}
        nxt.update({sid: [t for t, _ in toks] for sid, toks in emitted.items()})
        if self.dspark is not None:
            drafted = self._propose_dspark(batch, features, nxt, {id(s) for s in verify},
                                           self.plain_draft_steps if plain_graphed else
                                           self.draft_steps if graphed else None)
        else:
            drafted = self._propose(batch, hidden, nxt, graphed and self.draft_steps is not None)

        # while the drafter's graph runs: the scheduler and the outputs (neither reads the drafts)
        eng.scheduler.advance([(s, len(emitted[id(s)]) if id(s) in emitted else n)
                               for s, n in batch if s.status == Status.RUNNING])
        for seq, smp in zip(plain, samples):
            outputs += eng._emit(seq, smp)
        for seq in verify:
            for token, logprob in emitted[id(seq)]:
                if seq.request_id not in eng.requests:
                    break  # finished (stop, length, stop string): the rest is dropped
                outputs += eng._process(seq, token, logprob, None)
        drafted()
        return outputs

    def _plain_graphed(self, batch: list[tuple[Sequence, int]]) -> bool:
        """A step that verifies nothing replays the plain step's graph (else it runs eagerly)."""
        return self.plain_steps is not None and self.use_graphs and self.plain_steps.fits(batch)

    def _stays_in_flight(self, scheduled: list[tuple[Sequence, int]]) -> bool:
        """DSpark under async scheduling: every sequence decodes one token holding no drafts, none
        will draft after this step (the gate holds back each speculating one), and the step could
        stay in flight as a plain one (greedy, nothing to report, no length end:
        LLMEngine._can_keep_in_flight). With CUDA graphs only a graphed step, as the plain path
        reads back before an eager one."""
        eng = self.engine
        if self.gate is None or not eng.async_scheduling:
            return False
        if not all(n == 1 and not s.spec_token_ids and s.num_computed_tokens == s.num_tokens - 1
                   and (self.gate.holds_back(s) or not speculates(s)) for s, n in scheduled):
            return False
        return eng._can_keep_in_flight(scheduled) and (self._plain_graphed(scheduled) or not eng.flush_before_eager)

    def _plain_step_in_flight(self, batch: list[tuple[Sequence, int]]) -> list:
        """A step that verifies nothing and after which nobody drafts, left in flight: the plain
        step (its graph, or eagerly) with the last tokens still in flight read on the device, the
        drafter's keys of its rows (they need the target features, not the tokens just sampled),
        the greedy tokens kept on the device as the engine's pending step; then the step before is
        read back and returned, as LLMEngine._step does for a plain decode step."""
        eng = self.engine
        prev = eng.pending
        pending = (prev.token_ids, prev.rows) if prev else None
        self.counters["spec_decode_num_steps_without_verify"] += 1
        self.step_paths["plain_async"] += 1
        graphs = None
        if self._plain_graphed(batch):
            self.step_paths["plain_graph"] += 1
            logits, features = self.plain_steps.run(batch, pending)
            graphs = self.plain_draft_steps
        else:
            self.step_paths["verify_eager"] += 1
            fb = eng.runner.build_batch(batch)
            eng.runner._fill_pending(fb.input_ids, batch, pending, list(range(len(batch))))
            hidden, features = eng.model.dspark_features(fb, eng.cache)
            logits = eng.model.compute_logits(hidden[fb.logits_rows])
        picked = eng.pick_on_device([s for s, _ in batch], logits)
        # nobody drafts, so the tokens are only counted (one row each), never read
        self._propose_dspark(batch, features, {id(s): [PENDING_TOKEN] for s, _ in batch}, set(), graphs)
        # launched after the drafter: its staging copy is behind the read-back
        return eng.leave_in_flight(batch, InFlight.launch(batch, picked))

    def _attach_drafts(self, scheduled: list[tuple[Sequence, int]]) -> list[tuple[Sequence, int]]:
        """Decodes holding drafts run them too, while the step's token budget and the blocks last."""
        eng = self.engine
        budget = eng.args.max_num_batched_tokens - sum(n for _, n in scheduled)
        out = []
        for seq, n in scheduled:
            d = seq.spec_token_ids[:max(0, budget)]
            p = seq.num_computed_tokens
            if d and not (n == 1 and p == seq.num_tokens - 1 and speculates(seq)):
                d = []
            if d and not eng.scheduler._try_allocate(seq, 1 + len(d)):
                d = []
            seq.spec_token_ids = d
            budget -= len(d)
            out.append((seq, n + len(d)))
        return out

    def _verify(self, seqs: list[Sequence], rows: list[int], logits: torch.Tensor) -> dict[int, list]:
        """id(seq) -> [(token, raw logprob)] emitted: the accepted drafts, then the target's token."""
        dev = logits.device
        nd = [len(s.spec_token_ids) for s in seqs]
        k = max(nd)
        num = torch.tensor(nd, device=dev)
        idx = torch.tensor(rows, device=dev)[:, None] + torch.arange(k + 1, device=dev)[None].minimum(num[:, None])
        target = logits[idx]  # [S, k + 1, V]
        drafts = torch.tensor([s.spec_token_ids + [0] * (k - len(s.spec_token_ids)) for s in seqs], device=dev)
        tokens = torch.empty(len(seqs), k + 1, dtype=torch.long, device=dev)
        accepted = torch.empty(len(seqs), dtype=torch.long, device=dev)
        greedy = [i for i, s in enumerate(seqs) if s.sampling.greedy]
        rand = [i for i, s in enumerate(seqs) if not s.sampling.greedy]
        for part, fn in ((greedy, self._greedy), (rand, self._sampled)):
            if part:
                pi = torch.tensor(part, device=dev)
                t, a = fn(target[pi], drafts[pi], num[pi], [seqs[i] for i in part])
                tokens[pi], accepted[pi] = t, a
        logprob = target.gather(2, tokens.clamp(min=0)[..., None])[..., 0] - target.logsumexp(-1)
        tokens, accepted, logprob = tokens.tolist(), accepted.tolist(), logprob.tolist()  # the step's host sync
        out = {}
        for i, s in enumerate(seqs):
            a = accepted[i]
            out[id(s)] = list(zip(tokens[i][:a + 1], logprob[i][:a + 1]))
            if self.gate is not None:
                self.gate.verified(s, a + 1)
            self.counters["spec_decode_num_drafts"] += 1
            self.counters["spec_decode_num_draft_tokens"] += nd[i]
            self.counters["spec_decode_num_accepted_tokens"] += a
            for j in range(a):
                self.accepted_per_pos[j] += 1
            self.accepted_lengths[a] += 1
        return out

    @staticmethod
    def _greedy(target, drafts, num, seqs):
        return greedy_accept(target.argmax(-1), drafts, num)

    def _sampled(self, target, drafts, num, seqs):
        S, k1, V = target.shape
        params = [s.sampling for s in seqs for _ in range(k1)]
        probs = sampling_probs(target.reshape(S * k1, V), params).view(S, k1, V)
        return rejection_sample(probs, drafts, num, self.engine.generator)

    # --- rollback of the compressors' rolling state -------------------------------------------

    def _states(self):
        c = self.engine.cache
        return [st for st in c.comp_state + c.index_state if st is not None]

    def _snapshot(self, slots: list[int]) -> dict:
        """CSA overlap state of the batch's slots before the step (what a reopened block needs), at
        each sequence's batch index."""
        idx = torch.tensor(slots, device=self.engine.device)
        return {id(st): (st.prev_kv[idx].clone(), st.prev_gate[idx].clone(), st.has_prev[idx].clone())
                for st in self._states() if st.prev_kv is not None}

    def _rollback(self, batch, emitted: dict, blocks: dict, closed: dict, snapshot: dict, graphed: bool) -> None:
        """Reopen, per sequence and compressor, the block holding the first rejected position when
        this step closed it: its rows (the gathered block, rows at accepted positions exact, the
        others rewritten when they run again) go back to the open-block state, and the overlap state
        is the Ca slice of the block before it (this step's closed block, or the state from before
        the step). A verify longer than the ratio may have closed more blocks after it: they hold
        only rejected positions, which run again and rewrite them before anything reads them.
        blocks: ratio -> (batch index, entry) of each closed block in plan order (a sequence's
        blocks adjacent, ascending); closed: id(state) -> those blocks' (kv, gate) rows; snapshot:
        id(state) -> the overlap state by batch index. graphed: after a verify graph, whose rollback
        graph does the copies (engine/spec/rollback_graphs.py)."""
        ends = {}  # batch index -> first rejected position
        for b, (seq, _) in enumerate(batch):
            toks = emitted.get(id(seq))
            if toks is not None and len(toks) < len(seq.spec_token_ids) + 1:
                ends[b] = seq.num_computed_tokens + len(toks)
        if not ends:
            return
        fixes = {}  # ratio -> (closed block, state slot, batch index, closed block before it or -1) to reopen
        for m, (blk_seq, blk_entry) in blocks.items():
            f = [(j, batch[s][0].blocks.state_slot, s, j - 1 if j and blk_seq[j - 1] == s else -1)
                 for j, (s, e) in enumerate(zip(blk_seq, blk_entry)) if s in ends and e == ends[s] // m]
            if f:
                fixes[m] = f
        if graphed:
            if fixes:
                self.verify_steps.rollback.run(len(batch), fixes)
            return
        dev = self.engine.device
        for m, f in fixes.items():
            reopen(self._states(), closed, snapshot, m, *(torch.tensor(x, device=dev) for x in zip(*f)))

    # --- drafting -----------------------------------------------------------------------------

    def _propose(self, batch, hidden: torch.Tensor, nxt: dict[int, list[int]], graphed: bool = False):
        """MTP over each speculating sequence's accepted rows of this step (inputs: the main model's
        streams at i and the token at i + 1), then k - 1 chained single-token MTP steps: drafts.
        graphed: the step replayed a verify graph, so the MTP's graph of that bucket runs them.
        -> a function that sets the drafts as spec_token_ids (the graph's read-back waits there)."""
        eng = self.engine
        items, rows, where = self._catch_up(batch, nxt)
        if not items:
            return lambda: None
        if not graphed:
            fb_m = self._batch(items)
            h = self.mtp(eng.model, fb_m, self.mtp_cache, hidden[torch.tensor(rows, device=hidden.device)])
        drafting = []  # (item index, position of its next MTP row, drafts wanted, outputs after this step)
        for j, base, k, n_out in self._wanted(items):
            # the chained MTP rows (positions base .. base + k - 2) need window blocks
            if k > 1 and not eng.scheduler._try_allocate(items[j][0], len(items[j][2]) + k - 1):
                k = 1
            drafting.append((j, base, k, n_out))
        if graphed:  # the catch-up runs even when nobody drafts: it keeps the MTP's window KV
            self.step_paths["draft_graph"] += 1
            self.draft_steps.launch(batch, {where[j][0]: (where[j][1], toks) for j, (_, _, toks) in enumerate(items)},
                                    {where[j][0]: (base, k) for j, base, k, _ in drafting})

            def read():
                drafts = self.draft_steps.read(len(batch))
                self._set_drafts(items, drafting, [drafts[where[j][0]][:k] for j, _, k, _ in drafting])
            return read
        self.step_paths["draft_eager"] += 1
        if drafting:
            self._set_drafts(items, drafting, self._chain(h, fb_m, items, drafting))
        return lambda: None

    def _catch_up(self, batch, nxt: dict[int, list[int]]):
        """Each speculating sequence's rows of this step whose input tokens are now known (a prefill
        chunk's, or up to the last accepted one): items (sequence, first position, the token after
        each row), their rows in the step's batch, and each item's (batch index, first row). Clears
        every sequence's drafts."""
        self.mtp_drafts = {}
        items, rows, where, row0 = [], [], [], 0
        for b, (seq, n) in enumerate(batch):
            start = seq.num_computed_tokens
            toks = None
            if speculates(seq) and seq.status == Status.RUNNING:
                if start + n < seq.num_tokens:  # a prefill chunk: every next token is known
                    toks = seq.token_ids[start + 1:start + n + 1]
                elif id(seq) in nxt:  # up to the last accepted row: the known tokens, then this step's
                    toks = seq.token_ids[start + 1:] + nxt[id(seq)]
            if toks:
                items.append((seq, start, toks))
                rows.extend(range(row0, row0 + len(toks)))
                where.append((b, row0))
            seq.spec_token_ids = []
            row0 += n
        return items, rows, where

    def _wanted(self, items):
        """(item index, position of its last token, drafts wanted, outputs after this step) of each
        item that drafts: not a prefill chunk, min_tokens reached, room left."""
        eng, out = self.engine, []
        for j, (seq, start, toks) in enumerate(items):
            base = start + len(toks)  # num_tokens - 1 once this step's tokens are appended
            n_out = base + 1 - seq.num_prompt_tokens
            if base < seq.num_tokens or n_out < seq.sampling.min_tokens:
                continue  # a prefill chunk (nothing to draft yet), or min_tokens still bans stop tokens
            k = min(self.k, eng.max_model_len - base - 1, seq.sampling.max_tokens - n_out - 1)
            if k > 0:
                out.append((j, base, k, n_out))
        return out

    def _propose_dspark(self, batch, features: torch.Tensor, nxt: dict[int, list[int]], verified: set[int],
                        graphs: DSparkGraphs | None = None):
        """DSpark: every stage's keys of each speculating sequence's known rows, then one block per
        sequence the acceptance gate lets draft; the confidence head's verify length caps its drafts.
        verified: id() of the sequences that verified drafts this step. graphs: the drafter's graphs
        after the step's graph (a verify's or a plain step's), which do both.
        -> a function that sets the drafts as spec_token_ids (the graph's read-back waits there)."""
        items, rows, where = self._catch_up(batch, nxt)
        self.gate.tick()
        drafting = [d for d in self._wanted(items)
                    if self.gate.drafts(items[d[0]][0], id(items[d[0]][0]) in verified)]
        self.gate.forget(self.engine.requests)
        if graphs is not None and items:  # the keys are written even when nobody drafts
            self.step_paths["draft_graph"] += 1
            read = graphs.launch(batch, items, where, drafting)
            return lambda: self._set_drafts(items, drafting, read())
        self.step_paths["draft_eager"] += 1
        self.dspark.absorb(items, features[torch.tensor(rows, dtype=torch.long, device=features.device)]
                           if rows else None)
        if drafting:
            self._set_drafts(items, drafting, self.dspark.draft(items, drafting))
        return lambda: None

    def _set_drafts(self, items, drafting, out: list[list[int]]) -> None:
        self.mtp_drafts = {items[j][0].request_id: d for (j, *_), d in zip(drafting, out)}
        for (j, _, _, n_out), d in zip(drafting, out):
            seq = items[j][0]
            if self.forced_drafts is not None and seq.request_id in self.forced_drafts:
                d = self.forced_drafts[seq.request_id][n_out:n_out + len(d)]
            seq.spec_token_ids = d

    def _chain(self, h: torch.Tensor, fb_m: ForwardBatch, items, drafting) -> list[list[int]]:
        """Eagerly: draft 1 from each drafting item's last catch-up row, then k - 1 chained steps."""
        eng = self.engine
        h = h[fb_m.logits_rows[torch.tensor([j for j, *_ in drafting], device=h.device)]]
        out = [[t] for t in self.mtp.compute_logits(eng.model, h).argmax(-1).tolist()]
        for step in range(1, max(k for _, _, k, _ in drafting)):
            live = [i for i, (_, _, k, _) in enumerate(drafting) if k > step]
            sel = torch.tensor(live, device=h.device)
            fb_d = self._batch([(items[drafting[i][0]][0], drafting[i][1] + step - 1, [out[i][-1]]) for i in live])
            h_live = self.mtp(eng.model, fb_d, self.mtp_cache, h[sel])
            h = h.index_copy(0, sel, h_live)
            for i, t in zip(live, self.mtp.compute_logits(eng.model, h_live).argmax(-1).tolist()):
                out[i].append(t)
        return out

    def _batch(self, items: list[tuple[Sequence, int, list[int]]]) -> ForwardBatch:
        """The MTP's batch: (sequence, first position, input tokens) each, one row per token, its
        window KV at the main cache's window slots; logits rows: each sequence's last row."""
        bs, dev = self.engine.cache.block_size, self.engine.device
        ids, pos, slots, lens, starts, replay, tables, slot_ids, last = [], [], [], [], [], [], [], [], []
        for seq, start, toks in items:
            wt = seq.blocks.window_table
            ids += toks
            pos += range(start, start + len(toks))
            slots += [wt[i // bs] * bs + i % bs for i in range(start, start + len(toks))]
            lens.append(len(toks))
            starts.append(start)
            replay.append(seq.replay_start)
            tables.append(wt)
            slot_ids.append(seq.blocks.state_slot)
            last.append(len(ids) - 1)
        width = max(map(len, tables))
        t = lambda x: torch.tensor(x, dtype=torch.long, device=dev)
        wt = t([w + [-1] * (width - len(w)) for w in tables])
        return ForwardBatch(t(ids), t(pos), lens, starts, replay, list(starts), t(slots), wt, torch.zeros_like(wt),
                            slot_ids, t(last), t([s for s, n in enumerate(lens) for _ in range(n)]), t(replay),
                            t(slot_ids), all(n == 1 for n in lens), max(pos))
