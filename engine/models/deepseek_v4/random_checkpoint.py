"""Seeded random DeepSeek-V4 checkpoints in the official layout (CLI: tools/make_tiny_checkpoint.py).

The tensors carry DeepSeek's own names (`embed.weight`, `layers.N.attn.wq_a.weight`,
`layers.N.ffn.experts.E.w1.weight`, `hc_head_fn`, ...) and config.json the official keys
(`compress_ratios` with the MTP slot, `num_hash_layers`, `qk_rope_head_dim`, ...), so the
engine's loader is exercised exactly as on a real checkpoint, and transformers'
`DeepseekV4ForCausalLM.from_pretrained` reads the same directory as the numeric oracle.

Random weights are scaled so activations stay O(1) (flat logits otherwise), the router is
randomised so tokens reach distinct experts, and the mHC mixing weights are kept small:
transformers' own init routes every token to one expert and makes mHC unstable enough
that bf16 rounding changes tokens.

`quant` writes the shipped formats (kernels/formats.py): "fp8-fp4" as V4-Flash (FP8 e4m3 dense
linears with ue8m0 128x128 block scales, MXFP4 routed experts), "fp8" as V4-Flash-Base (FP8
experts too; float32 block scales, as vLLM's DeepseekV4FP8Config reads Base). With
`num_nextn_predict_layers: 1` the MTP layer is written as `mtp.0.*` (a sliding-window block plus
e_proj, h_proj, enorm, hnorm, norm and its own hc_head), the names vLLM's DeepSeekV4MTP loads.

`layout="0731"` writes DeepSeek-V4-Flash-0731's layout instead (docs/DSPARK.md): three DSpark draft
stages `mtp.0..2` (each a sliding-window block with routed MoE, in the main layers' stored
formats), stage 0's `main_proj` (FP8 when quantized) and `main_norm`, the last stage's `norm`,
`hc_head_*`, `markov_head.markov_w1/w2` (bf16) and `confidence_head.proj` (fp32), and the
`dspark_*` config keys with one compress_ratios slot per stage.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import zlib
from pathlib import Path

import torch
from safetensors.torch import save_file

from kernels.formats import quantize_fp8_block, quantize_mxfp4

DATA = Path(__file__).parents[2] / "data"  # engine/data: the tiny tokenizer
WRITER_VERSION = "2"  # bumped when what the writer emits changes (2: the MTP layer); the cached tiny default follows
LAYOUTS = ("preview", "0731")  # one NextN MTP layer (the preview release) / DSpark draft stages (0731)

# Real models only use 0 (sliding), 4 (CSA) and 128 (HCA); transformers maps only those from
# `compress_ratios`, so other ratios also get its `layer_types` + `compress_rates` keys.
OFFICIAL_RATIOS = {0: "sliding_attention", 4: "compressed_sparse_attention", 128: "heavily_compressed_attention"}

PRESETS: dict[str, dict] = {
    # Fast on 2 CPU cores, every layer kind: sliding, CSA (ratio 4, indexer top-4 of many
    # entries), HCA (ratio 16 here so short tests cross blocks), hash-MoE and routed MoE.
    "tiny": dict(
        vocab_size=4096, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, head_dim=32,
        qk_rope_head_dim=8, q_lora_rank=32, o_groups=2, o_lora_rank=16,
        moe_intermediate_size=32, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        num_hash_layers=1, sliding_window=16, compress_ratios=[0, 4, 16, 4, 0],
        index_n_heads=8, index_head_dim=16, index_topk=4, max_position_embeddings=4096,
        rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                      "beta_fast": 32, "beta_slow": 1},
    ),
    # V4-Flash's per-layer dimensions with 4 layers and 16 experts (3.24B params): GPU benchmarks.
    "flash-shaped": dict(
        vocab_size=129280, hidden_size=4096, num_hidden_layers=4, num_attention_heads=64, head_dim=512,
        qk_rope_head_dim=64, q_lora_rank=1024, o_groups=8, o_lora_rank=1024,
        moe_intermediate_size=2048, n_routed_experts=16, n_shared_experts=1, num_experts_per_tok=6,
        num_hash_layers=3, sliding_window=128, compress_ratios=[0, 4, 128, 4, 0],
        index_n_heads=64, index_head_dim=128, index_topk=512, max_position_embeddings=1048576,
        rope_scaling={"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                      "beta_fast": 32, "beta_slow": 1},
    ),
}
# V4-Flash's depth: 43 layers on its schedule (2 sliding, then CSA / HCA alternating, the MTP slot
# last), 3 hash layers, 16 experts (the expert count is what decides the size on one GPU)
PRESETS["flash-depth"] = dict(PRESETS["flash-shaped"], num_hidden_layers=43,
                              compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0])

COMMON = dict(
    architectures=["DeepseekV4ForCausalLM"], model_type="deepseek_v4", num_key_value_heads=1,
    scoring_func="sqrtsoftplus", topk_method="noaux_tc", norm_topk_prob=True, routed_scaling_factor=1.5,
    swiglu_limit=10.0, rope_theta=10000.0, compress_rope_theta=160000.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
    tie_word_embeddings=False, num_nextn_predict_layers=1, torch_dtype="bfloat16", expert_dtype="bf16",
)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}"
    "{% elif m['role'] == 'user' %}<｜User｜>{{ m['content'] }}"
    "{% elif m['role'] == 'assistant' %}<｜Assistant｜>{{ m['content'] }}<｜end▁of▁sentence｜>{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


QUANTS = ("bf16", "fp8", "fp8-fp4")
# Dense linears stored FP8 in the official checkpoint; compressor / indexer projections, the
# router gate, embedding and head stay bf16.
FP8_LINEAR = re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b)\.weight$|\.shared_experts\.w[123]\.weight$|"
                        r"^mtp\.\d+\.(e_proj|h_proj|main_proj)\.weight$")
ROUTED_EXPERT = re.compile(r"\.experts\.\d+\.w[123]\.weight$")


def quant_config(quant: str) -> dict:
    """The config keys of a checkpoint stored as `quant`."""
    if quant not in QUANTS:
        raise ValueError(f"unknown quant {quant!r}; choose from {QUANTS}")
    if quant == "bf16":
        return {"expert_dtype": "bf16"}
    qc = {"quant_method": "fp8", "fmt": "e4m3", "scale_fmt": "ue8m0", "weight_block_size": [128, 128],
          "activation_scheme": "dynamic"}
    if quant == "fp8":
        del qc["scale_fmt"]  # Base: float32 block scales
    return {"expert_dtype": "fp4" if quant == "fp8-fp4" else "fp8", "quantization_config": qc}


def quantize_tensors(tensors: dict[str, torch.Tensor], quant: str) -> dict[str, torch.Tensor]:
    """bf16 tensors in official names -> the stored formats of `quant` (`<stem>.scale` beside)."""
    if quant == "bf16":
        return tensors
    out = {}
    for name, t in tensors.items():
        stem = name[: -len(".weight")]
        if quant == "fp8-fp4" and ROUTED_EXPERT.search(name):
            out[name], out[stem + ".scale"] = quantize_mxfp4(t)
        elif FP8_LINEAR.search(name) or ROUTED_EXPERT.search(name):
            out[name], out[stem + ".scale"] = quantize_fp8_block(t, ue8m0=quant == "fp8-fp4")
        else:
            out[name] = t
    return out


def dspark_keys(cfg: dict) -> dict:
    """The 0731 config keys for a model `cfg`: 5-token blocks, the last three layers as targets
    (V4-Flash: [40, 41, 42]), rank 256 (16 below hidden 1024), the noise token the vocabulary's last."""
    n, V = cfg["num_hidden_layers"], cfg["vocab_size"]
    return {"dspark_block_size": 5, "dspark_noise_token_id": 128799 if V == 129280 else V - 1,
            "dspark_markov_rank": 256 if cfg["hidden_size"] >= 1024 else 16,
            "dspark_target_layer_ids": list(range(max(0, n - 3), n)), "num_nextn_predict_layers": 3}


def build_config(preset: str, override: dict | None = None, quant: str = "bf16", layout: str = "preview") -> dict:
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose from {sorted(PRESETS)}")
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; choose from {LAYOUTS}")
    cfg = {**COMMON, **PRESETS[preset], **quant_config(quant), **(override or {})}
    if layout == "0731":
        cfg = {**cfg, **dspark_keys({**cfg, **(override or {})}), **(override or {})}
    n, slots = cfg["num_hidden_layers"], max(1, int(cfg.get("num_nextn_predict_layers", 0)))
    ratios = cfg["compress_ratios"]
    if len(ratios) in (n, n + 1) and len(ratios) != n + slots:  # the draft slots the official key carries
        ratios = cfg["compress_ratios"] = [*ratios[:n], *[0] * slots]
    if len(ratios) != n + slots:
        raise ValueError(f"compress_ratios needs {n} + {slots} (MTP / draft stages) entries, got {len(ratios)}")
    if any(r not in OFFICIAL_RATIOS for r in ratios[:n]):
        csa = sorted({r for r in ratios[:n] if r and r <= 8}) or [4]
        hca = sorted({r for r in ratios[:n] if r > 8}) or [128]
        if len(csa) > 1 or len(hca) > 1:
            raise ValueError(f"one CSA and one HCA ratio per model, got {ratios}")
        cfg["compress_rates"] = {"compressed_sparse_attention": csa[0], "heavily_compressed_attention": hca[0]}
        cfg["layer_types"] = [
            "sliding_attention" if r == 0 else
            "compressed_sparse_attention" if r == csa[0] else "heavily_compressed_attention"
            for r in ratios[:n]
        ]
    return cfg


def layer_type(cfg: dict, i: int) -> str:
    return cfg["layer_types"][i] if "layer_types" in cfg else OFFICIAL_RATIOS[cfg["compress_ratios"][i]]


class _Rand:
    """Per-tensor generators seeded from (seed, name): a tensor does not depend on write order.
    device="cuda" draws on the GPU (minutes faster for flash-shaped; other numbers than the CPU's)."""

    def __init__(self, seed: int, device: str = "cpu"):
        self.seed, self.device = seed, device

    def gen(self, name: str) -> torch.Generator:
        return torch.Generator(device=self.device).manual_seed(self.seed * 1_000_003 + zlib.crc32(name.encode()))

    def normal(self, name: str, shape, std: float, mean: float = 0.0, dtype=torch.bfloat16) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen(name), dtype=torch.float32, device=self.device) * std + mean
        return t.to(dtype)  # stays where drawn: the quantization runs there too (minutes on a CPU at depth)

    def linear(self, name: str, out_f: int, in_f: int) -> torch.Tensor:
        return self.normal(name, (out_f, in_f), 1.0 / math.sqrt(in_f))

    def norm(self, name: str, dim: int) -> torch.Tensor:
        return self.normal(name, (dim,), 0.1, mean=1.0)


def expert_tensors(r: _Rand, p: str, E: int, inter: int, D: int) -> dict[str, torch.Tensor]:
    """Routed experts 0..E-1 of the layer named `p` (its prefix, "layers.N.")."""
    t = {}
    for e in range(E):
        x = p + f"ffn.experts.{e}."
        t[x + "w1.weight"] = r.linear(x + "w1", inter, D)
        t[x + "w3.weight"] = r.linear(x + "w3", inter, D)
        t[x + "w2.weight"] = r.linear(x + "w2", D, inter)
    return t


def layer_tensors(cfg: dict, i: int, r: _Rand, prefix: str | None = None) -> dict[str, torch.Tensor]:
    """All tensors of layer i (i = num_hidden_layers: the MTP block, under `prefix`), official
    names, bf16 except hc_*, attn_sink, ape, gate.bias (fp32)."""
    D, H, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    q_lora, groups, o_lora = cfg["q_lora_rank"], cfg["o_groups"], cfg["o_lora_rank"]
    hc, inter, E = cfg["hc_mult"], cfg["moe_intermediate_size"], cfg["n_routed_experts"]
    ratio = cfg["compress_ratios"][i]
    p, f32 = prefix or f"layers.{i}.", torch.float32
    mix = (2 + hc) * hc
    t = {
        p + "attn_norm.weight": r.norm(p + "attn_norm", D),
        p + "ffn_norm.weight": r.norm(p + "ffn_norm", D),
        p + "attn.wq_a.weight": r.linear(p + "wq_a", q_lora, D),
        p + "attn.q_norm.weight": r.norm(p + "q_norm", q_lora),
        p + "attn.wq_b.weight": r.linear(p + "wq_b", H * hd, q_lora),
        p + "attn.wkv.weight": r.linear(p + "wkv", hd, D),
        p + "attn.kv_norm.weight": r.norm(p + "kv_norm", hd),
        p + "attn.wo_a.weight": r.linear(p + "wo_a", groups * o_lora, H * hd // groups),
        p + "attn.wo_b.weight": r.linear(p + "wo_b", D, groups * o_lora),
        p + "attn.attn_sink": r.normal(p + "attn_sink", (H,), 1.0, dtype=f32),
        p + "ffn.gate.weight": r.linear(p + "gate", E, D),
    }
    for kind in ("attn", "ffn"):  # mHC: small mixing weights keep the 4 streams stable
        t[p + f"hc_{kind}_fn"] = r.normal(p + f"hc_{kind}_fn", (mix, hc * D), 0.02, dtype=f32)
        t[p + f"hc_{kind}_base"] = r.normal(p + f"hc_{kind}_base", (mix,), 0.1, dtype=f32)
        t[p + f"hc_{kind}_scale"] = r.normal(p + f"hc_{kind}_scale", (3,), 0.1, mean=0.5, dtype=f32)
    if ratio:
        coff = 2 if layer_type(cfg, i) == "compressed_sparse_attention" else 1  # CSA: overlapping blocks, two series
        c = p + "attn.compressor."
        t[c + "wkv.weight"] = r.linear(c + "wkv", coff * hd, D)
        t[c + "wgate.weight"] = r.linear(c + "wgate", coff * hd, D)
        t[c + "norm.weight"] = r.norm(c + "norm", hd)
        t[c + "ape"] = r.normal(c + "ape", (ratio, coff * hd), 0.5, dtype=f32)
        if coff == 2:
            ihd, ih = cfg["index_head_dim"], cfg["index_n_heads"]
            x = p + "attn.indexer."
            t[x + "wq_b.weight"] = r.linear(x + "wq_b", ih * ihd, q_lora)
            t[x + "weights_proj.weight"] = r.linear(x + "weights_proj", ih, D)
            t[x + "compressor.wkv.weight"] = r.linear(x + "c.wkv", 2 * ihd, D)
            t[x + "compressor.wgate.weight"] = r.linear(x + "c.wgate", 2 * ihd, D)
            t[x + "compressor.norm.weight"] = r.norm(x + "c.norm", ihd)
            t[x + "compressor.ape"] = r.normal(x + "c.ape", (ratio, 2 * ihd), 0.5, dtype=f32)
    if i < cfg["num_hash_layers"]:
        # a frozen token -> expert table with distinct experts per token
        g = r.gen(p + "tid2eid")
        scores = torch.rand(cfg["vocab_size"], E, generator=g, device=r.device).cpu()
        t[p + "ffn.gate.tid2eid"] = scores.argsort(dim=-1)[:, : cfg["num_experts_per_tok"]].to(torch.int32)
    else:
        t[p + "ffn.gate.bias"] = r.normal(p + "gate.bias", (E,), 0.1, dtype=f32)
    t.update(expert_tensors(r, p, E, inter, D))
    s = p + "ffn.shared_experts."
    shared = inter * cfg["n_shared_experts"]
    t[s + "w1.weight"] = r.linear(s + "w1", shared, D)
    t[s + "w3.weight"] = r.linear(s + "w3", shared, D)
    t[s + "w2.weight"] = r.linear(s + "w2", D, shared)
    return t


def mtp_tensors(cfg: dict, r: _Rand, j: int = 0) -> dict[str, torch.Tensor]:
    """MTP layer j: a decoder block at index num_hidden_layers + j (its compress_ratios slot,
    routed gate) plus the projections of the previous hidden state and the next token's embedding."""
    D, hc, p = cfg["hidden_size"], cfg["hc_mult"], f"mtp.{j}."
    t = layer_tensors(cfg, cfg["num_hidden_layers"] + j, r, prefix=p)
    t.update({
        p + "e_proj.weight": r.linear(p + "e_proj", D, D),
        p + "h_proj.weight": r.linear(p + "h_proj", D, D),
        p + "enorm.weight": r.norm(p + "enorm", D),
        p + "hnorm.weight": r.norm(p + "hnorm", D),
        p + "norm.weight": r.norm(p + "norm", D),
        p + "hc_head_fn": r.normal(p + "hc_head_fn", (hc, hc * D), 0.02, dtype=torch.float32),
        p + "hc_head_base": r.normal(p + "hc_head_base", (hc,), 0.1, dtype=torch.float32),
        p + "hc_head_scale": r.normal(p + "hc_head_scale", (1,), 0.1, mean=0.5, dtype=torch.float32),
    })
    return t


def dspark_tensors(cfg: dict, r: _Rand, j: int) -> dict[str, torch.Tensor]:
    """DSpark draft stage j (the 0731 layout): a block at index num_hidden_layers + j; stage 0 also
    projects the concatenated target-layer streams (main_proj, main_norm); the last stage carries
    the drafter's head: norm, hc_head, the Markov head and the confidence head."""
    D, V, hc, p = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"], f"mtp.{j}."
    rank, targets = cfg["dspark_markov_rank"], len(cfg["dspark_target_layer_ids"])
    t = layer_tensors(cfg, cfg["num_hidden_layers"] + j, r, prefix=p)
    if j == 0:
        t[p + "main_proj.weight"] = r.linear(p + "main_proj", D, targets * D)
        t[p + "main_norm.weight"] = r.norm(p + "main_norm", D)
    if j == cfg["num_nextn_predict_layers"] - 1:
        t.update({
            p + "norm.weight": r.norm(p + "norm", D),
            p + "hc_head_fn": r.normal(p + "hc_head_fn", (hc, hc * D), 0.02, dtype=torch.float32),
            p + "hc_head_base": r.normal(p + "hc_head_base", (hc,), 0.1, dtype=torch.float32),
            p + "hc_head_scale": r.normal(p + "hc_head_scale", (1,), 0.1, mean=0.5, dtype=torch.float32),
            p + "markov_head.markov_w1.weight": r.normal(p + "markov_w1", (V, rank), 1.0),
            p + "markov_head.markov_w2.weight": r.linear(p + "markov_w2", V, rank),
            p + "confidence_head.proj.weight": r.normal(p + "confidence", (1, D + rank), 1.0 / math.sqrt(D + rank),
                                                        dtype=torch.float32),
        })
    return t


def global_tensors(cfg: dict, r: _Rand) -> dict[str, torch.Tensor]:
    D, V, hc = cfg["hidden_size"], cfg["vocab_size"], cfg["hc_mult"]
    return {
        "embed.weight": r.normal("embed", (V, D), 1.0),
        "head.weight": r.linear("head", V, D),
        "norm.weight": r.norm("norm", D),
        "hc_head_fn": r.normal("hc_head_fn", (hc, hc * D), 0.02, dtype=torch.float32),
        "hc_head_base": r.normal("hc_head_base", (hc,), 0.1, dtype=torch.float32),
        "hc_head_scale": r.normal("hc_head_scale", (1,), 0.1, mean=0.5, dtype=torch.float32),
    }


def write_tokenizer(out: Path) -> None:
    shutil.copy(DATA / "tokenizer.json", out / "tokenizer.json")
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<｜begin▁of▁sentence｜>",
        "eos_token": "<｜end▁of▁sentence｜>",
        "add_bos_token": True,
        "model_max_length": 1048576,
        "chat_template": CHAT_TEMPLATE,
    }, indent=2, ensure_ascii=False), encoding="utf-8")


def _shard_path(out: Path, name: str, nbytes: int, spill_dir: Path | None) -> Path:
    """Where a shard goes: `out`, or `spill_dir` (linked from `out`) once `out`'s disk is nearly
    full, so a checkpoint larger than one disk (85 GB on a 64 GB disk) can span disk and tmpfs."""
    if spill_dir is None or shutil.disk_usage(out).free > nbytes + (4 << 30):
        return out / name
    spill_dir.mkdir(parents=True, exist_ok=True)
    (out / name).unlink(missing_ok=True)
    (out / name).symlink_to(spill_dir / name)
    return spill_dir / name


def write_checkpoint(out: str | Path, preset: str = "tiny", seed: int = 0, override: dict | None = None,
                     device: str = "cpu", quant: str = "bf16", spill_dir: str | Path | None = None,
                     layout: str = "preview") -> Path:
    """Write config, tokenizer and weights (one shard per layer when large) to `out`, the weights
    stored as `quant` (QUANTS) in `layout` (LAYOUTS); the same seed gives the same values before
    quantization. spill_dir: where shards go (linked from `out`) when `out`'s disk would fill up."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = build_config(preset, override, quant, layout)
    draft = dspark_tensors if "dspark_block_size" in cfg else mtp_tensors
    r = _Rand(seed, device)
    n, n_mtp = cfg["num_hidden_layers"], int(cfg.get("num_nextn_predict_layers", 0))
    sharded = cfg["hidden_size"] >= 1024  # stream big models layer by layer; never all in RAM
    weight_map: dict[str, str] = {}
    pending: dict[str, torch.Tensor] = {}
    for i in range(-1, n + n_mtp):  # -1: the global tensors; n..: the MTP layers
        tensors = global_tensors(cfg, r) if i < 0 else layer_tensors(cfg, i, r) if i < n else draft(cfg, r, i - n)
        tensors = {name: t.cpu() for name, t in quantize_tensors(tensors, quant).items()}
        if sharded:
            name = f"model-{i + 2:05d}-of-{n + n_mtp + 1:05d}.safetensors"
            nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
            path = _shard_path(out, name, nbytes, Path(spill_dir) if spill_dir else None)
            save_file(tensors, str(path), metadata={"format": "pt"})
            weight_map.update(dict.fromkeys(tensors, name))
        else:
            pending.update(tensors)
    if sharded:
        (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    else:
        save_file(pending, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    write_tokenizer(out)
    return out
