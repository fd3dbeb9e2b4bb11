"""The synchronous engine core: requests in, one step at a time, deltas out.

request -> tokenizer -> scheduler -> runner -> model -> sampler -> detokenizer -> RequestOutput.
llm.py wraps it: `LLM` for offline use, `AsyncLLM` (the step loop in its own thread) for serving.
"""

from __future__ import annotations

import logging
import math
import threading
from dataclasses import dataclass, field

import torch

import kernels
from engine.args import EngineArgs, InvalidEngineArgs, resolve_model_dir
from engine.cache import KVCache
from engine.chunk_budget import ChunkBudgetConfig
from engine.graphs.mixed import mixed_sizes
from engine.in_flight import InFlight
from engine.models import registry
from engine.models.config import CSA
from engine.output_text import OutputText
from engine.parallel import SINGLE
from engine.prefix_cache import PrefixCache
from engine.prompt_logprobs import prompt_logprob_rows, score
from engine.request import GenerationRequest, InvalidRequest, RequestOutput, SamplingParams
from engine.runner import ModelRunner
from engine.sampler import (
    NO_TOKEN,
    Sample,
    SamplingRow,
    device_rows,
    in_flight_logprobs,
    pick_on_device,
    sample,
)
from engine.sampling_checks import RequestLimits, bad_words_token_ids, sampling_checks
from engine.scheduler import Scheduler
from engine.sequence import PENDING_TOKEN, Sequence, Status
from engine.spec.config import SpeculativeConfig
from engine.spec.decoder import SpecDecoder
from engine.structured_output import GrammarCompiler
from engine.tokenizer import Tokenizer
from engine.tp_workers import TensorParallelWorkers
from kernels import pdl

CPU_KV_BYTES = 256 << 20  # default KV budget on CPU
ITERATION_TOKEN_BUCKETS = 21  # powers of two up to 2^20 tokens a step; larger steps count in the last
log = logging.getLogger("deepseek.engine")


@dataclass
class RequestState:
    seq: Sequence
    text: OutputText | None  # None: token ids only (the engine core process; its front makes the text)
    eos_ids: set[int]
    new_token_ids: list[int] = field(default_factory=list)
    new_logprobs: list[dict[int, float]] = field(default_factory=list)
    new_ranks: list[int] = field(default_factory=list)  # with logprobs: each sampled token's rank (vLLM's)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # with prompt_logprobs: until sent
    prompt_ranks: list[int | None] | None = None


def family_load_args(args: EngineArgs, model_dir) -> dict:
    """The engine arguments only some families' loaders take; set for another family: refused."""
    if registry.family(model_dir).Model.supports_host_engram:
        return {"engram_tables": args.engram_tables}
    if args.engram_tables in ("host", "mmap"):
        raise InvalidEngineArgs(f"engram_tables={args.engram_tables!r}: this checkpoint has no Engram tables")
    return {}


class LLMEngine:
    def __init__(self, args: EngineArgs | dict, detokenize: bool = True):
        """detokenize=False: outputs carry token ids only and stop strings are left to the caller
        (the engine core process: text work belongs to its front, not to the step loop)."""
        args = EngineArgs.of(args)
        args.validate()
        self.args = args
        self.detokenize = detokenize
        kernels.set_backend(args.kernels)
        model_dir = resolve_model_dir(args.model)
        self.device = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device)
        self.pdl = pdl.configure(args.pdl, self.device)  # before any capture: graphs keep what they were captured with
        log.info("programmatic dependent launch (pdl=%s): %s", args.pdl, "on" if self.pdl else "off")
        family = registry.family(model_dir).Model
        if args.tensor_parallel_size > 1 and not family.supports_tensor_parallel:
            raise InvalidEngineArgs(f"tensor_parallel_size > 1 is not supported for {family.__name__} checkpoints yet")
        # tensor parallel: ranks 1..N-1 start loading their shares while this one loads its own
        self.parallel = TensorParallelWorkers(args, model_dir, self.device) if args.tensor_parallel_size > 1 else None
        try:
            self._build(args, model_dir)
        except BaseException:
            if self.parallel is not None:
                self.parallel.close()
            raise

    def _build(self, args: EngineArgs, model_dir) -> None:
        self.model = registry.load_model(model_dir, args.dtype, self.device, tokenizer=args.tokenizer,
                                         tp=self.parallel.tp if self.parallel else SINGLE,
                                         **family_load_args(args, model_dir))
        self.cfg = cfg = self.model.cfg
        if self.model.supports_decoder_trim:  # swa_bounded_replay covers the decoder side too, unless told
            self.model.set_decoder_trim(args.swa_bounded_replay if args.swa_decoder_trim is None
                                        else args.swa_decoder_trim)
        self.tokenizer = Tokenizer(args.tokenizer or model_dir)
        self.max_model_len = args.max_model_len or min(cfg.max_position_embeddings, 8192)
        self.block_size = args.block_size or max(16, cfg.compress_block_lcm)
        if self.block_size % cfg.compress_block_lcm:
            raise ValueError(f"block_size {self.block_size} must be a multiple of {cfg.compress_block_lcm} "
                             "(every compress ratio)")
        self.limits = RequestLimits(self.max_model_len, cfg.vocab_size, args.max_logprobs, args.max_stop_strings,
                                    args.max_stop_string_len)
        self.cache = self._make_cache()
        self.scheduler = Scheduler(self.cache, cfg.sliding_window, args.max_num_seqs,
                                   args.max_num_batched_tokens, prefix_cache=self._make_prefix_cache(),
                                   long_prefill_token_threshold=args.long_prefill_token_threshold,
                                   chunk_budget=ChunkBudgetConfig.of(args))
        # CUDA graphs need the fused kernels (the references sync with the host)
        graphs = (self.device.type == "cuda" and not args.enforce_eager and args.cudagraph_mode != "NONE"
                  and kernels.backend() != "ref" and self.model.supports_cuda_graphs)
        # tensor parallel: mixed steps run eagerly (the workers mirror decode graphs and eager steps)
        # Engram rows gathered on the host (engram_tables: mmap): only decode graphs are fed them before
        # replay (runner.prefetch_host_inputs); `host` tables are read by the device inside any graph
        mixed = (mixed_sizes(args.max_num_batched_tokens) if args.cudagraph_mode == "FULL" and not self.parallel
                 and self.model.supports_mixed_graphs and not self.model.needs_host_tokens else [])
        runner_kwargs = dict(max_model_len=self.max_model_len, cuda_graphs=graphs, max_num_seqs=args.max_num_seqs,
                             mixed_sizes=mixed)
        if self.parallel is not None:
            self.parallel.start(self.cache, runner_kwargs)  # the workers build theirs (and capture) alongside
        self.runner = ModelRunner(self.model, self.cache, **runner_kwargs)
        if self.runner.mixed is not None:  # prefill chunks cut to these sizes where padding costs more
            self.scheduler.graph_sizes = list(self.runner.mixed.sizes)
        if self.parallel is not None:
            self.parallel.wait_ready()
            self.runner.workers = self.parallel
        spec = SpeculativeConfig.parse(args.speculative_config)
        self.spec = SpecDecoder(self, spec) if spec else None
        self.requests: dict[str, RequestState] = {}
        self.pending: InFlight | None = None  # the step in flight (async scheduling)
        if args.async_scheduling and self.model.needs_host_tokens:
            raise InvalidEngineArgs("async_scheduling needs the Engram tables read by the device (engram_tables: device "
                                    "or host): memory-mapped (mmap), their rows are gathered from the step's tokens "
                                    "on the host")
        self.async_scheduling = (self.device.type == "cuda" and not self.model.needs_host_tokens
                                 if args.async_scheduling is None else args.async_scheduling)
        # with CUDA graphs, an eager step's launch is the slow part: read back first (see _step);
        # without them (CPU) every step is eager and overlapping changes nothing but is exercised
        self.flush_before_eager = bool(self.runner.graphs)
        self.generator = torch.Generator(device=self.device).manual_seed(args.seed)  # the sampler draws on the device
        self.counters = {"prompt_tokens": 0, "generation_tokens": 0, "requests_finished": 0}
        # tokens per step: [steps, tokens] of the steps with 2^(k-1) < tokens <= 2^k, at index k (vLLM's
        # iteration_tokens_total buckets are powers of two, so the front rebuilds that histogram exactly)
        self.iteration_tokens = [[0, 0] for _ in range(ITERATION_TOKEN_BUCKETS)]
        self.grammars: GrammarCompiler | None = None  # structured outputs: made on first use
        self._grammars_lock = threading.Lock()
        if self.device.type == "cuda":
            self.warmup()

    def warmup(self) -> None:
        """Run two requests through every path (prefill chunks, mixed decode, each attention
        kind, a full token budget so the prefill-sized MoE tiles autotune) so Triton's JIT
        compiles before the first real request, not during its TTFT."""
        n = min(max(2 * self.block_size + 3, self.args.max_num_batched_tokens), self.max_model_len - 4)
        sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        for i, length in enumerate((n, max(1, n // 3))):
            self.add_request(GenerationRequest(f"__warmup-{i}__", prompt_token_ids=[5 + j % 100 for j in range(length)],
                                               sampling=sp))
        while self.has_unfinished():
            self.step()
        self._warm_indexer_widths()
        self._warm_draw()
        self.counters = dict.fromkeys(self.counters, 0)
        self.iteration_tokens = [[0, 0] for _ in range(ITERATION_TOKEN_BUCKETS)]
        if self.spec is not None:
            self.spec.reset_counters()
        if self.scheduler.prefix_cache is not None:
            self.scheduler.prefix_cache.counters = dict.fromkeys(self.scheduler.prefix_cache.counters, 0)

    def _warm_indexer_widths(self) -> None:
        """The indexer's top-k kernel is compiled per power-of-two count of compressed entries
        (the sequence length / ratio): compile every width up to max_model_len now, not in the
        middle of a request's step (about half a second each)."""
        layer = next((i for i, kind in enumerate(self.cfg.layer_types) if kind == CSA), None)
        if layer is None:
            return
        cfg, c, dev = self.cfg, self.cache, self.device
        ratio, pool = cfg.compress_ratios[layer], c.index_keys[layer]
        table = torch.full((1, -(-self.max_model_len // self.block_size) + 1), c.scratch_full, device=dev)
        iq = torch.zeros(1, cfg.index_n_heads, cfg.index_head_dim, dtype=pool.dtype, device=dev)
        iw, seq = torch.zeros(1, cfg.index_n_heads, device=dev), torch.zeros(1, dtype=torch.long, device=dev)
        n = 16
        while n <= self.max_model_len // ratio:
            pos = torch.full((1,), n * ratio - 1, device=dev)
            kernels.indexer_topk(iq, iw, pool, table, pos, seq, ratio, cfg.index_topk, n * ratio - 1)
            n *= 2

    def _warm_draw(self) -> None:
        """The sampled draw's kernels (K.sample_draw) are compiled per set of options a batch uses (temperature alone,
        with top-k, top-p, min_p: eight): compile them all now, not in the first sampled request's step (the warm-up
        requests are greedy)."""
        dev = self.device
        logits = torch.zeros(1, self.cfg.vocab_size, device=dev)
        rows, u = torch.zeros(1, dtype=torch.long, device=dev), torch.full((1,), 0.5, dtype=torch.float64, device=dev)
        one = torch.ones(1, device=dev)
        for top_k in (None, torch.full((1,), 2, dtype=torch.long, device=dev)):
            for top_p in (None, one / 2):
                for min_p in (None, one / 10):
                    kernels.sample_draw(logits, rows, one, top_k, top_p, min_p, u)

    # --- construction -------------------------------------------------------------------------

    def _make_prefix_cache(self) -> PrefixCache | None:
        if not self.args.enable_prefix_caching:
            return None
        return PrefixCache(self.cache, self.cfg.sliding_window, self.args.swa_bounded_replay)

    def _kv_budget(self) -> int:
        a = self.args
        if a.kv_cache_memory_bytes:
            return int(a.kv_cache_memory_bytes)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used_elsewhere = total - free
            return max(0, int(total * a.gpu_memory_utilization) - used_elsewhere - (2 << 30))  # 2 GiB activations
        return CPU_KV_BYTES

    def _make_cache(self) -> KVCache:
        """Window pool: enough for every running sequence's window plus one full prefill chunk;
        the rest of the budget to the compressed-KV pool."""
        a, cfg, bs = self.args, self.cfg, self.block_size
        dtype = self.model.embed.weight.dtype
        pc = a.enable_prefix_caching
        snapshots = pc and not a.swa_bounded_replay
        cache_class = self.model.cache_class
        window_bytes, full_bytes = cache_class.bytes_per_block(cfg, bs, dtype, boundary_state=pc,
                                                               window_snapshots=snapshots)
        per_seq = math.ceil((cfg.sliding_window - 1) / bs) + 2
        num_window = a.max_num_seqs * per_seq + math.ceil(a.max_num_batched_tokens / bs) + 1
        if a.num_gpu_blocks_override:
            num_full = a.num_gpu_blocks_override
        else:
            num_full = (self._kv_budget() - num_window * window_bytes) // max(full_bytes, 1)
        min_full = math.ceil(self.max_model_len / bs)
        if num_full < min_full:
            raise ValueError(f"KV cache too small: {num_full} blocks of {bs} tokens cannot hold one "
                             f"sequence of max_model_len={self.max_model_len}; raise the memory budget "
                             "or lower max_model_len")
        return cache_class(cfg, bs, num_window, int(num_full), a.max_num_seqs, dtype, self.device,
                           boundary_state=pc, window_snapshots=snapshots)

    # --- requests -----------------------------------------------------------------------------

    def validate(self, req: GenerationRequest) -> list[int]:
        """All request checks in one place (the fronts only parse); returns the prompt token ids.
        The sampling values first: they cost nothing, the prompt's tokenization may."""
        p = req.sampling
        if req.request_id in self.requests:
            raise InvalidRequest(f"request id {req.request_id!r} is already in flight")
        checks = [
            *sampling_checks(p, self.limits),
            (p.prompt_logprobs is None or self.model.supports_prompt_logprobs,
             f"prompt_logprobs are not supported for {type(self.model).__name__} yet"),
        ]
        for ok, msg in checks:
            if not ok:
                raise InvalidRequest(msg)
        ids = req.prompt_token_ids
        if ids is None:
            if not req.prompt:
                raise InvalidRequest("the prompt is empty")
            ids = self.tokenizer.encode(req.prompt)
        k = p.truncate_prompt_tokens
        if ids and k is not None and (k == -1 or k >= 1):  # vLLM's: the last k tokens (a bad k is refused below)
            ids = ids[-(self.max_model_len - 1 if k == -1 else k):]
        if not ids:
            raise InvalidRequest("the prompt is empty")
        refusal = self.model.refuses_token(ids)
        if refusal:  # e.g. V4.1's image tokens (no vision tower here)
            raise InvalidRequest(refusal)
        if any(not 0 <= t < self.cfg.vocab_size for t in ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {self.cfg.vocab_size})")
        if len(ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                                 "(prompt plus at least one generated token)")
        return ids

    def grammar_compiler(self) -> GrammarCompiler:
        """Structured outputs' compiler (thread-safe: AsyncLLM compiles from the caller's thread)."""
        with self._grammars_lock:
            if self.grammars is None:
                stop = set(self.cfg.eos_token_ids) | {self.tokenizer.eos_token_id} - {None}
                self.grammars = GrammarCompiler(self.tokenizer, self.cfg.vocab_size, sorted(stop))
            return self.grammars

    def add_request(self, req: GenerationRequest) -> Sequence:
        ids = self.validate(req)
        if req.sampling.bad_words and req.sampling.bad_words_token_ids is None:
            req.sampling.bad_words_token_ids = bad_words_token_ids(self.tokenizer, req.sampling.bad_words)
        grammar = self.grammar_compiler().matcher(req.sampling.structured_outputs) \
            if req.sampling.structured_outputs is not None else None  # InvalidRequest for a bad spec
        seq = Sequence(req.request_id, list(ids), req.sampling, grammar=grammar)
        eos = set() if req.sampling.ignore_eos else set(self.cfg.eos_token_ids)
        if self.tokenizer.eos_token_id is not None and not req.sampling.ignore_eos:
            eos.add(self.tokenizer.eos_token_id)
        text = OutputText(self.tokenizer, req.sampling) if self.detokenize and req.sampling.detokenize else None
        self.requests[req.request_id] = st = RequestState(seq, text, eos)
        if req.sampling.prompt_logprobs is not None:  # the first prompt token has none (vLLM's None)
            st.prompt_logprobs, st.prompt_ranks = [None], [None]
        self.scheduler.add(seq)
        self.counters["prompt_tokens"] += len(ids)
        return seq

    def abort(self, request_id: str) -> RequestOutput | None:
        st = self.requests.pop(request_id, None)
        if st is None:
            return None
        if st.seq.has_pending_token:  # its step in flight is ignored when read back
            st.seq.output_token_ids.pop()
        self.scheduler.finish(st.seq, "abort")
        self.counters["requests_finished"] += 1
        return self._output(st, finished=True)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self.pending is not None

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    # --- the step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedule, run and sample one step; returns the outputs that became known. With async
        scheduling a greedy step stays in flight: its tokens are read back (and returned) by the
        next call, after that call has launched its own step."""
        try:
            return self._step()
        except BaseException:
            self._drop_pending()  # callers recover by recomputing (AsyncLLM preempts and reruns)
            raise

    def _step(self) -> list[RequestOutput]:
        scheduled = self.scheduler.schedule()
        if not scheduled:
            return self.flush()
        tokens = sum(n for _, n in scheduled)
        bucket = self.iteration_tokens[min((tokens - 1).bit_length(), ITERATION_TOKEN_BUCKETS - 1)]
        bucket[0] += 1
        bucket[1] += tokens
        if self.spec is not None and self.spec.wants(scheduled):
            return self.spec.step(scheduled)  # synchronous, but for DSpark's held-back plain steps (stay in flight)
        outputs = []
        if self.pending is not None and self.flush_before_eager and not self.runner.replays_graph(scheduled):
            # an eager step (prefill chunks) costs the host more than a GPU step: launching it first
            # would only hold back the tokens in flight, so read them back now
            outputs = self.flush()
            scheduled = [(s, n) for s, n in scheduled if s.request_id in self.requests]  # some just ended
            if not scheduled:
                return outputs
        prev = self.pending
        prompt_rows = prompt_logprob_rows(scheduled, self.device)
        logits = self.runner.run(scheduled, pending=(prev.token_ids, prev.rows) if prev else None,
                                 prompt_rows=prompt_rows)
        if prompt_rows is not None:
            self._score_prompts(prompt_rows)
        # logits rows: the sequences whose chunk reaches their last token, in batch order
        sampled = [(seq, n) for seq, n in scheduled if seq.num_computed_tokens + n == seq.num_tokens]
        samplers = [seq for seq, _ in sampled]
        # a mixed step stays in flight too: its prefill chunks that end short of their prompt sample nothing
        if sampled and self._can_keep_in_flight(sampled):  # decide on the device, do not wait for the copy back
            picked = self.pick_on_device(samplers, logits)
            return outputs + self.leave_in_flight(scheduled, InFlight.launch(sampled, picked))
        outputs += self.flush()  # the previous step's tokens, while this step runs
        self.scheduler.advance([(s, n) for s, n in scheduled if s.status == Status.RUNNING])
        return outputs + self._sample(samplers, logits)

    def leave_in_flight(self, scheduled: list[tuple[Sequence, int]], flight: InFlight) -> list[RequestOutput]:
        """The hand-off of a step whose greedy tokens stay on the device (`flight`, launched by the
        caller): read back the step before while this one runs, advance the scheduler, and hold a
        pending token in each sampling sequence until the next flush replaces it."""
        outputs = self.flush()
        self.scheduler.advance([(s, n) for s, n in scheduled if s.status == Status.RUNNING])
        for seq, _ in flight.scheduled:
            if seq.request_id in self.requests:
                seq.output_token_ids.append(PENDING_TOKEN)
        self.pending = flight
        return outputs

    def pick_on_device(self, seqs: list[Sequence], logits: torch.Tensor) -> torch.Tensor:
        """The tokens of a step kept in flight, picked on the device as `_draw` would (engine/sampler.pick_on_device):
        greedy or drawn, a seeded row at its own step (the previous step's pending token counted)."""
        rows = [SamplingRow(s.sampling, len(s.output_token_ids), s.prompt_token_ids, s.output_token_ids, self._bans(s))
                for s in seqs]
        return pick_on_device(logits, rows, self.generator, self._pending_tokens(seqs))

    def _pending_tokens(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """[rows] on the device: each sequence's token of the step in flight (-1: none), for the penalties to count;
        None where no row has a penalty or a pending token."""
        flight = self.pending
        if flight is None or not any(s.sampling.penalized and s.has_pending_token for s in seqs):
            return None
        at = device_rows([flight.rows.get(id(s), -1) if s.has_pending_token else -1 for s in seqs], torch.long,
                         flight.token_ids.device)
        return torch.where(at >= 0, flight.token_ids[at.clamp(min=0)], -1)

    def _bans(self, seq: Sequence) -> list[int]:
        """The ids this sequence may not draw now: its stop ids (EOS and stop_token_ids) until min_tokens."""
        if len(seq.output_token_ids) >= seq.sampling.min_tokens:
            return []
        return sorted(self.requests[seq.request_id].eos_ids | set(seq.sampling.stop_token_ids))

    def _can_keep_in_flight(self, sampled: list[tuple[Sequence, int]]) -> bool:
        """Every sampling row picks its token without the previous step's token on the host (greedy, or drawn after
        temperature, min_p, top-k, top-p; allowed ids, logit_bias, bans and penalties applied; logprobs and ranks come
        back with it: engine/sampler.pick_on_device; bad words of several tokens and grammars need that token), and no
        sequence can end by length on this token (so the next step may already include it)."""
        if not self.async_scheduling:
            return False
        for seq, _ in sampled:
            p = seq.sampling
            if (p.processes_with_history or len(seq.output_token_ids) + 1 >= p.max_tokens
                    or seq.num_tokens + 1 >= self.max_model_len):
                return False
        return True

    def flush(self) -> list[RequestOutput]:
        """Read back the step in flight (if any) and process its tokens."""
        flight, self.pending = self.pending, None
        if flight is None:
            return []
        host = flight.read()
        outputs = []
        for row, ((seq, _), token, logprob, total) in enumerate(zip(flight.scheduled, *host[:3])):
            if seq.request_id not in self.requests or not seq.has_pending_token:  # finished or aborted meanwhile
                continue
            if not math.isfinite(total):  # no token to pick (sampler.NO_TOKEN): this request alone fails
                seq.output_token_ids.pop()
                outputs.append(self._fail_request(seq, NO_TOKEN))
                continue
            m = seq.sampling.logprobs
            top, rank = (None, None) if m is None else in_flight_logprobs(host, row, int(token), logprob, int(m))
            outputs += self._process(seq, int(token), logprob, top, rank)
        return outputs

    def _drop_pending(self) -> None:
        """Forget the step in flight: its placeholders go, its tokens will be recomputed."""
        flight, self.pending = self.pending, None
        for seq, _ in flight.scheduled if flight else []:
            if seq.has_pending_token:
                seq.output_token_ids.pop()

    def _sample(self, samplers: list[Sequence], logits: torch.Tensor) -> list[RequestOutput]:
        outputs = []
        for seq, smp in zip(*self._draw(samplers, logits)):
            outputs += self._emit(seq, smp)
        return outputs

    def _draw(self, samplers: list[Sequence], logits: torch.Tensor) -> tuple[list[Sequence], list[Sample]]:
        """Sample the next token of each live sequence (one logits row each); nothing is appended yet."""
        live = [i for i, seq in enumerate(samplers) if seq.request_id in self.requests]  # not finished meanwhile
        if len(live) < len(samplers):
            samplers, logits = [samplers[i] for i in live], logits[live]
        self.last_logits = dict(zip((s.request_id for s in samplers), logits))  # measurements read these
        rows = [SamplingRow(s.sampling, len(s.output_token_ids), s.prompt_token_ids, s.output_token_ids, self._bans(s),
                            s.grammar) for s in samplers]
        return samplers, sample(logits, rows, self.generator, self.grammars)

    def _emit(self, seq: Sequence, smp: Sample) -> list[RequestOutput]:
        if smp.error is not None:  # this request alone: the others' tokens stand
            return [self._fail_request(seq, smp.error)]
        return self._process(seq, smp.token_id, smp.logprob, smp.top_logprobs, smp.rank)

    def _score_prompts(self, rows) -> None:
        """prompt_logprobs of this step's prefill rows (engine/prompt_logprobs.py), kept until the
        request's first output."""
        k = max(seq.sampling.prompt_logprobs for seq, _, _ in rows.spans)
        scores = score(self.model.compute_logits, rows.hidden, rows.targets, k, self.cfg.vocab_size)
        r = 0
        for seq, first, count in rows.spans:
            st = self.requests.get(seq.request_id)
            if st is not None and st.prompt_logprobs is not None:
                m = seq.sampling.prompt_logprobs
                for i in range(r, r + count):
                    entry = {seq.prompt_token_ids[first + i - r]: scores.logprobs[i]}  # the prompt token first
                    for t, v in zip(scores.top_ids[i][:m], scores.top_logprobs[i][:m]):
                        entry.setdefault(t, v)
                    st.prompt_logprobs.append(entry)
                    st.prompt_ranks.append(scores.ranks[i])
                seq.prompt_logprobs_next = first + count
            r += count

    def _fail_request(self, seq: Sequence, error: str) -> RequestOutput:
        st = self.requests.pop(seq.request_id)
        self.scheduler.finish(seq, "error")
        self.counters["requests_finished"] += 1
        out = self._output(st, finished=True)
        out.error = error
        return out

    def _process(self, seq: Sequence, token: int, logprob: float, top: dict | None,
                 rank: int | None = None) -> list[RequestOutput]:
        st = self.requests[seq.request_id]
        reason = self._append(st, token, logprob, top, rank)
        if reason:
            self.scheduler.finish(seq, reason)
            del self.requests[seq.request_id]
            self.counters["requests_finished"] += 1
        out = self._output(st, finished=reason is not None)
        return [out] if out.finished or out.text or out.token_ids else []

    def _append(self, st: RequestState, token: int, logprob: float, top: dict | None,
                rank: int | None = None) -> str | None:
        seq, p = st.seq, st.seq.sampling
        if seq.has_pending_token:  # the step that sampled it ran ahead of its read-back
            seq.output_token_ids[-1] = token
        else:
            seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        st.new_token_ids.append(token)
        if top is not None:
            st.new_logprobs.append(top)
            st.new_ranks.append(rank)
        self.counters["generation_tokens"] += 1
        n_out = len(seq.output_token_ids)
        if token in st.eos_ids or token in p.stop_token_ids:
            return "stop"
        if st.text is not None and st.text.push(token, n_out):
            return "stop"
        if n_out >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _output(self, st: RequestState, finished: bool) -> RequestOutput:
        seq = st.seq
        text = st.text.take(finished) if st.text is not None else ""
        out = RequestOutput(
            request_id=seq.request_id, text=text, token_ids=st.new_token_ids,
            num_prompt_tokens=seq.num_prompt_tokens, num_output_tokens=len(seq.output_token_ids),
            num_cached_tokens=seq.num_cached_tokens, cumulative_logprob=seq.cumulative_logprob,
            logprobs=st.new_logprobs if seq.sampling.logprobs is not None else None,
            logprob_ranks=st.new_ranks if seq.sampling.logprobs is not None else None,
            finished=finished, finish_reason=seq.finish_reason if finished else None,
            scheduled_time=seq.scheduled_time,
        )
        if st.prompt_logprobs is not None and seq.prompt_logprobs_next >= seq.num_prompt_tokens:
            out.prompt_logprobs, out.prompt_logprob_ranks = st.prompt_logprobs, st.prompt_ranks
            st.prompt_logprobs = st.prompt_ranks = None  # sent once, with the first output
        st.new_token_ids, st.new_logprobs, st.new_ranks = [], [], []
        return out

    # --- introspection ------------------------------------------------------------------------

    def stats(self) -> dict:
        c = self.cache
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_usage": {
                "window": 1 - c.window_pool.num_free / c.window_pool.num_blocks,
                "compressed": 1 - c.full_pool.num_free / c.full_pool.num_blocks,
            },
            "kv_blocks": {
                "window": {"total": c.window_pool.num_blocks, "free": c.window_pool.num_free},
                "compressed": {"total": c.full_pool.num_blocks, "free": c.full_pool.num_free},
            },
            "num_preemptions": self.scheduler.num_preemptions,
            "iteration_tokens": [list(b) for b in self.iteration_tokens],
            **self.counters,
            **(self.scheduler.prefix_cache.stats() if self.scheduler.prefix_cache else {}),
            **(self.spec.stats() if self.spec else {}),
        }
