"""Write a seeded random tiny Llama checkpoint for testing the vLLM engine on CPU.

    python -m tools.make_tiny_vllm_checkpoint OUT [--seed N]

vLLM's CPU backend cannot run DeepSeek-V4 on this class of machine (its DeepSeek-V4 CPU path
needs kernels we do not have here: see docs/VLLM.md), so the vLLM adapter is tested on an
architecture vLLM runs natively on CPU: a 2-layer Llama written with transformers, carrying the
project's own tokenizer (engine/data/tokenizer.json, the same one the native tiny checkpoint
uses), so prompts tokenize identically under both engines.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Small, but with shapes vLLM's CPU attention supports (head_dim 32, GQA 4:2).
CONFIG = dict(
    vocab_size=4096,  # the tokenizer has 4000 ids; padded like the native tiny preset
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=4096,  # the repository model.json's max_model_len
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
)


def write_checkpoint(out: str | Path, seed: int = 0) -> Path:
    """config.json + model.safetensors (bf16) + the project's tokenizer, in `out`."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from engine.models.deepseek_v4.random_checkpoint import write_tokenizer

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    config = LlamaConfig(**CONFIG)
    model = LlamaForCausalLM(config)
    with torch.no_grad():  # larger logits than the 0.02 init, so greedy decoding is not all ties
        model.lm_head.weight.normal_(0.0, 0.5)
    model.to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    write_tokenizer(out)
    generation = out / "generation_config.json"
    if generation.exists():  # no sampling defaults: requests say what they want
        generation.write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}, indent=2))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"wrote tiny Llama checkpoint to {write_checkpoint(args.out, args.seed)}")


if __name__ == "__main__":
    main()
