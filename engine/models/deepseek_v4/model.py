"""The DeepSeek-V4 network over packed tokens of several sequences.

Module and parameter names are DeepSeek's official checkpoint names (`layers.N.attn.wq_a`,
`hc_attn_fn`, ...), except routed experts, stacked per layer as `ffn.experts_w{1,2,3}`.
`quantized=True` keeps weights as the checkpoint stores them (kernels/formats.py): the FP8
dense linears (attention projections, shared experts) as e4m3 + float32 block scales, the
routed experts as FP8 (Base) or MXFP4 (V4-Flash) + scales; the kernels dequantize in registers.
The draft tensors (`mtp.*`: the preview's MTP layer or 0731's DSpark stages) are kept as loaded in
`mtp_weights` for speculative decoding.
Every hot op goes through `kernels` (torch references today, fused kernels behind the same
calls). State lives in the paged `KVCache`; the model reads and writes it through the
`ForwardBatch` the runner built, one step at a time (prefill chunks and decode alike).
"""

from __future__ import annotations

import torch
from torch import nn

import kernels as K
from engine.cache import CompressorState, KVCache
from engine.compress_plan import compress_plan
from engine.forward_batch import ForwardBatch
from engine.models.config import CSA, SLIDING
from engine.models.deepseek_v4.config import ModelConfig
from engine.models.family import ModelFamily
from engine.models.stacked_linears import ATTENTION_X_READERS, linear_group, members
from engine.models.weights import WeightsError
from engine.parallel import SINGLE, TensorParallel
from kernels.formats import FP8_BLOCK, MX_BLOCK, fp8_block_scale_shape


def _linear(out_f: int, in_f: int) -> nn.Linear:
    return nn.Linear(in_f, out_f, bias=False)


class Linear(nn.Module):
    """A dense linear the checkpoint may store in FP8: e4m3 weight + `scale` (one float32 per
    block x block tile: 128 in V4, 32 in V4.1) when fp8, else a plain weight and no scale."""

    def __init__(self, out_f: int, in_f: int, fp8: bool = False, block: int = FP8_BLOCK):
        super().__init__()
        dtype = torch.float8_e4m3fn if fp8 else None
        self.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=dtype), requires_grad=not fp8)
        scale = torch.empty(fp8_block_scale_shape(out_f, in_f, block), dtype=torch.float32) if fp8 else None
        self.register_buffer("scale", scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.linear(x, self.weight, self.scale)


class Norm(nn.Module):
    """RMSNorm weight holder (fp32 as in the reference)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=torch.float32))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.rms_norm(x, self.weight, self.eps)


class Compressor(nn.Module):
    """Pools blocks of `ratio` tokens into one KV entry (paper 2.3.1 eq. 9-12, 2.3.2 eq. 20-23):
    softmax(gate + position bias)-weighted sum, RMSNorm, RoPE at the block's first position.
    CSA (overlap=True) pools overlapping windows of 2*ratio tokens via two series Ca/Cb."""

    def __init__(self, cfg: ModelConfig, ratio: int, head_dim: int, overlap: bool):
        super().__init__()
        c = 2 if overlap else 1
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, overlap
        self.wkv = _linear(c * head_dim, cfg.hidden_size)
        self.wgate = _linear(c * head_dim, cfg.hidden_size)
        self.norm = Norm(head_dim, cfg.rms_norm_eps)
        self.ape = nn.Parameter(torch.zeros(ratio, c * head_dim, dtype=torch.float32))

    def absorb(self, kv_all: torch.Tensor, gate: torch.Tensor, fb: ForwardBatch, state: CompressorState,
               pool: torch.Tensor, cache: KVCache, rope: tuple[torch.Tensor, ...]) -> None:
        """Feed this step's tokens (those at positions >= compress_from) and write closed blocks. kv_all,
        gate: wkv(x), wgate(x) (column views of the layer's stacked GEMM: the kernels take row strides)."""
        m = self.ratio
        if fb.is_decode:  # its kernel adds the position bias
            return self._absorb_decode(kv_all, gate, fb, state, pool, cache, rope[0])
        plan = compress_plan(fb, m, cache.block_size, state.pend_kv.shape[0])
        closed = K.compress_blocks(kv_all, gate, plan, state, self.norm.weight, self.norm.eps, rope[0],
                                   pool, fb.full_tables, self.head_dim, fb.closed_blocks is not None,
                                   fb.positions, self.ape)  # the op adds the gate's position bias
        if closed is not None:
            fb.closed_blocks[id(state)] = closed

    def _absorb_decode(self, kv_all, gate, fb: ForwardBatch, state: CompressorState, pool: torch.Tensor,
                       cache: KVCache, inv_freq: torch.Tensor) -> None:
        """One token per sequence, all sequences at once, no host sync (kernels.compress_decode); gate
        before its position bias (ape), which the kernel adds."""
        K.compress_decode(kv_all, gate, fb.positions, fb.state_slot_t, state.pend_kv, state.pend_gate,
                          state.prev_kv, state.prev_gate, state.has_prev, state.bnd_kv, state.bnd_gate,
                          self.norm.weight, self.norm.eps, inv_freq, pool, fb.full_tables, cache.block_size,
                          self.ratio, self.head_dim, ape=self.ape)


class Indexer(nn.Module):
    """Lightning indexer (paper 2.3.1 eq. 13-17): its own small compressor over the same
    blocks, queries from the q LoRA residual, score sum_h w_h relu(q_h . k)."""

    def __init__(self, cfg: ModelConfig, ratio: int):
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = _linear(cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)
        self.weights_proj = _linear(cfg.index_n_heads, cfg.hidden_size)
        self.compressor = Compressor(cfg, ratio, cfg.index_head_dim, overlap=True)


def add_attention_projections(m: nn.Module, cfg, heads: int, groups: int, fp8: bool, norm=None,
                              block: int = FP8_BLOCK) -> None:
    """The projections V4 and V4.1 attention share, as the checkpoints name them: the q LoRA (wq_a,
    q_norm, wq_b), the shared KV latent (wkv, kv_norm), the grouped low-rank output (wo_a, wo_b) and
    the per-head sinks. `norm`: the model's Norm class (V4.1 keeps its own); `block`: the FP8 tile."""
    norm = norm or Norm
    hd = cfg.head_dim
    m.wq_a = Linear(cfg.q_lora_rank, cfg.hidden_size, fp8, block)
    m.q_norm = norm(cfg.q_lora_rank, cfg.rms_norm_eps)
    m.wq_b = Linear(heads * hd, cfg.q_lora_rank, fp8, block)
    m.wkv = Linear(hd, cfg.hidden_size, fp8, block)
    m.kv_norm = norm(hd, cfg.rms_norm_eps)
    m.wo_a = Linear(groups * cfg.o_lora_rank, heads * hd // groups, fp8, block)
    m.wo_b = Linear(cfg.hidden_size, groups * cfg.o_lora_rank, fp8, block)
    m.attn_sink = nn.Parameter(torch.zeros(heads, dtype=torch.float32))


class Attention(nn.Module):
    """Shared-KV MQA with q LoRA, partial interleaved RoPE, sinks, a sliding window and (CSA/HCA)
    a compressed long-range branch; grouped low-rank output projection. Under tensor parallelism
    (engine/parallel.py) it holds its rank's heads and their share of wo_a / wo_b."""

    def __init__(self, cfg: ModelConfig, layer: int, fp8: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.layer, self.tp = cfg, layer, tp
        self.layer_type, self.ratio = cfg.layer_types[layer], cfg.compress_ratios[layer]
        H, hd = tp.local_heads(cfg), cfg.head_dim
        self.num_heads, self.o_groups = H, tp.local_groups(cfg)
        add_attention_projections(self, cfg, H, self.o_groups, fp8)
        csa = self.layer_type == CSA
        if self.layer_type != SLIDING:
            self.compressor = Compressor(cfg, self.ratio, hd, overlap=csa)
        if csa:
            self.indexer = Indexer(cfg, self.ratio)
        self.x_readers = members(self, ATTENTION_X_READERS)  # one GEMM where stacked at load (a plain tuple)

    def forward(self, x: torch.Tensor, fb: ForwardBatch, cache: KVCache, ropes: dict) -> torch.Tensor:
        cfg, T = self.cfg, x.shape[0]
        H, hd, W = self.num_heads, cfg.head_dim, cfg.sliding_window
        rope = "main" if self.layer_type == SLIDING else "compress"
        cos, sin = ropes[rope]
        q_lora, kv = linear_group((self.wq_a, self.wkv), x)  # one launch where stacked at load
        if self.layer_type == CSA:  # the indexer reads the normed q too
            q_res = self.q_norm(q_lora)
            q_b = self.wq_b(q_res)
        else:  # the norm in wq_b's prologue where the fusion switch q_norm_gemv takes it (kernels/fusions.py)
            q_b = K.norm_linear(q_lora, self.q_norm.weight, self.q_norm.eps, self.wq_b.weight, self.wq_b.scale)
        q = K.q_kv_norm_rope(q_b.view(T, H, hd), kv, self.kv_norm.weight, cos, sin, cfg.rms_norm_eps,
                             cache.window[self.layer], fb.window_slots)  # kv: norm, RoPE, into the window cache

        comp_pool, selected = None, None
        if self.layer_type != SLIDING:
            inv = ropes["compress_inv_freq"]
            comp_pool = cache.compressed[self.layer]
            kv_c, gate_c, *index_x = linear_group(self.x_readers, x)
            self.compressor.absorb(kv_c, gate_c, fb, cache.comp_state[self.layer], comp_pool, cache, (inv,))
            if self.layer_type == CSA:
                ix, (ikv, igate, iw) = self.indexer, index_x
                ix.compressor.absorb(ikv, igate, fb, cache.index_state[self.layer], cache.index_keys[self.layer],
                                     cache, (inv,))
                iq = K.apply_rope(ix.wq_b(q_res).view(T, ix.n_heads, ix.head_dim), cos, sin)
                selected = K.indexer_topk(iq, iw, cache.index_keys[self.layer], fb.full_tables, fb.positions,
                                          fb.token_seq, self.ratio, ix.topk, fb.max_pos, fb.is_decode,
                                          iw_scale=ix.n_heads**-0.5)  # head weights' scale: in the kernel, fp32
        out = K.paged_attention(q, fb.positions, fb.token_seq, cache.window[self.layer], fb.window_tables,
                                fb.replay_start_t, W, comp_pool, fb.full_tables, self.ratio, selected,
                                self.attn_sink, hd**-0.5, inv_rope=ropes[f"{rope}_inverse"])  # undo RoPE on V (K = V)
        o = K.grouped_linear(out.view(T, self.o_groups, -1), self.wo_a.weight, self.o_groups, self.wo_a.scale)
        return self.tp.all_reduce(self.wo_b(o))  # tensor parallel: each rank's heads' partial sum


class Gate(nn.Module):
    def __init__(self, cfg: ModelConfig, hashed: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, cfg.num_experts_per_tok, dtype=torch.long))
            self.bias = None
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts, dtype=torch.float32))
            self.tid2eid = None


class SharedExpert(nn.Module):
    def __init__(self, cfg: ModelConfig, fp8: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        inter = tp.local_shared_width(cfg)
        self.w1, self.w3 = Linear(inter, cfg.hidden_size, fp8), Linear(inter, cfg.hidden_size, fp8)
        self.w2 = Linear(cfg.hidden_size, inter, fp8)
        self.limit = cfg.swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return K.swiglu_linear(*linear_group((self.w1, self.w3), x), self.limit, self.w2.weight, self.w2.scale)


def _expert_weights(module: nn.Module, name: str, E: int, out_f: int, in_f: int, fmt: str) -> None:
    """experts_<name> [E, out, in] as stored (bf16 / fp8 / fp4) and, when quantized, its scale buffer."""
    if fmt == "fp4":
        if in_f % MX_BLOCK:
            raise ValueError(f"MXFP4 experts need K % {MX_BLOCK} == 0, got {in_f}")
        w = torch.empty(E, out_f, in_f // 2, dtype=torch.int8)
        scale = torch.empty(E, out_f, in_f // MX_BLOCK, dtype=torch.uint8)  # ue8m0 bytes
    elif fmt == "fp8":
        w = torch.empty(E, out_f, in_f, dtype=torch.float8_e4m3fn)
        scale = torch.empty(E, *fp8_block_scale_shape(out_f, in_f), dtype=torch.float32)
    else:
        w, scale = torch.empty(E, out_f, in_f), None
    setattr(module, f"experts_{name}", nn.Parameter(w, requires_grad=fmt == "bf16"))
    module.register_buffer(f"experts_{name}_scale", scale)


class MoE(nn.Module):
    """Top-k routed experts (sqrt-softplus scores, selection-only bias) or hash routing, plus
    one shared expert; clamped SwiGLU. Under tensor parallelism it holds its rank's experts
    (expert parallel) or every expert's intermediate slice, and a slice of the shared expert."""

    def __init__(self, cfg: ModelConfig, layer: int, quantized: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.tp = cfg, tp
        E, inter, D = tp.local_experts(cfg), tp.local_expert_width(cfg), cfg.hidden_size
        self.gate = Gate(cfg, hashed=cfg.is_hash_layer[layer])
        fmt = cfg.expert_dtype if quantized else "bf16"
        _expert_weights(self, "w1", E, inter, D, fmt)
        _expert_weights(self, "w3", E, inter, D, fmt)
        _expert_weights(self, "w2", E, D, inter, fmt)
        self.shared_experts = SharedExpert(cfg, quantized and cfg.fp8_linears, tp)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        cfg = self.cfg
        hash_ids = self.gate.tid2eid[input_ids] if self.gate.tid2eid is not None else None
        gate = (self.gate.weight, self.gate.bias, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func,
                hash_ids)
        experts = (self.experts_w1, self.experts_w3, self.experts_w2)
        scales = None if self.experts_w1_scale is None else (self.experts_w1_scale, self.experts_w3_scale,
                                                             self.experts_w2_scale)
        if not self.tp.expert_parallel or self.tp.world == 1:  # every expert here: the router may align the pairs
            out = K.router_moe(x, *gate, *experts, cfg.swiglu_limit, scales, self.shared_experts(x))
        else:
            weights, indices = K.router_topk(x, *gate, expert_span=self.tp.expert_span(cfg))  # this rank's ids
            out = K.moe_experts(x, *experts, weights, indices, cfg.swiglu_limit, scales,
                                self.shared_experts(x))  # + shared: in its last launch
        return self.tp.all_reduce(out)  # tensor parallel: one join per layer


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, quantized: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg = cfg
        mix, hc, D = (2 + cfg.hc_mult) * cfg.hc_mult, cfg.hc_mult, cfg.hidden_size
        self.attn_norm = Norm(D, cfg.rms_norm_eps)
        self.ffn_norm = Norm(D, cfg.rms_norm_eps)
        for kind in ("attn", "ffn"):
            setattr(self, f"hc_{kind}_fn", nn.Parameter(torch.zeros(mix, hc * D, dtype=torch.float32)))
            setattr(self, f"hc_{kind}_base", nn.Parameter(torch.zeros(mix, dtype=torch.float32)))
            setattr(self, f"hc_{kind}_scale", nn.Parameter(torch.ones(3, dtype=torch.float32)))
        self.attn = Attention(cfg, layer, quantized and cfg.fp8_linears, tp)
        self.ffn = MoE(cfg, layer, quantized, tp)

    def _hc(self, kind: str, h: torch.Tensor):
        c = self.cfg
        return K.hc_pre(h, getattr(self, f"hc_{kind}_fn"), getattr(self, f"hc_{kind}_base"),
                        getattr(self, f"hc_{kind}_scale"), c.hc_eps, c.rms_norm_eps, c.hc_sinkhorn_iters)

    def _post_pre(self, h: torch.Tensor, pending: tuple, kind: str, norm: Norm):
        """The pending sublayer's hc_post, then this sublayer's hc_pre and norm: one op (Mega-mHC)."""
        c = self.cfg
        return K.hc_post_pre_norm(h, *pending, getattr(self, f"hc_{kind}_fn"), getattr(self, f"hc_{kind}_base"),
                                  getattr(self, f"hc_{kind}_scale"), norm.weight, c.hc_eps, c.rms_norm_eps, norm.eps,
                                  c.hc_sinkhorn_iters)

    def forward(self, h: torch.Tensor, fb: ForwardBatch, cache: KVCache, ropes: dict) -> torch.Tensor:
        h, pending = self.run(h, fb, cache, ropes)
        return K.hc_post(h, *pending)

    def run(self, h: torch.Tensor, fb: ForwardBatch, cache: KVCache, ropes: dict, pending: tuple | None = None):
        """The block with its last hc_post left pending as (output, post, comb), for the next block's
        _post_pre; `pending`: the previous block's. -> (streams, pending)."""
        if pending is None:
            post, comb, x = self._hc("attn", h)
            x = self.attn_norm(x)
        else:
            h, post, comb, x = self._post_pre(h, pending, "attn", self.attn_norm)
        h, post, comb, x = self._post_pre(h, (self.attn(x, fb, cache, ropes), post, comb), "ffn", self.ffn_norm)
        return h, (self.ffn(x, fb.input_ids), post, comb)


class DeepseekV4(ModelFamily):
    supports_tensor_parallel = True
    supports_prompt_logprobs = True
    speculative_methods = ("mtp", "dspark")  # as the checkpoint's layout allows (preview: MTP; 0731: DSpark)

    def __init__(self, cfg: ModelConfig, quantized: bool = False, tp: TensorParallel = SINGLE):
        super().__init__()
        self.cfg, self.quantized, self.tp = cfg, quantized, tp
        hc, D = cfg.hc_mult, cfg.hidden_size
        self.embed = nn.Embedding(cfg.vocab_size, D)
        self.layers = nn.ModuleList(Block(cfg, i, quantized, tp) for i in range(cfg.num_layers))
        self.mtp_weights: dict[str, torch.Tensor] = {}  # `mtp.*` as loaded, for the speculative decoder
        self.norm = Norm(D, cfg.rms_norm_eps)
        self.head = _linear(cfg.vocab_size, D) if tp.rank == 0 else None  # rank 0 samples
        self.hc_head_fn = nn.Parameter(torch.zeros(hc, hc * D, dtype=torch.float32))
        self.hc_head_base = nn.Parameter(torch.zeros(hc, dtype=torch.float32))
        self.hc_head_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))
        self.register_buffer("main_inv_freq", cfg.main_rope.inv_freq(), persistent=False)
        self.register_buffer("compress_inv_freq", cfg.compress_rope.inv_freq(), persistent=False)

    @torch.inference_mode()
    def forward(self, fb: ForwardBatch, cache: KVCache) -> torch.Tensor | None:
        """One step over packed tokens; returns logits [len(fb.logits_rows), vocab] in fp32 (None
        on tensor-parallel ranks > 0: rank 0 samples)."""
        h = self.hidden_states(fb, cache)
        return None if self.head is None else self.compute_logits(h[fb.logits_rows])

    def ropes(self, positions: torch.Tensor, dtype: torch.dtype) -> dict:
        """cos / sin per row, once per step; the inverse rotations too (one negation per step, not per layer)."""
        main = K.rope_cos_sin(positions, self.main_inv_freq, dtype)
        compress = K.rope_cos_sin(positions, self.compress_inv_freq, dtype)
        return {"main": main, "compress": compress, "main_inverse": (main[0], -main[1]),
                "compress_inverse": (compress[0], -compress[1]), "compress_inv_freq": self.compress_inv_freq}

    @torch.inference_mode()
    def hidden_states(self, fb: ForwardBatch, cache: KVCache) -> torch.Tensor:
        """Every row's last residual streams [T, hc_mult, hidden], before the HC head (what MTP reads)."""
        return self._layers(fb, cache)[0]

    @torch.inference_mode()
    def dspark_features(self, fb: ForwardBatch, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(last residual streams [T, hc_mult, hidden], DSpark's target features [T, n_targets * hidden]:
        the residual streams after each of dspark_target_layer_ids, averaged over the copies,
        concatenated in that order; docs/DSPARK.md)."""
        return self._layers(fb, cache, self.cfg.dspark.target_layer_ids)

    def _layers(self, fb: ForwardBatch, cache: KVCache, taps: tuple[int, ...] = ()):
        x = self.embed(self.tp.broadcast(fb.input_ids))  # async scheduling's tokens live on rank 0
        ropes = self.ropes(fb.positions, x.dtype)
        h = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()  # mHC: 4 copies of the residual
        pending, tapped = None, {}
        for i, block in enumerate(self.layers):
            h, pending = block.run(h, fb, cache, ropes, pending)
            if i in taps:  # the pending hc_post once more: the next block fuses it into its own hc_pre
                tapped[i] = K.hc_post(h, *pending).mean(dim=1)
        h = K.hc_post(h, *pending)
        return h, (torch.cat([tapped[i] for i in taps], dim=-1) if taps else None)

    @torch.inference_mode()
    def compute_logits(self, h: torch.Tensor) -> torch.Tensor:
        """[n, hc_mult, hidden] residual streams -> fp32 logits: HC head, final norm, LM head."""
        cfg = self.cfg
        x = K.hc_head(h, self.hc_head_fn, self.hc_head_base, self.hc_head_scale, cfg.hc_eps, cfg.rms_norm_eps)
        return K.linear(self.norm(x), self.head.weight).float()  # bf16 logits, as served, rounded there too

    # --- loading ------------------------------------------------------------------------------

    def expected_names(self) -> set[str]:
        """Official checkpoint names this model needs (scales too when quantized)."""
        return expected_names(self, self.tp.local_experts(self.cfg))

    def load_weight(self, name: str, tensor: torch.Tensor) -> None:
        if name.startswith("mtp."):
            self.mtp_weights[name] = tensor
            return
        load_weight(self, name, tensor)

    def cast(self, dtype: torch.dtype) -> DeepseekV4:
        return cast_params(self, dtype)

    def mtp_draft(self):
        from engine.models.deepseek_v4.mtp import MTP  # it builds on this module's blocks

        if self.cfg.dspark is not None:
            raise WeightsError("speculative_config method 'mtp' needs a NextN MTP layer; this checkpoint (the 0731 "
                               f"layout) ships {self.cfg.dspark.num_stages} DSpark draft stages under mtp.* instead")
        return MTP.from_model(self)

    def dspark_draft(self):
        from engine.models.deepseek_v4.dspark import DSparkDrafter  # it builds on this module's blocks

        return DSparkDrafter.from_model(self)


# Shared by DeepseekV4 and the MTP module (engine/models/deepseek_v4/mtp.py): the same official names below a prefix.

_FP32 = ("hc_", "attn_sink", ".ape", "gate.bias", "norm.weight", "q_norm", "kv_norm")


def expected_names(module: nn.Module, n_experts: int) -> set[str]:
    """Official checkpoint names `module` needs (scales too when quantized)."""
    names = set()
    buffers = [n for n, b in module.named_buffers() if b is not None and ("tid2eid" in n or n.endswith("scale"))]
    for name in [n for n, _ in module.named_parameters()] + buffers:
        if ".experts_w" in name:  # layers.N.ffn.experts_wK[_scale] -> one name per expert
            layer, w = name.split(".ffn.experts_")
            kind = "scale" if w.endswith("_scale") else "weight"
            names.update(f"{layer}.ffn.experts.{e}.{w.split('_')[0]}.{kind}" for e in range(n_experts))
        else:
            names.add(name)
    return names


def weight_target(module: nn.Module, name: str) -> torch.Tensor:
    """The parameter or buffer (a view of it, for one routed expert) that checkpoint tensor `name`
    (official name, relative to `module`) fills."""
    if ".ffn.experts." in name:  # layers.N.ffn.experts.E.wK.{weight,scale} -> stacked experts_wK[_scale][E]
        prefix, rest = name.split(".ffn.experts.")
        e, w, kind = rest.split(".")
        stacked = f"{prefix}.ffn.experts_{w}"
        return (module.get_buffer(stacked + "_scale") if kind == "scale" else module.get_parameter(stacked))[int(e)]
    if name.endswith(("tid2eid", ".scale")):
        return module.get_buffer(name)
    return module.get_parameter(name)


def check_weight(target: torch.Tensor, name: str, tensor: torch.Tensor) -> None:
    """Refuse a checkpoint tensor that cannot fill `target`, naming it (shape; stored FP8 / FP4 dtype)."""
    if target.shape != tensor.shape:
        raise WeightsError(f"{name}: checkpoint shape {tuple(tensor.shape)} != model {tuple(target.shape)}")
    if target.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8) and tensor.dtype != target.dtype:
        raise WeightsError(f"{name}: checkpoint dtype {tensor.dtype}, but the config stores it as {target.dtype}")


def load_weight(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Copy one checkpoint tensor (official name, relative to `module`) into its parameter or buffer."""
    target = weight_target(module, name)
    check_weight(target, name, tensor)
    with torch.no_grad():
        target.copy_(tensor.to(target.dtype))


def cast_params(module: nn.Module, dtype: torch.dtype, fp32_names: tuple[str, ...] = _FP32) -> nn.Module:
    """Model dtype for weights; norms, mHC, sinks, position biases and gate bias (names holding
    one of `fp32_names`) stay fp32 (as the reference keeps them), except in float64 runs where
    everything is float64."""
    for name, p in module.named_parameters():
        if p.dtype in (torch.float8_e4m3fn, torch.int8):  # stored FP8 / packed FP4 stay as they are
            continue
        keep32 = dtype != torch.float64 and any(k in name for k in fp32_names)
        p.data = p.data.to(torch.float32 if keep32 else dtype)
    return module
