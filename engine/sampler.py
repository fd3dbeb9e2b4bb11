"""Next-token sampling for a whole batch, on the device, with vLLM's meanings and order.

One step: the raw logits give the logprobs (vLLM's default `raw_logprobs`); then
allowed_token_ids, banned ids (bad words, min_tokens' stop ids), logit_bias, the penalties
(presence, frequency, repetition); greedy rows take the argmax; the others divide by their
temperature, apply min_p, top-k, top-p (kernels.reference.sample_filter) and draw by inverting
their cumulative distribution at one uniform a row (K.sample_draw: on CUDA a kernel that finds
top-k's and top-p's cuts without sorting the vocabulary). Every option is a tensor built for the
batch; the only per-request Python work is building those index lists.

A seeded request draws token i at a uniform hashed from (seed, i), so its tokens do not depend on
batch mates, step boundaries, preemption or the device; the others draw theirs from the engine's
generator, on the device.

Values validation lets through stay finite in float32 (temperatures below SAMPLING_EPS are
greedy; overflow is clamped). A row with no token left to pick (every token masked, or NaN
logits) fails that request only: its Sample carries `error`, the batch goes on.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

import kernels as K
from engine.request import SamplingParams
from engine.sequence import PENDING_TOKEN
from kernels.reference import finite_logits, sample_filter

MAX_LOGIT_BIAS = 100.0  # vLLM clamps logit_bias to [-100, 100], as OpenAI documents
_TINY = torch.finfo(torch.float32).tiny
NO_TOKEN = ("no token can be sampled: every token is masked (allowed_token_ids, bad_words, min_tokens, a grammar) or "
            "the logits are NaN")


@dataclass
class Sample:
    token_id: int
    logprob: float  # the sampled token's raw logprob
    top_logprobs: dict[int, float] | None
    rank: int | None = None  # with logprobs: the sampled token's rank among all tokens (1: most likely)
    error: str | None = None  # this request's sampling failed; the others are unaffected


@dataclass
class SamplingRow:
    """What the sampler needs of one request at this step."""

    params: SamplingParams
    step: int  # tokens it has generated so far
    prompt_ids: list[int]
    output_ids: list[int]
    banned: list[int]  # ids forbidden at this step (min_tokens' stop ids)
    grammar: object | None = None  # structured outputs: the request's xgrammar matcher (advanced by the pick)


def bad_word_bans(bad_words_token_ids: list[list[int]], output_ids: list[int]) -> list[int]:
    """vLLM's bad words: a word's last token is banned when the tokens before it were just generated."""
    bans = []
    for word in bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(output_ids) and (not prefix or output_ids[-len(prefix):] == prefix):
            bans.append(word[-1])
    return bans


def seeded_uniform(seed: int, step: int) -> float:
    """A seeded request's uniform for its token `step`, in [0, 1): splitmix64 of (seed, step), its 53 high bits."""
    z = (int(seed) * 1_000_003 + step + 0x9E3779B97F4A7C15) % 2**64
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9 % 2**64
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB % 2**64
    return ((z ^ (z >> 31)) >> 11) / 2**53


def _pad(lists: list[list[int]], pad: int, device) -> torch.Tensor:
    width = max(map(len, lists), default=0)
    return device_rows([x + [pad] * (width - len(x)) for x in lists], torch.long, device)


def _counts(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    """[rows, width] token ids padded with `vocab` -> [rows, vocab] occurrence counts."""
    counts = torch.zeros(tokens.shape[0], vocab + 1, dtype=torch.float32, device=tokens.device)
    counts.scatter_add_(1, tokens, torch.ones_like(tokens, dtype=torch.float32))
    return counts[:, :vocab]


def process_logits(logits: torch.Tensor, rows: list[SamplingRow], pending: torch.Tensor | None = None) -> torch.Tensor:
    """In place on fp32 logits [n, V]: allowed ids, bans, logit_bias, penalties (vLLM's order). pending: [n] each
    row's token of the step still in flight, on the device (-1: none), which its output ids hold as PENDING_TOKEN:
    the penalties count it there."""
    n, V = logits.shape
    dev = logits.device
    long = torch.long  # index lists go through pinned memory (device_rows): a step kept in flight processes them too
    allowed = [(i, r.params.allowed_token_ids) for i, r in enumerate(rows) if r.params.allowed_token_ids is not None]
    if allowed:
        keep = torch.zeros(len(allowed), V, dtype=torch.bool, device=dev)
        ri = [j for j, (_, ids) in enumerate(allowed) for _ in ids]
        ci = [t for _, ids in allowed for t in ids]
        keep[device_rows(ri, long, dev), device_rows(ci, long, dev)] = True
        idx = device_rows([i for i, _ in allowed], long, dev)
        logits[idx] = logits[idx].masked_fill(~keep, float("-inf"))
    bans = [(i, t) for i, r in enumerate(rows) for t in
            r.banned + (bad_word_bans(r.params.bad_words_token_ids, r.output_ids) if r.params.bad_words_token_ids else [])]
    if bans:
        ri, ci = zip(*bans)
        logits[device_rows(list(ri), long, dev), device_rows(list(ci), long, dev)] = float("-inf")
    bias = [(i, int(t), max(-MAX_LOGIT_BIAS, min(MAX_LOGIT_BIAS, float(b))))
            for i, r in enumerate(rows) if r.params.logit_bias for t, b in r.params.logit_bias.items()]
    if bias:
        ri, ci, vals = zip(*bias)
        logits.index_put_((device_rows(list(ri), long, dev), device_rows(list(ci), long, dev)),
                          device_rows(list(vals), logits.dtype, dev), accumulate=True)
    pen = [i for i, r in enumerate(rows) if r.params.penalized]
    if pen:
        idx = device_rows(pen, long, dev)
        ps = [rows[i].params for i in pen]
        out = _pad([[t for t in rows[i].output_ids if t != PENDING_TOKEN] for i in pen], V, dev)
        if pending is not None:  # a column more: the step in flight's token, or the pad
            out = torch.cat([out, torch.where(pending[idx] >= 0, pending[idx], V)[:, None]], 1)
        out_counts = _counts(out, V)
        seen = (_counts(_pad([rows[i].prompt_ids for i in pen], V, dev), V) > 0) | (out_counts > 0)
        rep = device_rows([max(p.repetition_penalty, _TINY) for p in ps], torch.float32, dev)[:, None]
        x = logits[idx]
        rep = torch.where(seen, rep, 1.0)
        x = torch.where(x > 0, x / rep, x * rep)
        x -= device_rows([p.frequency_penalty for p in ps], torch.float32, dev)[:, None] * out_counts
        x -= device_rows([p.presence_penalty for p in ps], torch.float32, dev)[:, None] * (out_counts > 0)
        logits[idx] = x
    return finite_logits(logits)


def filter_logits(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor | None,
                  top_p: torch.Tensor | None, min_p: torch.Tensor | None) -> torch.Tensor:
    """Temperature, then min_p, then top-k and top-p as vLLM applies them (kernels.reference.sample_filter); rows
    [n, V] fp32, the dropped tokens -inf (the others shifted: the top one is 0).
    top_k: [n] in 1..V (V: off); top_p: [n] in (0, 1] (1: off); min_p: [n] (0: off)."""
    d, keep = sample_filter(logits, temperature, top_k, top_p, min_p)
    return d.masked_fill(~keep, float("-inf"))


def device_rows(values: list, dtype: torch.dtype, dev: torch.device) -> torch.Tensor:
    """A small per-row tensor on `dev` that does not wait for the stream: on CUDA a copy from pageable memory waits
    for all the stream holds (the step's forward), which would end a step kept in flight; from pinned memory it
    is queued behind it."""
    t = torch.tensor(values, dtype=dtype)
    return t.pin_memory().to(dev, non_blocking=True) if dev.type == "cuda" else t.to(dev)


def _filters(params: list[SamplingParams], V: int, dev: torch.device):
    """Each row's (temperature, top_k, top_p, min_p) as per-row tensors; an option no row uses: None."""
    temp = device_rows([p.temperature for p in params], torch.float32, dev)
    top_k = device_rows([p.top_k if 0 < p.top_k < V else V for p in params], torch.long, dev) \
        if any(0 < p.top_k < V for p in params) else None
    top_p = device_rows([p.top_p for p in params], torch.float32, dev) if any(p.top_p < 1 for p in params) else None
    min_p = device_rows([p.min_p for p in params], torch.float32, dev) if any(p.min_p > 0 for p in params) else None
    return temp, top_k, top_p, min_p


def sampling_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """The distribution a random row draws from: each row's temperature, min_p, top-k, top-p."""
    return filter_logits(logits, *_filters(params, logits.shape[-1], logits.device)).softmax(-1)


def _uniforms(params: list[SamplingParams], steps: list[int], generator: torch.Generator | None,
              dev: torch.device) -> torch.Tensor:
    """[w] float64 in [0, 1): a seeded row's from (seed, step), the others' from the generator on the device."""
    seeded = [j for j, p in enumerate(params) if p.seed is not None]
    own = device_rows([seeded_uniform(params[j].seed, steps[j]) for j in seeded], torch.float64, dev) if seeded else None
    if len(seeded) == len(params):
        return own
    u = torch.rand(len(params), dtype=torch.float64, device=dev, generator=generator)
    return u.index_copy(0, device_rows(seeded, torch.long, dev), own) if seeded else u


def _draw_random(x: torch.Tensor, tokens: torch.Tensor, valid: torch.Tensor, rand: list[int],
                 params: list[SamplingParams], steps: list[int], generator: torch.Generator | None):
    """(tokens, valid) with rows `rand` (their params, their steps: tokens generated so far) drawn from the processed
    logits x (K.sample_draw)."""
    dev = x.device
    idx = device_rows(rand, torch.long, dev)
    drawn = K.sample_draw(x, idx, *_filters(params, x.shape[-1], dev), _uniforms(params, steps, generator, dev))
    return tokens.index_copy(0, idx, drawn.clamp(min=0)), valid.index_copy(0, idx, valid[idx] & (drawn >= 0))


def top_logprobs(raw: torch.Tensor, tokens: torch.Tensor, lse: torch.Tensor, rows: torch.Tensor | None, k: int):
    """Rows `rows` (an index tensor on the device; None: every row, no copy) of the raw logits [n, V] (fp32): (vLLM's
    rank of each picked token: how many tokens are at least as likely; the k most likely tokens' logprobs [w, k] and
    ids [w, k], None for k 0), on the device."""
    lp, tokens, lse = (raw, tokens, lse) if rows is None else (raw[rows], tokens[rows], lse[rows])
    ranks = (lp >= lp.gather(1, tokens[:, None])).sum(-1)
    if k == 0:
        return ranks, None, None
    vals, ids = torch.topk(lp, k)
    return ranks, vals - lse[:, None], ids


def logprob_entry(token: int, logprob: float, ids: list, vals: list, m: int) -> dict[int, float]:
    """A step's logprobs entry for a request that asked for m: the m most likely tokens, then the picked one's."""
    top = {int(t): float(v) for t, v in zip(ids[:m], vals[:m])} if m else {}
    top[token] = logprob
    return top


def _processed_pick(raw: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None,
                    pending: torch.Tensor | None = None):
    """(tokens, raw log-sum-exp, valid) on the device for rows that are not all plain greedy: process_logits where a
    row has something to process (pending: as process_logits takes it), then the argmax or the draw. A row with
    nothing to process is read raw: process_logits would only map NaN to -inf and +inf to the largest float, which
    the argmax's validity and the draw do themselves; a row's lse is NaN where one of its logits is."""
    if any(r.params.processes_logits or r.banned for r in rows):
        lse = raw.logsumexp(-1)
        x = process_logits(raw.clone(), rows, pending)
        valid = torch.isfinite(x).any(-1) & ~torch.isnan(lse)
        tokens = x.argmax(-1)
    else:  # the raw argmax and log-sum-exp in one pass (NaN in a row: its lse NaN, so not valid)
        picked = K.greedy_pick(raw)
        x, tokens, lse = raw, picked[0].long(), picked[2].float()
        valid = lse > float("-inf")
    rand = [i for i, r in enumerate(rows) if not r.params.greedy]
    if rand:
        tokens, valid = _draw_random(x, tokens, valid, rand, [rows[i].params for i in rand],
                                     [rows[i].step for i in rand], generator)
    return tokens, lse, valid


def pick_on_device(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None,
                   pending: torch.Tensor | None = None) -> torch.Tensor:
    """[3 (+ 1 + 2k), n] float64 on the device, nothing read back: each row's token as `sample` picks it for a row
    whose processing needs no token value on the host (allowed ids, bans, logit_bias, the penalties, counting the
    token still in flight from `pending` as process_logits does; no bad words or grammar:
    SamplingParams.processes_with_history), greedy or drawn after temperature, min_p, top-k, top-p, its logprob
    under the raw logits and the raw log-sum-exp, NaN where `sample` would fail the row (NO_TOKEN); where a row asks
    for logprobs, then every row's rank, k top ids and k top logprobs (k: the most any row asks for;
    `in_flight_logprobs` reads them). What async scheduling keeps in flight (engine/in_flight.py)."""
    params = [r.params for r in rows]
    if any(p.processes_with_history for p in params):
        raise ValueError("a row processed by the values of its tokens so far is picked by `sample`, not on the device")
    raw = logits.float()
    if all(map(_plain, rows)):
        picked = K.greedy_pick(raw)  # an invalid row's log-sum-exp is not finite already
        tokens, lse = picked[0].long(), picked[2].float()
    else:
        tokens, lse, valid = _processed_pick(raw, rows, generator, pending)
        chosen = raw.gather(1, tokens[:, None])[:, 0] - lse
        picked = torch.stack([tokens.double(), chosen.double(), torch.where(valid, lse, float("nan")).double()])
    if all(p.logprobs is None for p in params):
        return picked
    k = min(raw.shape[1], max(int(p.logprobs) for p in params if p.logprobs is not None))
    ranks, vals, ids = top_logprobs(raw, tokens, lse, None, k)
    extra = [ranks[None].double()] + ([ids.T.double(), vals.T.double()] if k else [])
    return torch.cat([picked, *extra])


def in_flight_logprobs(host: list[list[float]], row: int, token: int, logprob: float,
                       m: int) -> tuple[dict[int, float], int]:
    """A row's (logprobs entry, rank) from pick_on_device's rows read back, for a request that asked for m."""
    k = (len(host) - 4) // 2
    ids = [host[4 + c][row] for c in range(k)]
    vals = [host[4 + k + c][row] for c in range(k)]
    return logprob_entry(token, logprob, ids, vals, m), int(host[3][row])


def _accept(matcher, token: int) -> bool:
    try:  # never raises out of the batch (a retry row by row would advance the other matchers twice)
        return bool(matcher.accept_token(token))
    except Exception:  # noqa: BLE001
        return False


def _plain(row: SamplingRow) -> bool:
    return row.params.greedy and not row.params.processes_logits and not row.banned


def sample(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None = None,
           grammars=None) -> list[Sample]:
    """logits [n, V] (any float dtype, any device), one SamplingRow per row; `grammars` (an
    engine.structured_output.GrammarCompiler) applies the rows' grammar bitmasks. A failure confined
    to some rows fails those rows only: the batch is retried row by row and the rows that still
    raise come back with `error` set."""
    try:
        return _sample(logits, rows, generator, grammars)
    except Exception as e:  # noqa: BLE001 - isolate the row that fails
        if len(rows) == 1:
            return [Sample(0, 0.0, None, error=f"{type(e).__name__}: {e}")]
        return [sample(logits[i:i + 1], [row], generator, grammars)[0] for i, row in enumerate(rows)]


def _sample(logits: torch.Tensor, rows: list[SamplingRow], generator: torch.Generator | None,
            grammars) -> list[Sample]:
    n, V = logits.shape
    dev = logits.device
    raw = logits.float()
    constrained = [(i, r.grammar) for i, r in enumerate(rows) if r.grammar is not None]
    if constrained:  # the grammar's bitmask first, as vLLM: logprobs then see only what it allows
        raw = raw.clone() if raw is logits else raw
        grammars.apply_bitmask(raw, constrained)
    if all(map(_plain, rows)):
        # plain greedy: argmax, its logprob and the log-sum-exp in one fused pass
        picked = K.greedy_pick(raw)
        tokens_dev, lse = picked[0].long(), picked[2].float()
        valid = torch.isfinite(lse)
    else:
        tokens_dev, lse, valid = _processed_pick(raw, rows, generator)
    chosen = raw.gather(1, tokens_dev[:, None])[:, 0] - lse
    want = [i for i, r in enumerate(rows) if r.params.logprobs is not None]
    want_row = {i: j for j, i in enumerate(want)}
    ranks = torch.zeros(n, device=dev)
    top_vals = top_ids = None
    if want:
        k = min(V, max(int(rows[i].params.logprobs) for i in want))
        widx = device_rows(want, torch.long, dev)
        ranks_w, vals, ids = top_logprobs(raw, tokens_dev, lse, widx, k)
        ranks[widx] = ranks_w.float()
        if k > 0:
            top_vals, top_ids = vals.cpu().tolist(), ids.cpu().tolist()
    tokens, chosen, valid, ranks = torch.stack([tokens_dev.double(), chosen.double(), valid.double(),
                                               ranks.double()]).tolist()  # the step's host sync
    out = []
    for i, row in enumerate(rows):
        if not valid[i]:
            out.append(Sample(0, 0.0, None, error=NO_TOKEN))
            continue
        top, rank = None, None
        if row.params.logprobs is not None:
            j = want_row[i]
            top = logprob_entry(int(tokens[i]), chosen[i], top_ids[j] if top_ids else [],
                                top_vals[j] if top_vals else [], int(row.params.logprobs))
            rank = int(ranks[i])
        if row.grammar is not None and not _accept(row.grammar, int(tokens[i])):
            out.append(Sample(0, 0.0, None, error=f"the grammar refused token {int(tokens[i])}"))
            continue
        out.append(Sample(int(tokens[i]), chosen[i], top, rank))
    return out
