"""The DeepSeek-V4.1 text network over packed tokens of several sequences (CSA2 + Engram).

What differs from V4 (engine/models/deepseek_v4/model.py), following transformers' DeepseekV41 source:
- per-layer compress ratios: 0 window only, r > 1 causal encoder pooling (softmax gate in fp32,
  no overlap, no position bias), 1 decoder latents (one per token, no gate);
- CSA2 sharing: only `kv_source_layer_ids` own a compressor; they write compressed KV and the
  indexer keys (from the pre-RoPE latent) into the cache; later layers read the nearest source;
- index sources score with their own queries, the others reuse the last top-k; the candidate
  source keeps its best blocks and every later index source picks inside them (two-level top-k);
- Engram n-gram tables gated into each hc stream before a block;
- single-pass mHC: a site collapses with the previous site's `pre`; no hc head;
- noaux top-k routing on every layer (no hash layers), routing weight before w2;
- the reference's QAT fake-quantisers: window KV FP8, compressed KV FP4 (e4m3 scales per 16),
  indexer keys and queries FP4 (ue8m0 per 32).

Decoder trim (`decoder_trim`): layers after the last KV source own only window
KV, so a prefill chunk runs them on each sequence's last `sliding_window` rows only; those rows'
window attention there reads nothing below the kept rows (an approximation, measured).

Parameter names are DeepSeek's official checkpoint names (routed experts stacked per layer as
`ffn.experts_w{1,2,3}`); transformers' names are translated at load (engine/models/deepseek_v41/names.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import kernels as K
from engine.compress_plan import compress_plan
from engine.forward_batch import ForwardBatch
from engine.models.deepseek_v4.model import (
    Linear,
    _expert_weights,
    _linear,
    add_attention_projections,
    cast_params,
    expected_names,
    load_weight,
)
from engine.models.deepseek_v4.model import Norm as V4Norm
from engine.models.deepseek_v41 import ops
from engine.models.deepseek_v41.cache import V41KVCache
from engine.models.deepseek_v41.config import V41Config
from engine.models.deepseek_v41.decode_plan import DecodePlan, decode_plan
from engine.models.deepseek_v41.engram import EngramHasher
from engine.models.deepseek_v41.engram_tables import HostTables
from engine.models.deepseek_v41.mapped_tables import MappedTables
from engine.models.deepseek_v41.mixed_rows import PLAN_KEY, V41MixedRows
from engine.models.deepseek_v41.shards import table_span
from engine.models.deepseek_v41.split_graphs import DecoderSplitGraphs
from engine.models.family import ModelFamily
from engine.models.stacked_linears import linear_group
from engine.parallel import SINGLE, TensorParallel

SCORE_BUDGET = 1 << 27  # fp32 elements of one indexer score chunk [rows, heads, entries]


class Norm(V4Norm):
    """V4's weight holder; V4.1's order: statistics cast back before the weight."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.v41_rms_norm(x, self.weight, self.eps)


@dataclass
class Rows:
    """The packed rows a layer runs on: all of the batch, or (decoder trim) each sequence's last
    window. Per-row tensors plus the per-forward CSA2 state (top-k, candidates)."""

    positions: torch.Tensor
    token_seq: torch.Tensor
    window_slots: torch.Tensor
    replay_start_t: torch.Tensor
    ropes: dict
    engram: dict  # layer -> gathered table rows [T, cols, engram_head_dim]
    topk: torch.Tensor | None = None  # [T, index_topk] entries of the current KV group, -1 none
    candidates: torch.Tensor | None = None  # [T, entries] bool: the candidate source's blocks
    plans: dict = field(default_factory=dict)  # ratio -> DecodePlan (decode steps: built on the device)


class Compressor(nn.Module):
    """A KV source's compressor: `ratio` tokens -> one latent (ratio 1: a per-token projection)."""

    def __init__(self, cfg: V41Config, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = _linear(cfg.head_dim, cfg.hidden_size)
        if ratio > 1:
            self.wgate = _linear(cfg.head_dim, cfg.hidden_size)
        self.norm = Norm(cfg.head_dim, cfg.rms_norm_eps)
        self.pool: torch.Tensor | None = None  # ratio > 1: wkv over wgate in fp32, one GEMM (hold_fp32_weights)

    def latents(self, x: torch.Tensor, fb: ForwardBatch, cache: V41KVCache, layer: int, plans: dict):
        """Closed groups of this step (positions >= compress_from): (latents before RoPE, plan), or
        None. Open groups wait in the cache's fp32 state. plans: a decode step's (Rows.plans)."""
        m = self.ratio
        state = cache.comp_state[layer]
        plan = plans[m] if m in plans else compress_plan(fb, m, cache.block_size,
                                                         state.pend_kv.shape[0] if state else cache.max_num_seqs + 1)
        if m == 1:
            if not plan.num_blocks:
                return None
            return self.norm(self.wkv(x[plan.src])), plan
        kv, gate = F.linear(x.float(), self.pool).split(self.wkv.weight.shape[0], -1)  # pooling and its gate in fp32
        out = None
        if plan.num_blocks:
            d = kv.shape[-1]
            kv_b = torch.cat([kv.to(state.pend_kv.dtype), state.pend_kv.view(-1, d)])[plan.src].view(-1, m, d)
            gate_b = torch.cat([gate.to(state.pend_gate.dtype), state.pend_gate.view(-1, d)])[plan.src].view(-1, m, d)
            latent = (kv_b * gate_b.softmax(dim=1, dtype=torch.float32)).sum(dim=1)
            out = self.norm(latent.to(x.dtype)), plan
        state.pend_kv.view(-1, kv.shape[-1]).index_copy_(0, plan.pend_dst, kv[plan.pend_row].to(state.pend_kv.dtype))
        state.pend_gate.view(-1, kv.shape[-1]).index_copy_(0, plan.pend_dst,
                                                          gate[plan.pend_row].to(state.pend_gate.dtype))
        return out


def hold_fp32_weights(model: nn.Module) -> None:
    """After loading: the weights the forward multiplies in fp32 held in fp32, so no step converts
    them (bf16 -> fp32 is exact: the same products). The router's gate; each pooling compressor's
    wkv over wgate as one [2 * head_dim, hidden] matrix, the two parameters views into it."""
    for module in model.modules():
        if isinstance(module, Gate):
            module.weight.data = module.weight.data.float()
        elif isinstance(module, Compressor) and module.ratio > 1:
            d = module.wkv.weight.shape[0]
            module.pool = torch.cat([module.wkv.weight.data, module.wgate.weight.data]).float()
            module.wkv.weight.data, module.wgate.weight.data = module.pool[:d], module.pool[d:]


class Indexer(nn.Module):
    """An index source: own queries over the group's shared keys; the KV source also makes them."""

    def __init__(self, cfg: V41Config, layer: int):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = _linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        self.weights_proj = _linear(cfg.index_n_heads, cfg.hidden_size)
        self.owns_k = layer in cfg.kv_source_layer_ids
        if self.owns_k:
            self.wk = _linear(cfg.index_head_dim, cfg.head_dim)
            self.k_norm = Norm(cfg.index_head_dim, cfg.rms_norm_eps)
        self.is_candidate_source = layer == cfg.candidate_source_layer_id
        self.uses_candidates = 0 <= cfg.candidate_source_layer_id < layer

    def keys(self, latent: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        k = K.v41_rope(self.k_norm(self.wk(latent)), cos, sin)
        return K.v41_fake_quant_fp4(k, 32)

    def select(self, x: torch.Tensor, q_res: torch.Tensor, rows: Rows, fb: ForwardBatch, keys_pool: torch.Tensor,
               ratio: int) -> torch.Tensor:
        """Top-k entries per query row [T, index_topk], best first, -1 where fewer are visible. Every
        row of the batch at once (no loop over sequences, no host read): the scores span the entries
        of the batch's longest sequence (`fb.max_pos`; a graph's batch: `max_model_len`), each row's
        beyond its own visible ones masked."""
        T = x.shape[0]
        cos, sin = rows.ropes["compress"]
        # FP4 values times a power of two: exact in x's dtype, so the fused scores' dot reads them as they are
        iq = K.v41_fake_quant_fp4(K.v41_rope(self.wq_b(q_res).view(T, self.n_heads, self.head_dim), cos, sin), 32)
        iw = self.weights_proj(x).float() * self.n_heads**-0.5
        n = (fb.max_pos + 1) // ratio
        if self.is_candidate_source:
            rows.candidates = torch.zeros((T, n), dtype=torch.bool, device=x.device)
        if fb.is_decode and not (self.is_candidate_source or self.uses_candidates):  # scores and top-k in one
            return K.indexer_topk(iq, iw, keys_pool, fb.full_tables, rows.positions, rows.token_seq, ratio, self.topk,
                                  max_pos=fb.max_pos, one_per_seq=True)
        out = torch.full((T, self.topk), -1, dtype=torch.long, device=x.device)
        if n == 0:
            return out
        visible = (rows.positions + 1) // ratio
        # the torch reference gathers [rows, entries, head_dim] keys: row chunks bound its memory
        chunk = max(1, SCORE_BUDGET // ((self.n_heads + self.head_dim) * n))
        for lo in range(0, T, chunk):
            r = slice(lo, lo + chunk)
            sc = K.indexer_scores_paged(iq[r], iw[r], keys_pool, fb.full_tables, rows.positions[r], rows.token_seq[r],
                                        ratio, n)
            out[r, : min(self.topk, n)] = self._top(sc, visible[r], rows, r)
        return out

    def _top(self, sc, visible, rows: Rows, r) -> torch.Tensor:
        """Score rows sc [rows, n] (-inf where not visible) of query rows `r` -> the two-level top-k
        [rows, min(topk, n)] best first, -1 where fewer are visible."""
        n = sc.shape[1]
        if self.is_candidate_source:
            rows.candidates[r, :n] = ops.candidate_blocks(sc, visible, self.cfg.candidate_topk_blocks,
                                                          self.cfg.candidate_block_size)
        elif self.uses_candidates and rows.candidates is not None:
            cand = rows.candidates[r, :n]
            if cand.shape[1] < n:  # the candidate source saw fewer entries: nothing beyond
                cand = F.pad(cand, (0, n - cand.shape[1]), value=False)
            sc = sc.masked_fill(~cand, float("-inf"))
        values, indices = ops.topk_first(sc, min(self.topk, n))
        return torch.where(values > float("-inf"), indices, -1)


class Attention(nn.Module):
    """Under tensor parallelism its rank's heads and their share of wo_a / wo_b; the compressor and
    the indexer whole (engine/models/deepseek_v41/shards.py says why)."""

    def __init__(self, cfg: V41Config, layer: int, fp8: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.layer, self.tp = cfg, layer, tp
        self.ratio = cfg.compress_ratios[layer]
        self.source = cfg.kv_source_of(layer)
        self.num_heads, self.o_groups = tp.local_heads(cfg), tp.local_groups(cfg)
        add_attention_projections(self, cfg, self.num_heads, self.o_groups, fp8, norm=Norm,
                                  block=cfg.weight_block_size[0])
        if layer in cfg.kv_source_layer_ids:
            self.compressor = Compressor(cfg, self.ratio)
        if layer in cfg.index_source_layer_ids:
            self.indexer = Indexer(cfg, layer)

    def _absorb(self, x: torch.Tensor, fb: ForwardBatch, cache: V41KVCache, inv_freq: torch.Tensor,
                plans: dict) -> None:
        """KV source: closed groups -> indexer keys (pre-RoPE latent) and compressed KV."""
        got = self.compressor.latents(x, fb, cache, self.layer, plans)
        if got is None:
            return
        latent, plan = got
        cos, sin = K.rope_cos_sin(plan.blk_entry * self.ratio, inv_freq, latent.dtype)
        pool, kpool = cache.compressed[self.layer], cache.index_keys[self.layer]
        per_block = pool.shape[1]
        if isinstance(plan, DecodePlan):
            dst = plan.dst
        else:
            dst = fb.full_tables[plan.blk_seq, plan.blk_entry // per_block] * per_block + plan.blk_entry % per_block
        kpool.view(-1, kpool.shape[-1]).index_copy_(0, dst, self.indexer.keys(latent, cos, sin).to(kpool.dtype))
        entries = K.v41_fake_quant_fp4(K.v41_rope(latent, cos, sin), 16, e4m3_scales=True)
        pool.view(-1, pool.shape[-1]).index_copy_(0, dst, entries.to(pool.dtype))

    def forward(self, x: torch.Tensor, rows: Rows, fb: ForwardBatch, cache: V41KVCache,
                inv_freq: torch.Tensor, full_rows: bool) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        H, hd = self.num_heads, cfg.head_dim
        cos, sin = rows.ropes["compress" if self.ratio else "main"]
        q_a, kv = linear_group((self.wq_a, self.wkv), x)  # one launch where the FP8 pair is stacked
        q_res = self.q_norm(q_a)
        q = K.v41_rope(self.wq_b(q_res).view(T, H, hd), cos, sin)
        kv = K.v41_fake_quant_fp8(K.v41_rope(self.kv_norm(kv), cos, sin), 32)
        cache.write_window(self.layer, rows.window_slots, kv)
        comp_pool, ratio = None, 0
        if self.ratio:
            if hasattr(self, "compressor"):
                assert full_rows, "a KV source runs on every row"
                self._absorb(x, fb, cache, inv_freq, rows.plans)
            ratio = cfg.compress_ratios[self.source]
            if hasattr(self, "indexer"):
                rows.topk = self.indexer.select(x, q_res, rows, fb, cache.index_keys[self.source], ratio)
            comp_pool = cache.compressed[self.source]
        out = K.paged_attention(q, rows.positions, rows.token_seq, cache.window[self.layer], fb.window_tables,
                                rows.replay_start_t, cfg.sliding_window, comp_pool, fb.full_tables, ratio or 1,
                                rows.topk if self.ratio else None, self.attn_sink, hd**-0.5)
        out = K.v41_rope(out, cos, sin, inverse=True)  # K = V carried RoPE: take the query's off
        o = K.grouped_linear(out.view(T, self.o_groups, -1), self.wo_a.weight, self.o_groups, self.wo_a.scale)
        return self.tp.all_reduce(self.wo_b(o))  # tensor parallel: each rank's heads' partial sum


class Gate(nn.Module):
    def __init__(self, cfg: V41Config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
        self.bias_vl = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))  # image tokens: unused


class SharedExpert(nn.Module):
    def __init__(self, cfg: V41Config, fp8: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        inter, b = tp.local_shared_width(cfg), cfg.weight_block_size[0]
        self.w1, self.w3 = Linear(inter, cfg.hidden_size, fp8, b), Linear(inter, cfg.hidden_size, fp8, b)
        self.w2 = Linear(cfg.hidden_size, inter, fp8, b)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = linear_group((self.w1, self.w3), x)
        return self.w2(K.v41_clamped_swiglu(gate, up, self.limit, x.dtype))


class MoE(nn.Module):
    """Under tensor parallelism its rank's experts (expert parallel) or every expert's intermediate
    slice, and a slice of the shared expert: one all-reduce joins them."""

    def __init__(self, cfg: V41Config, quantized: bool = False, fp8: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        E, inter, D = tp.local_experts(cfg), tp.local_expert_width(cfg), cfg.hidden_size
        self.gate = Gate(cfg)
        fmt = cfg.expert_dtype if quantized and cfg.expert_dtype == "fp4" else "bf16"  # MXFP4 as stored
        _expert_weights(self, "w1", E, inter, D, fmt)
        _expert_weights(self, "w3", E, inter, D, fmt)
        _expert_weights(self, "w2", E, D, inter, fmt)
        self.shared_experts = SharedExpert(cfg, fp8, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        weights, indices = K.v41_router(x, self.gate.weight, self.gate.bias, cfg.num_experts_per_tok,
                                        cfg.routed_scaling_factor, cfg.scoring_func, cfg.gate_temp,
                                        cfg.norm_topk_prob, self.tp.expert_span(cfg))  # -1: another rank's expert
        # the grouped kernels (weight after w2: equal up to rounding); the CPU's torch loop reads the experts
        # hit on the host, so a forced fused backend (kernels.set_backend("fused")) takes the kernels too
        if x.is_cuda or self.experts_w1_scale is not None or K.backend() == "fused":
            scales = None if self.experts_w1_scale is None else (self.experts_w1_scale, self.experts_w3_scale,
                                                                 self.experts_w2_scale)
            routed = K.moe_experts(x, self.experts_w1, self.experts_w3, self.experts_w2, weights.to(x.dtype),
                                   indices, cfg.swiglu_limit, scales)
        else:
            routed = ops.routed_experts(x, self.experts_w1, self.experts_w3, self.experts_w2, weights, indices,
                                        cfg.swiglu_limit)
        # tensor parallel: one join per layer (each rank's sum rounded to x's dtype first, as V4's)
        return self.tp.all_reduce(K.v41_moe_sum(routed, self.shared_experts(x), x.dtype))


class Engram(nn.Module):
    """An n-gram lookup written into each hc stream, gated by its match with the stream. rows: its
    table's rows on the device; 0: the table lives in host memory (engine/models/deepseek_v41/engram_tables.py)."""

    def __init__(self, cfg: V41Config, rows: int, fp8: bool = False):
        super().__init__()
        cols = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        self.eps = cfg.rms_norm_eps
        self.embed = nn.Embedding(rows, cfg.engram_head_dim) if rows else None
        self.wkv = Linear(cfg.hidden_size * (cfg.hc_mult + 1), cols * cfg.engram_head_dim, fp8, cfg.weight_block_size[0])
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))

    def forward(self, h: torch.Tensor, table_rows: torch.Tensor) -> torch.Tensor:
        kv = self.wkv(table_rows.flatten(-2).to(h.dtype))
        return K.v41_engram_gate(h, kv, self.q_weight, self.k_weight, self.eps)


class Block(nn.Module):
    def __init__(self, cfg: V41Config, layer: int, quantized: bool = False, fp8: bool = False,
                 tp: TensorParallel = SINGLE, engram_on_device: bool = True):
        super().__init__()
        self.cfg, self.layer = cfg, layer
        mix, hc, D = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult, cfg.hidden_size
        self.attn_norm = Norm(D, cfg.rms_norm_eps)
        self.ffn_norm = Norm(D, cfg.rms_norm_eps)
        for kind in ("attn", "ffn"):
            setattr(self, f"hc_{kind}_fn", nn.Parameter(torch.zeros(mix, hc * D, dtype=torch.float32)))
            setattr(self, f"hc_{kind}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{kind}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.attn = Attention(cfg, layer, fp8, tp)
        self.ffn = MoE(cfg, quantized, fp8, tp)
        if layer in cfg.engram_layer_ids:
            lo, hi = table_span(cfg, layer, tp)  # tensor parallel: this rank's rows of the table
            self.engram = Engram(cfg, hi - lo if engram_on_device else 0, fp8)

    def _site(self, kind: str, h: torch.Tensor, pre: torch.Tensor):
        """This site's (pre, post, comb) and h collapsed with the previous site's pre (one fused op)."""
        c = self.cfg
        return K.v41_hc_site_collapse(h, pre, getattr(self, f"hc_{kind}_fn"), getattr(self, f"hc_{kind}_base"),
                                      getattr(self, f"hc_{kind}_scale"), c.hc_eps, c.rms_norm_eps,
                                      c.hc_sinkhorn_iters)

    def forward(self, h, pre, rows: Rows, fb: ForwardBatch, cache: V41KVCache, inv_freq, full_rows: bool):
        if hasattr(self, "engram"):
            h = self.engram(h, rows.engram[self.layer])
        attn_pre, post, comb, x = self._site("attn", h, pre)
        x = self.attn(self.attn_norm(x), rows, fb, cache, inv_freq, full_rows)
        h = K.v41_hc_expand(x, h, post, comb)
        ffn_pre, post, comb, x = self._site("ffn", h, attn_pre)
        h = K.v41_hc_expand(self.ffn(self.ffn_norm(x)), h, post, comb)
        return h, ffn_pre


class HostRows(dict):
    """layer -> its gathered Engram rows from host memory, fetched (waited for, all-reduced under tensor
    parallelism) when the layer first reads them, so the gathers overlap the layers before."""

    def __init__(self, fetch: Callable[[int], torch.Tensor], tp: TensorParallel, layers: tuple[int, ...]):
        super().__init__()
        self.fetch, self.tp, self.layers = fetch, tp, layers

    def __missing__(self, layer: int) -> torch.Tensor:
        rows = self.tp.all_reduce(self.fetch(layer))  # each row from one rank, zeros from the others
        self[layer] = rows
        return rows

    def items(self):
        return [(layer, self[layer]) for layer in self.layers]


def graph_capturing(fb: ForwardBatch) -> bool:
    """The step is being captured into a CUDA graph (the CPU tests' emulation of a graph stands in here)."""
    return fb.input_ids.is_cuda and torch.cuda.is_current_stream_capturing()


def engram_hasher(cfg: V41Config) -> EngramHasher:
    return EngramHasher(cfg.engram_layer_ids, cfg.engram_max_ngram_size, cfg.engram_n_heads, cfg.engram_vocab_size,
                        cfg.engram_compressed_vocab_size, cfg.engram_pad_id)


def _decoder_keep(fb: ForwardBatch, window: int) -> tuple[torch.Tensor, list[int]] | None:
    """Rows of each sequence's last `window` tokens (decoder trim), and each sequence's first
    kept position (0 for a sequence that drops nothing: its window reads the cache as without
    trimming); None when nothing would be dropped."""
    keep, first, row = [], [], 0
    for n, start in zip(fb.seq_lens, fb.starts):
        k = min(n, window)
        keep.extend(range(row + n - k, row + n))
        first.append(start + n - k if n > window else 0)
        row += n
    if len(keep) == row:
        return None
    return torch.tensor(keep, dtype=torch.long, device=fb.input_ids.device), first


class DeepseekV41(ModelFamily):
    # decode steps replay CUDA graphs: their compressor plan is built on the device (DecodePlan)
    # and the Engram look-back rides in the runner's static batch. Mixed steps run on padded static
    # batches (engine/graphs/mixed.py + engine/models/deepseek_v41/mixed_rows.py): padded plans, the look-back, the
    # indexer over fixed-width score rows; with decoder trim as two graphs, the second over the kept
    # rows (engine/models/deepseek_v41/split_graphs.py; tests/engine/models/deepseek_v41/test_mixed_graphs.py: eagerly and through the
    # CPU emulation of a graph).
    cache_class = V41KVCache
    supports_decoder_trim = True
    supports_tensor_parallel = True  # engine/models/deepseek_v41/shards.py
    supports_host_engram = True  # engine/models/deepseek_v41/mapped_tables.py (host), engram_tables.py (mmap)

    def __init__(self, cfg: V41Config, quantized: bool = False, decoder_trim: bool = True, fp8_linears: bool = False,
                 tp: TensorParallel = SINGLE, engram_on_device: bool = True):
        """quantized: routed experts as stored (MXFP4); fp8_linears: the FP8 linears as stored (e4m3 +
        float32 scales per cfg.weight_block_size tile), else in the model dtype. tp: this rank's share.
        engram_on_device False: the loader sets `host_tables` (engine/models/deepseek_v41/engram_tables.py)."""
        super().__init__()
        self.cfg, self.quantized, self.decoder_trim, self.tp = cfg, quantized, decoder_trim, tp
        D = cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, i, quantized, fp8_linears, tp, engram_on_device)
                                    for i in range(cfg.num_layers))
        # Engram tables in host memory: read by the device (host) or gathered by host threads (mmap)
        self.host_tables: MappedTables | HostTables | None = None
        self.host_hasher: EngramHasher | None = None  # mmap: the ids hashed on the host
        self.graph_rows: dict[int, dict[int, torch.Tensor]] = {}  # decode graph size -> its static Engram rows
        self.norm = Norm(D, cfg.rms_norm_eps)
        self.head = _linear(cfg.vocab_size, D) if tp.rank == 0 else None  # rank 0 samples
        self.mtp_weights: dict[str, torch.Tensor] = {}  # DSpark draft layers: kept, not run
        self.engram_hasher = engram_hasher(cfg) if cfg.engram_layer_ids else None
        self.register_buffer("main_inv_freq", cfg.main_rope.inv_freq(), persistent=False)
        self.register_buffer("compress_inv_freq", cfg.compress_rope.inv_freq(), persistent=False)

    def refuses_token(self, ids: list[int]) -> str | None:
        """Image input is not served (the vision tower is out of scope): a clear refusal."""
        if self.cfg.image_token_id is not None and self.cfg.image_token_id in ids:
            return (f"image input is not supported: the prompt holds the image token {self.cfg.image_token_id}; "
                    "this engine serves DeepSeek-V4.1's text model only")
        return None

    @property
    def compressed_ratios(self) -> list[int]:
        """The compress ratios of the KV sources (only they have a compressor)."""
        return sorted({self.cfg.compress_ratios[s] for s in self.cfg.kv_source_layer_ids if self.cfg.compress_ratios[s]})

    def set_decoder_trim(self, on: bool) -> None:
        self.decoder_trim = on

    def mixed_rows(self, cache: V41KVCache) -> V41MixedRows:
        """This model's fields of a padded mixed step (engine/graphs/mixed.py)."""
        return V41MixedRows(self, cache)

    def mixed_split(self, cache: V41KVCache, sizes: list[int], max_num_seqs: int, width: int,
                    max_model_len: int) -> DecoderSplitGraphs | None:
        """A padded mixed step as two graphs where decoder trim has layers to trim (as set now: a
        graph bakes the setting in; engine/models/deepseek_v41/split_graphs.py); None: one graph, every row throughout."""
        if not (self.decoder_trim and self.trim_cut < len(self.layers)):
            return None
        return DecoderSplitGraphs(self, cache, sizes, max_num_seqs, width, max_model_len)

    @property
    def lookback_tokens(self) -> int:
        """How many tokens before each row the runner passes (`ForwardBatch.lookback_ids`)."""
        return self.cfg.engram_max_ngram_size - 1 if self.engram_hasher is not None else 0

    def _engram_rows(self, fb: ForwardBatch, layers: tuple[int, ...] | None = None) -> dict:
        """layer -> its table rows for every row of fb (layers: only these Engram layers)."""
        if self.engram_hasher is None or layers == ():
            return {}
        if fb.lookback_ids is None:
            raise RuntimeError("the Engram layers need ForwardBatch.lookback_ids (the runner builds them)")
        if self.needs_host_tokens:
            return self._host_engram_rows(fb, layers)
        wanted = [(k, layer) for k, layer in enumerate(self.cfg.engram_layer_ids) if layers is None or layer in layers]
        if self.host_tables is not None:  # in host RAM, gathered by the device (engine/models/deepseek_v41/mapped_tables.py)
            fetch = self.host_tables.start(lambda: self.engram_hasher(fb.input_ids, fb.lookback_ids), wanted,
                                           (fb.input_ids.shape[0], self.engram_hasher.offsets.shape[-1]))
            return HostRows(fetch, self.tp, tuple(layer for _, layer in wanted))
        ids = self.engram_hasher(fb.input_ids, fb.lookback_ids)  # [T, L, cols]
        if not self.tp.active:
            return {layer: self.layers[layer].engram.embed(ids[:, k]) for k, layer in wanted}
        # tensor parallel: each rank gathers the rows it holds, zeros for the others'; one sum over
        # the ranks gives every row exactly (it comes from one rank, plus zeros)
        parts = []
        for k, layer in wanted:
            lo, hi = table_span(self.cfg, layer, self.tp)
            local = ids[:, k] - lo
            mine = (local >= 0) & (local < hi - lo)
            rows = self.layers[layer].engram.embed(torch.where(mine, local, 0))
            parts.append(rows * mine.unsqueeze(-1).to(rows.dtype))
        summed = self.tp.all_reduce(torch.stack(parts))
        return {layer: summed[i] for i, (_, layer) in enumerate(wanted)}

    # --- Engram tables memory-mapped, gathered on the host (engine/models/deepseek_v41/engram_tables.py) ---

    @property
    def needs_host_tokens(self) -> bool:
        return self.host_tables is not None and self.host_tables.needs_host_tokens

    def _host_engram_rows(self, fb: ForwardBatch, layers: tuple[int, ...] | None) -> dict:
        """Eager steps: hash on the host, start every layer's gather, hand each layer its rows when it
        asks (HostRows). A decode graph being captured reads the static buffers prefetch_host_inputs
        made and fills (before the capture, then before each replay)."""
        wanted = tuple(i for i in self.cfg.engram_layer_ids if layers is None or i in layers)
        if graph_capturing(fb):
            bufs = self.graph_rows.get(fb.input_ids.shape[0])
            if bufs is None:
                raise RuntimeError(f"a decode graph of {fb.input_ids.shape[0]} rows is captured before its Engram "
                                   "rows were prefetched (the runner prefetches the padding batch before capture)")
            return {i: self.tp.all_reduce(bufs[i].clone()) for i in wanted}
        ids = self.host_hasher(fb.input_ids.cpu(), fb.lookback_ids.cpu())  # the step's tokens: known on the host
        self.host_tables.gather(ids)
        return HostRows(self.host_tables.rows, self.tp, wanted)

    def prefetch_host_inputs(self, size: int, input_ids: np.ndarray, lookback: np.ndarray) -> None:
        """Before a decode graph of `size` rows is captured and before each of its replays: its rows'
        Engram rows into the graph's static buffers. They are made here, outside the capture: made
        inside it, their zero fill is captured too, and every replay zeroes what was prefetched."""
        bufs = self.graph_rows.get(size)
        if bufs is None:
            shape = (size, self.host_hasher.offsets.shape[-1], self.cfg.engram_head_dim)
            bufs = self.graph_rows[size] = {i: torch.empty(shape, dtype=self.host_tables.dtype,
                                                           device=self.host_tables.device)
                                            for i in self.cfg.engram_layer_ids}
        ids = self.host_hasher(torch.from_numpy(input_ids), torch.from_numpy(lookback))
        self.host_tables.gather(ids, out=bufs)
        self.host_tables.wait_all()

    @property
    def trim_cut(self) -> int:
        """The first layer decoder trim trims (after the last KV source: those own only window KV)."""
        return self.cfg.last_kv_source + 1

    def rows_of(self, fb: ForwardBatch, dtype: torch.dtype, engram_layers: tuple[int, ...] | None = None) -> Rows:
        """The Rows of every row of fb (ropes, Engram table rows of `engram_layers`, default all)."""
        ropes = {"main": K.rope_cos_sin(fb.positions, self.main_inv_freq, dtype),
                 "compress": K.rope_cos_sin(fb.positions, self.compress_inv_freq, dtype)}
        return Rows(fb.positions, fb.token_seq, fb.window_slots, fb.replay_start_t, ropes,
                    self._engram_rows(fb, engram_layers))

    def embed_rows(self, fb: ForwardBatch, cache: V41KVCache, engram_layers: tuple[int, ...] | None = None):
        """-> (h, pre, rows) before the first block: the hc copies of the embedding, the first site's pre.
        engram_layers: the Engram layers the caller runs (default all; each must read its rows: a
        gather from host RAM runs on a side stream its layer joins)."""
        x = self.embed(self.tp.broadcast(fb.input_ids))  # async scheduling's tokens live on rank 0
        rows = self.rows_of(fb, x.dtype, engram_layers)
        if fb.is_decode:
            rows.plans = {m: decode_plan(fb, m, cache) for m in self.compressed_ratios}
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # mHC: hc copies of the residual
        pre = torch.zeros(h.shape[:2], dtype=torch.float32, device=h.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0
        return h, pre, rows

    def run_layers(self, h, pre, rows: Rows, fb: ForwardBatch, cache: V41KVCache, lo: int, hi: int | None,
                   full_rows: bool = True):
        """Blocks lo..hi - 1 (hi None: to the last)."""
        for block in self.layers[lo:hi]:
            h, pre = block(h, pre, rows, fb, cache, self.compress_inv_freq, full_rows)
        return h, pre

    def logits_of(self, h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The final site's collapse, norm and LM head: logits in fp32."""
        return F.linear(self.norm(ops.hc_collapse(h, pre)), self.head.weight).float()

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, cache: V41KVCache) -> torch.Tensor | None:
        """One step over packed tokens; returns logits [len(fb.logits_rows), vocab] in fp32 (None
        on tensor-parallel ranks > 0: rank 0 samples)."""
        h, pre, rows = self.embed_rows(fb, cache)
        cut = self.trim_cut
        h, pre = self.run_layers(h, pre, rows, fb, cache, 0, cut)
        logits_rows, full_rows = fb.logits_rows, True
        # decoder trim; a padded mixed step (PLAN_KEY) trims in its tail graph (engine/models/deepseek_v41/split_graphs.py)
        if cut < len(self.layers) and self.decoder_trim and not fb.is_decode and PLAN_KEY not in fb.plans:
            got = _decoder_keep(fb, self.cfg.sliding_window)
            if got is not None and bool(torch.isin(fb.logits_rows, got[0]).all()):
                h, pre, rows, logits_rows = self._trim(h, pre, rows, fb, *got)
                full_rows = False
        h, pre = self.run_layers(h, pre, rows, fb, cache, cut, None, full_rows)
        return None if self.head is None else self.logits_of(h[logits_rows], pre[logits_rows])

    @staticmethod
    def _trim(h, pre, rows: Rows, fb: ForwardBatch, keep: torch.Tensor, first: list[int]):
        """Keep only `keep` rows from here on; their window attention reads no position below the
        first kept one of their sequence."""
        start = torch.maximum(fb.replay_start_t, torch.tensor(first, device=keep.device))
        new_index = torch.full((h.shape[0],), -1, dtype=torch.long, device=keep.device)
        new_index[keep] = torch.arange(len(keep), device=keep.device)
        trimmed = replace(
            rows, positions=rows.positions[keep], token_seq=rows.token_seq[keep], window_slots=rows.window_slots[keep],
            replay_start_t=start, ropes={k: (c[keep], s[keep]) for k, (c, s) in rows.ropes.items()},
            engram={k: v[keep] for k, v in rows.engram.items()},
            topk=None if rows.topk is None else rows.topk[keep],
            candidates=None if rows.candidates is None else rows.candidates[keep])
        return h[keep], pre[keep], trimmed, new_index[fb.logits_rows]

    # --- loading: official names and stacked experts as V4's (engine/models/deepseek_v4/model.py) -------------

    # what the released checkpoint stores in fp32 (transformers keeps exactly these); norms follow the model dtype
    _FP32 = ("hc_", "attn_sink", "gate.bias")

    def expected_names(self) -> set[str]:
        return expected_names(self, self.tp.local_experts(self.cfg))

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith("mtp."):  # DSpark draft layers: kept, not run
            self.mtp_weights[name] = tensor
            return
        load_weight(self, name, tensor)

    def cast(self, dtype: torch.dtype) -> DeepseekV41:
        return cast_params(self, dtype, self._FP32)
