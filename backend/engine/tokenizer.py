"""Tokenizer (HF tokenizers' tokenizer.json + tokenizer_config.json) and incremental detokenizer."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from tokenizers import Tokenizer as _Tokenizer


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

    @staticmethod
    def _token_str(tok) -> str | None:
        return tok.get("content") if isinstance(tok, dict) else tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
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


class Detokenizer:
    """Incremental and UTF-8 safe: a delta is emitted only once its bytes form whole
    characters (byte-level BPE splits multi-byte characters across tokens)."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tokenizer, skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prefix = self.tok.decode(self.ids[self.prefix_offset:self.read_offset], self.skip)
        text = self.tok.decode(self.ids[self.prefix_offset:], self.skip)
        if len(text) > len(prefix) and not text.endswith("\ufffd"):
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            return text[len(prefix):]
        return ""
