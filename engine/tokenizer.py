"""Tokenizer (HF tokenizers' tokenizer.json + tokenizer_config.json) and incremental detokenizer."""

from __future__ import annotations

import codecs
import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as _Tokenizer
from tokenizers import decoders


class Tokenizer:
    def __init__(self, path: str | Path):
        path = Path(path)
        if not (path / "tokenizer.json").exists():
            raise FileNotFoundError(f"{path}/tokenizer.json not found (the engine argument 'tokenizer' may point elsewhere)")
        self._tok = _Tokenizer.from_file(str(path / "tokenizer.json"))
        conf_path = path / "tokenizer_config.json"
        conf = json.loads(conf_path.read_text()) if conf_path.exists() else {}
        self.bos_token = self._token_str(conf.get("bos_token"))
        self.eos_token = self._token_str(conf.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.add_bos = bool(conf.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template = conf.get("chat_template")
        self.vocab_size = self._tok.get_vocab_size()
        # id -> (text, special) of added tokens, which decode as their text, not through the model
        self.added = {i: (t.content, t.special) for i, t in self._tok.get_added_tokens_decoder().items()}
        self.token_bytes = self._byte_level_table()

    def _byte_level_table(self) -> list[bytes] | None:
        """For a byte-level BPE (GPT-2 style, DeepSeek's): each model token's bytes, so that text can
        be decoded incrementally one token at a time. None for other decoders."""
        if not isinstance(self._tok.decoder, decoders.ByteLevel):
            return None
        byte_of = _byte_level_alphabet()
        vocab = self._tok.get_vocab(with_added_tokens=False)
        table = [b""] * (1 + max([*vocab.values(), *self.added], default=-1))  # ids need not be dense
        for token, i in vocab.items():
            try:
                table[i] = bytes(byte_of[c] for c in token)
            except KeyError:  # a character outside the alphabet: the token's own UTF-8, as the decoder does
                table[i] = token.encode("utf-8")
        return table

    @staticmethod
    def _token_str(tok) -> str | None:
        return tok.get("content") if isinstance(tok, dict) else tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast, not encode: the same ids without the character offsets nobody reads
        # (~0.6x the time), and it runs with the GIL released, where encode holds it throughout, so
        # the Triton stub's reader and response threads go on while a long prompt is tokenized
        ids = self._tok.encode_batch_fast([text], add_special_tokens=False)[0].ids
        if add_special_tokens and self.add_bos and not text.startswith(self.bos_token or "\0"):
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template")
        env = jinja2.Environment(undefined=jinja2.StrictUndefined)
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the printable character each byte is written as in a byte-level
    BPE vocabulary -> that byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)]
    char_of = {b: chr(b) for b in printable}
    for n, b in enumerate(b for b in range(256) if b not in char_of):
        char_of[b] = chr(256 + n)
    return {c: b for b, c in char_of.items()}


class Detokenizer:
    """Incremental and UTF-8 safe: a delta is emitted only once its bytes form whole
    characters (byte-level BPE splits multi-byte characters across tokens).

    Byte-level tokenizers take a table lookup and an incremental UTF-8 decoder per token (O(1),
    the same text as a full decode); others re-decode the tokens since the last whole character."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.bytes_of = tokenizer.token_bytes
        self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        if self.bytes_of is None:
            return self._push_by_decode(token_id)
        added = self.tok.added.get(token_id)
        if added is None:
            return self.utf8.decode(self.bytes_of[token_id]) if 0 <= token_id < len(self.bytes_of) else ""
        text, special = added
        if special and self.skip:
            return ""
        # an added token ends the byte run before it (a full decode decodes that run on its own)
        held = self.utf8.decode(b"", final=True)
        self.utf8.reset()
        return held + text

    def _push_by_decode(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        text = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""
