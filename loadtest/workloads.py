"""What the load-test users send: token-exact random prompts, multi-turn agentic conversations
over one shared system prompt, or prompts from a file.

    workload = make_workload(WorkloadConfig(kind="agentic", tokenizer="/models/ckpt"))
    session = workload.session(user_index)     # one per Locust user
    request = session.next_request()           # Request(prompt, max_tokens, prompt_tokens, ...)
    session.on_reply(request, generated_text)  # agentic: the reply joins the conversation

Lengths are counted with the model's own tokenizer (tokenizer.json via `tokenizers`, the same
`engine.tokenizer.Tokenizer` the engine uses), so `prompt_tokens` is what the server counts
(`num_input_tokens`, begin-of-sentence token included). Output lengths are exact through
`max_tokens` with `ignore_eos`.
"""

from __future__ import annotations

import json
import random
import re
from dataclasses import dataclass, field
from pathlib import Path

from client.chat import ASSISTANT, USER
from client.types import MODEL
from engine.tokenizer import Tokenizer

# A token usable as a word: a leading space, then ASCII letters only. Byte-level pre-tokenizers
# (DeepSeek's, the tiny checkpoint's) split text before every " word", so a string of such tokens
# encodes back to exactly those tokens.
_WORD = re.compile(r"^ [A-Za-z]{2,}$")


@dataclass(frozen=True)
class Length:
    """A token count: fixed ("128") or drawn uniformly from a range ("64:256")."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str | int) -> Length:
        if isinstance(text, int):
            return cls(text, text)
        low, _, high = str(text).partition(":")
        lo, hi = int(low), int(high or low)
        if lo < 1 or hi < lo:
            raise ValueError(f"length {text!r}: want N or LOW:HIGH with 1 <= LOW <= HIGH")
        return cls(lo, hi)

    def draw(self, rng: random.Random) -> int:
        return self.low if self.low == self.high else rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}:{self.high}"


@dataclass
class Request:
    prompt: str
    max_tokens: int
    prompt_tokens: int  # as the server counts them (special tokens included)
    session: str = ""
    turn: int = 0


class TokenText:
    """Text of an exact number of tokens, and token counts, for one tokenizer."""

    def __init__(self, tokenizer_dir: str | Path):
        self.tokenizer = Tokenizer(tokenizer_dir)
        self.words = self._single_token_words()
        if not self.words:
            raise ValueError(f"tokenizer {tokenizer_dir}: no ' word' tokens found to build token-exact text")

    def _single_token_words(self) -> list[str]:
        tok, words = self.tokenizer, []
        for token_id in range(tok.vocab_size):
            text = tok.decode([token_id], skip_special_tokens=False)
            if _WORD.match(text) and tok.encode(text, add_special_tokens=False) == [token_id]:
                words.append(text)
        return words

    def count(self, text: str, add_special_tokens: bool = True) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def text(self, n: int, rng: random.Random) -> str:
        """`n` random word tokens; checked by encoding (and repaired, should a merge ever cross a word)."""
        words = rng.choices(self.words, k=n)
        for _ in range(8):
            have = self.count("".join(words), add_special_tokens=False)
            if have == n:
                break
            if have > n:
                del words[n - have:]
            else:
                words += rng.choices(self.words, k=n - have)
        return "".join(words)


@dataclass
class WorkloadConfig:
    kind: str = "random"  # random | agentic | prompts
    tokenizer: str = ""  # tokenizer dir (tokenizer.json); "" = the tiny checkpoint's
    input_len: str = "256"  # random: prompt tokens, N or LOW:HIGH
    output_len: str = "64"  # every workload: max_tokens, N or LOW:HIGH
    system_len: int = 512  # agentic: shared system prompt tokens
    turn_len: str = "64"  # agentic: tokens of each new user message
    turns: int = 6  # agentic: turns per conversation, then a new conversation starts
    prompts_file: str = ""  # prompts: .jsonl ({"prompt": ..., "max_tokens": ...}) or .txt (one a line)
    seed: int = 0

    @classmethod
    def from_dict(cls, raw: dict) -> WorkloadConfig:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown workload settings {unknown}; known: {sorted(known)}")
        return cls(**raw)


@dataclass
class LoadConfig:
    """One load run, for either driver (Locust's users, the thread reference); the sweep writes it
    as JSON per level."""

    workload: dict = field(default_factory=dict)  # WorkloadConfig fields
    url: str = ""  # host:port for the protocol
    model: str = MODEL
    temperature: float = 0.0
    ignore_eos: bool = True  # output lengths exactly max_tokens
    request_timeout_s: float = 600.0
    level_seed: int = 0  # varies the prompts per level
    records: str = ""  # JSON-lines file for per-request records ("" = none)

    @classmethod
    def load(cls, path: str | None) -> LoadConfig:
        return cls(**json.loads(Path(path).read_text())) if path else cls()

    def sampling(self, request: Request) -> dict:
        """Sampling keys (vLLM's names) for the request."""
        return {"max_tokens": request.max_tokens, "temperature": self.temperature,
                **({"ignore_eos": True} if self.ignore_eos else {})}


def resolve_tokenizer(path: str) -> Path:
    if path and path != "tiny":
        return Path(path).expanduser()
    from engine.args import tiny_checkpoint_dir

    return tiny_checkpoint_dir()


class Session:
    """One user's stream of requests."""

    def next_request(self) -> Request:
        raise NotImplementedError

    def on_reply(self, request: Request, text: str) -> None:
        """The generated text of `request` (called only when it succeeded)."""


class _RandomSession(Session):
    def __init__(self, workload: RandomWorkload, rng: random.Random, name: str):
        self.w, self.rng, self.name, self.count = workload, rng, name, 0

    def next_request(self) -> Request:
        w = self.w
        prompt = w.text.text(w.input_len.draw(self.rng), self.rng)
        self.count += 1
        return Request(prompt, w.output_len.draw(self.rng), w.text.count(prompt), self.name, self.count)


class RandomWorkload:
    """Independent prompts of random words: no two share a prefix block."""

    def __init__(self, cfg: WorkloadConfig, text: TokenText):
        self.cfg, self.text = cfg, text
        self.input_len, self.output_len = Length.parse(cfg.input_len), Length.parse(cfg.output_len)

    def session(self, user: int, level_seed: int = 0) -> Session:
        return _RandomSession(self, random.Random(f"{self.cfg.seed}-{level_seed}-{user}"), f"u{user}")


class _AgenticSession(Session):
    """System prompt, then turns: user message, assistant reply, ... Each request is the whole
    conversation so far, so consecutive requests share everything but the newest message."""

    def __init__(self, workload: AgenticWorkload, rng: random.Random, user: int):
        self.w, self.rng, self.user = workload, rng, user
        self.conversation = 0
        self._new_conversation()

    def _new_conversation(self) -> None:
        self.conversation += 1
        self.messages: list[dict] = []
        self.turn = 0

    def next_request(self) -> Request:
        w = self.w
        if self.turn >= w.cfg.turns:
            self._new_conversation()
        self.turn += 1
        self.messages.append({"role": "user", "content": w.text.text(w.turn_len.draw(self.rng), self.rng)})
        prompt = w.render(self.messages)
        return Request(prompt, w.output_len.draw(self.rng), w.text.count(prompt),
                       f"u{self.user}-c{self.conversation}", self.turn)

    def on_reply(self, request: Request, text: str) -> None:
        if request.turn == self.turn and self.messages and self.messages[-1]["role"] == "user":
            self.messages.append({"role": "assistant", "content": text})


class AgenticWorkload:
    """Multi-turn agentic traffic: every conversation starts with the same system prompt and grows
    by a user message and the model's reply per turn, the shape that prefix caching (and SWA bounded
    replay) is for."""

    def __init__(self, cfg: WorkloadConfig, text: TokenText):
        self.cfg, self.text = cfg, text
        self.turn_len, self.output_len = Length.parse(cfg.turn_len), Length.parse(cfg.output_len)
        self.system = text.text(cfg.system_len, random.Random(f"{cfg.seed}-system")) if cfg.system_len else ""

    def render(self, messages: list[dict]) -> str:
        """The tokenizer's chat template when it has one, else DeepSeek's format."""
        full = ([{"role": "system", "content": self.system}] if self.system else []) + messages
        tok = self.text.tokenizer
        if tok.chat_template:
            return tok.apply_chat_template(full, add_generation_prompt=True)
        eos = tok.eos_token or ""
        parts = [tok.bos_token or ""]
        for m in full:
            if m["role"] == "system":
                parts.append(m["content"])
            elif m["role"] == "user":
                parts.append(f"{USER}{m['content']}")
            else:
                parts.append(f"{ASSISTANT}{m['content']}{eos}")
        return "".join(parts) + ASSISTANT

    def session(self, user: int, level_seed: int = 0) -> Session:
        return _AgenticSession(self, random.Random(f"{self.cfg.seed}-{level_seed}-{user}"), user)


class _PromptsSession(Session):
    def __init__(self, workload: PromptsWorkload, start: int, rng: random.Random, name: str):
        self.w, self.i, self.rng, self.name = workload, start, rng, name

    def next_request(self) -> Request:
        prompt, max_tokens = self.w.prompts[self.i % len(self.w.prompts)]
        self.i += 1
        if max_tokens is None:
            max_tokens = self.w.output_len.draw(self.rng)
        return Request(prompt, max_tokens, self.w.text.count(prompt), self.name, self.i)


class PromptsWorkload:
    """Prompts from a file, taken in order (each user starts at its own offset)."""

    def __init__(self, cfg: WorkloadConfig, text: TokenText):
        self.cfg, self.text = cfg, text
        self.output_len = Length.parse(cfg.output_len)
        self.prompts = load_prompts(cfg.prompts_file)

    def session(self, user: int, level_seed: int = 0) -> Session:
        return _PromptsSession(self, user * 7919, random.Random(f"{self.cfg.seed}-{level_seed}-{user}"),
                               f"u{user}")


def load_prompts(path: str) -> list[tuple[str, int | None]]:
    """.jsonl: one object a line with "prompt" (or "text"), optional "max_tokens"; else one prompt
    a line (blank lines skipped)."""
    if not path:
        raise ValueError("the prompts workload needs --prompts-file")
    out: list[tuple[str, int | None]] = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if path.endswith(".jsonl"):
            try:
                obj = json.loads(line)
                prompt = obj.get("prompt", obj.get("text"))
            except (json.JSONDecodeError, AttributeError):
                raise ValueError(f"{path}:{n}: not a JSON object") from None
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"{path}:{n}: no \"prompt\" string")
            max_tokens = obj.get("max_tokens")
            out.append((prompt, None if max_tokens is None else int(max_tokens)))
        else:
            out.append((line, None))
    if not out:
        raise ValueError(f"{path}: no prompts")
    return out


WORKLOADS = {"random": RandomWorkload, "agentic": AgenticWorkload, "prompts": PromptsWorkload}


def make_workload(cfg: WorkloadConfig) -> RandomWorkload | AgenticWorkload | PromptsWorkload:
    """Built once per Locust process: the tokenizer, its word list, the system prompt."""
    if cfg.kind not in WORKLOADS:
        raise ValueError(f"unknown workload {cfg.kind!r}; one of {sorted(WORKLOADS)}")
    text = TokenText(resolve_tokenizer(cfg.tokenizer))
    return WORKLOADS[cfg.kind](cfg, text)
