"""DeepSeek-V4.1 Engram: the n-gram hash ids each position looks up in its layer's table.

A token id goes through a tokenizer-derived "compressed" id space (tokens that normalise alike,
" The" / "the", share one id); each position then hashes the n-grams (2..N) ending at it,
XOR-ing odd per-layer multipliers times the ids of itself and up to N-1 tokens before it,
into disjoint prime-sized bucket ranges (one per n-gram size and hash head). The hashing must
be replicated exactly or the trained tables are meaningless: this follows transformers'
DeepseekV41NgramHashState (compressed map, primes, multipliers from numpy's PCG64).

The look-back (the N-1 tokens before a chunk) comes from the runner (`lookback_ids`), so a
chunk starting anywhere (chunked prefill, a prefix-cache hit, replay) hashes as a cold run does.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.forward_batch import DEAD


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


@dataclass(frozen=True)
class EngramLayout:
    """primes [L][n-gram - 1][heads]: bucket sizes drawn in order above `vocab_size`, never reused;
    offsets [L][(n-gram - 1) * heads]: each column's start inside its layer's table."""

    primes: tuple
    offsets: tuple

    @classmethod
    def build(cls, num_layers: int, max_ngram_size: int, n_heads: int, vocab_size: int) -> EngramLayout:
        primes, seen = [], set()
        for _ in range(num_layers):
            per_ngram = []
            for _ in range(max_ngram_size - 1):
                sizes, current = [], vocab_size - 1
                for _ in range(n_heads):
                    current += 1
                    while not _is_prime(current) or current in seen:
                        current += 1
                    seen.add(current)
                    sizes.append(current)
                per_ngram.append(tuple(sizes))
            primes.append(tuple(per_ngram))
        offsets = []
        for layer in primes:
            row, total = [], 0
            for p in (p for per in layer for p in per):
                row.append(total)
                total += p
            offsets.append(tuple(row))
        return cls(tuple(primes), tuple(offsets))

    def table_rows(self) -> list[int]:
        return [sum(p for per in layer for p in per) for layer in self.primes]


def hash_multipliers(layer_ids: tuple[int, ...], max_ngram_size: int, compressed_vocab_size: int) -> torch.Tensor:
    """[L, max_ngram_size] odd multipliers, one RNG per layer (seed 10007 * layer), bounded so
    id * multiplier stays inside int64."""
    bound = max(1, (np.iinfo(np.int64).max // compressed_vocab_size) // 2)
    rows = [np.random.default_rng(10007 * layer).integers(0, bound, size=(max_ngram_size,), dtype=np.int64) * 2 + 1
            for layer in layer_ids]
    return torch.tensor(np.stack(rows))


def compressed_token_map(tokenizer_json: str | Path) -> tuple[list[int], int]:
    """token id -> compressed id, and the compressed vocabulary size. Normalisation: NFKC, NFD,
    strip accents, lowercase, whitespace runs to one space, strip (a lone space survives)."""
    from tokenizers import Regex, Tokenizer, normalizers

    sentinel = "\ue000"
    normalizer = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    tok = Tokenizer.from_file(str(tokenizer_json))
    n = tok.get_vocab_size(with_added_tokens=True)
    key_to_new: dict[str, int] = {}
    lookup = [0] * n
    for token_id in range(n):
        text = tok.decode([token_id], skip_special_tokens=False)
        key = tok.id_to_token(token_id) if "\ufffd" in text else (normalizer.normalize_str(text) or text)
        lookup[token_id] = key_to_new.setdefault(key, len(key_to_new))
    return lookup, len(key_to_new)


def find_tokenizer_json(model_dir: str | Path, tokenizer: str | Path | None = None) -> Path:
    for d in (tokenizer, model_dir):
        if d is not None and (Path(d) / "tokenizer.json").exists():
            return Path(d) / "tokenizer.json"
    raise ValueError(f"{model_dir}: the Engram layers need the checkpoint's tokenizer.json (the hashes are "
                     "defined over its normalised vocabulary); none found")


class EngramHasher(torch.nn.Module):
    """Hash ids [T, L, (N-1) * heads] of packed tokens, given each token's N-1 predecessors."""

    def __init__(self, layer_ids: tuple[int, ...], max_ngram_size: int, n_heads: int, vocab_size: int,
                 compressed_vocab_size: int, pad_id: int):
        super().__init__()
        self.max_ngram_size, self.compressed_vocab_size, self.pad_token = max_ngram_size, compressed_vocab_size, pad_id
        self.layout = EngramLayout.build(len(layer_ids), max_ngram_size, n_heads, vocab_size)
        self.register_buffer("primes", torch.tensor(self.layout.primes), persistent=False)
        self.register_buffer("offsets", torch.tensor(self.layout.offsets), persistent=False)
        self.register_buffer("multipliers", hash_multipliers(layer_ids, max_ngram_size, compressed_vocab_size),
                             persistent=False)
        self.register_buffer("token_map", torch.empty(0, dtype=torch.long), persistent=False)
        self.pad_id = 0

    def bind_tokenizer(self, tokenizer_json: str | Path, vocab_size: int = 0) -> None:
        """vocab_size: the model's; ids past the tokenizer's (random test checkpoints only) hash as
        the pad token (transformers' lookup would fail on them)."""
        lookup, size = compressed_token_map(tokenizer_json)
        if size != self.compressed_vocab_size:
            raise ValueError(f"{tokenizer_json}: its normalised vocabulary has {size} ids but the config's "
                             f"engram_compressed_vocab_size is {self.compressed_vocab_size}: not this model's tokenizer")
        self.pad_id = lookup[self.pad_token]
        lookup += [self.pad_id] * (vocab_size - len(lookup))
        self.token_map = torch.tensor(lookup, dtype=torch.long, device=self.primes.device)

    def forward(self, input_ids: torch.Tensor, lookback: torch.Tensor) -> torch.Tensor:
        """input_ids [T]; lookback [T, N-1]: token ids at t-1, t-2, ... (DEAD before the start)."""
        if self.token_map.numel() == 0:
            raise RuntimeError("Engram hashing needs bind_tokenizer() first")
        tm = self.token_map
        prev = torch.where(lookback >= 0, tm[lookback.clamp_min(0)], DEAD)
        ids = torch.cat([tm[input_ids].unsqueeze(1), prev], dim=1)  # [T, N]: shift 0, 1, ...
        blocked = (ids == DEAD).long().cummax(dim=1).values.bool()  # an n-gram stops at the first DEAD
        tokens = torch.where(blocked, self.pad_id, ids)
        products = tokens.unsqueeze(1) * self.multipliers  # [T, L, N]
        rolling, out = products[..., 0], []
        for i in range(1, self.max_ngram_size):
            rolling = torch.bitwise_xor(rolling, products[..., i])
            out.append(rolling.unsqueeze(-1) % self.primes[:, i - 1])
        return torch.cat(out, dim=-1) + self.offsets
