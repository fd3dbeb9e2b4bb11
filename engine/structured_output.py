"""Structured outputs (vLLM's `structured_outputs`: a JSON schema, a regex, a choice, an EBNF
grammar, or any JSON object) through xgrammar.

A spec is compiled off the step loop, each on a thread of its own (a schema that compiles for
a minute holds no queue), and cached by its canonical text (the same schema compiles once). A
request waits at most `budget_s` for its compile, then fails INVALID_ARG; xgrammar cannot stop a
compile, so at most `max_running` compiles run at once and the next is refused UNAVAILABLE until
one ends (a slow schema is retried later from the cache). A request gets its own matcher, which the sampler asks for the next
token bitmask each step and advances by the sampled token. The spec is plain data (strings,
lists, dicts), so it crosses a process boundary as is; the compiled grammar is built where the
sampler runs.

Why xgrammar rather than llguidance: vLLM's default backend (so its grammar semantics and JSON
schema coverage are what clients of vLLM already get), a pip wheel that installs next to
torch 2.13 CPU with no other native dependency, a batched bitmask applied in place on the
device (CUDA / Triton kernels, and a CPU path for tests), and EBNF grammars in the GBNF
dialect vLLM documents for its `grammar` key.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from engine.request import EngineOverloaded, InvalidRequest
from engine.tokenizer import Tokenizer

KINDS = ("json", "regex", "choice", "grammar", "json_object")
OPTIONS = ("disable_any_whitespace",)
_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\\r\n]'
MAX_CACHED = 512  # compiled grammars kept (least recently used go first)
# xgrammar's compile grows superlinearly with optional properties (1,000 of them: seconds; 2,000:
# a minute and more): a request waits this long for its grammar, then fails
COMPILE_BUDGET_S = 10.0
MAX_RUNNING = 4  # compiles running at once, finished or given up by their requests
REFUSAL_KEPT_S = 1.0  # a spec refused for MAX_RUNNING stays refused this long (its request's admission asks again)


def json_value(name: str, value: object) -> object:
    """`value` itself, or parsed when a client sent it as JSON text; InvalidRequest naming `name`."""
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except (json.JSONDecodeError, RecursionError) as e:
        raise InvalidRequest(f"{name} is not valid JSON: {e}") from None


def parse_spec(spec: object) -> tuple[str, object, bool]:
    """A structured_outputs dict -> (kind, value, any_whitespace); InvalidRequest naming the problem."""
    if not isinstance(spec, dict):
        raise InvalidRequest(f"structured_outputs must be an object with one of {', '.join(KINDS)}, got {spec!r}")
    unknown = sorted(set(spec) - set(KINDS) - set(OPTIONS))
    if unknown:
        raise InvalidRequest(f"structured_outputs has unknown key(s) {unknown}; supported: {', '.join(KINDS + OPTIONS)}")
    kinds = [k for k in KINDS if spec.get(k) not in (None, False)]
    if len(kinds) != 1:
        raise InvalidRequest(f"structured_outputs needs exactly one of {', '.join(KINDS)}, got {kinds or 'none'}")
    kind, value = kinds[0], spec[kinds[0]]
    if kind == "json":
        value = json_value("structured_outputs.json", value)
        if not isinstance(value, dict | bool):
            raise InvalidRequest(f"structured_outputs.json must be a JSON schema object, got {value!r}")
    elif kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise InvalidRequest(f"structured_outputs.choice must be a list of non-empty strings, got {value!r}")
    elif kind in ("regex", "grammar"):
        if not isinstance(value, str) or not value:
            raise InvalidRequest(f"structured_outputs.{kind} must be a non-empty string, got {value!r}")
    elif value is not True:
        raise InvalidRequest(f"structured_outputs.json_object must be true, got {value!r}")
    whitespace = spec.get("disable_any_whitespace", False)
    if not isinstance(whitespace, bool):
        raise InvalidRequest(f"structured_outputs.disable_any_whitespace must be a boolean, got {whitespace!r}")
    return kind, value, not whitespace


def _ebnf_literal(text: str) -> str:
    out = []
    for ch in text:
        if ch in '"\\':
            out.append("\\" + ch)
        elif ord(ch) < 0x20:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_grammar(choices: list[str]) -> str:
    """One of the strings, exactly (vLLM's choice)."""
    return "root ::= " + " | ".join(_ebnf_literal(c) for c in choices)


class GrammarCompiler:
    """Compiles specs, each on its own thread, and caches them; makes per-request matchers."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_token_ids: list[int], max_workers: int = 2,
                 budget_s: float = COMPILE_BUDGET_S, max_running: int = MAX_RUNNING):
        import xgrammar as xgr  # imported on first use: engines without structured outputs never load it

        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo(_encoded_vocab(tokenizer, vocab_size), xgr.VocabType.RAW, vocab_size=vocab_size,
                                 stop_token_ids=sorted(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=max_workers)
        self.budget_s = budget_s
        self.max_running = max_running
        self.running = threading.BoundedSemaphore(max_running)
        self.cache: OrderedDict[str, Future] = OrderedDict()
        self.over_budget: set[str] = set()  # specs still compiling past the budget: refused at once
        self.refused: dict[str, float] = {}  # spec -> when it was refused for MAX_RUNNING
        self.lock = threading.Lock()

    def compile(self, spec: dict) -> Future:
        """The compiled grammar of a spec, as a Future (done at once when cached) that fails with
        InvalidRequest when the spec is wrong or its compile outlasts the budget, EngineOverloaded
        when `max_running` compiles are running."""
        kind, value, any_ws = parse_spec(spec)
        key = json.dumps([kind, value, any_ws], sort_keys=True)
        with self.lock:
            future = self.cache.get(key)
            if future is not None:
                self.cache.move_to_end(key)
                if not future.done() and key in self.over_budget:
                    return _failed(self._over_budget_error(kind))
            elif (time.monotonic() - self.refused.get(key, -REFUSAL_KEPT_S) < REFUSAL_KEPT_S
                  or not self.running.acquire(blocking=False)):
                self.refused = {k: t for k, t in self.refused.items() if time.monotonic() - t < REFUSAL_KEPT_S}
                self.refused.setdefault(key, time.monotonic())
                return _failed(EngineOverloaded(f"{self.max_running} structured-output grammars are compiling; "
                                                "retry later"))
            else:
                future = Future()
                threading.Thread(target=self._run, args=(future, kind, value, any_ws), name="dsv4-grammar",
                                 daemon=True).start()
                self.cache[key] = future
                while len(self.cache) > MAX_CACHED:
                    self.cache.popitem(last=False)
        return future if future.done() else self._within_budget(future, key, kind)

    def _run(self, future: Future, kind: str, value, any_ws: bool) -> None:
        try:
            future.set_result(self._compile(kind, value, any_ws))
        except BaseException as e:  # noqa: BLE001 - the request sees it through the future
            future.set_exception(e)
        finally:
            self.running.release()

    def _over_budget_error(self, kind: str) -> InvalidRequest:
        return InvalidRequest(f"structured_outputs.{kind} did not compile within {self.budget_s:g} s (its compile "
                              "time grows fast with optional properties and alternatives): simplify it")

    def _within_budget(self, compiling: Future, key: str, kind: str) -> Future:
        """This request's view of a compile: its result, or InvalidRequest once budget_s has passed
        (from then on the spec is refused at once until its compile ends)."""
        view = Future()

        def settle(source: Future | None) -> None:
            with self.lock:
                if source is not None:
                    self.over_budget.discard(key)
                if view.done():
                    return
                if source is None:
                    self.over_budget.add(key)
                    view.set_exception(self._over_budget_error(kind))
                elif source.exception() is not None:
                    view.set_exception(source.exception())
                else:
                    view.set_result(source.result())

        timer = threading.Timer(self.budget_s, settle, args=(None,))
        timer.daemon = True
        timer.start()
        compiling.add_done_callback(lambda source: (timer.cancel(), settle(source)))
        return view

    def _compile(self, kind: str, value, any_ws: bool):
        c = self.compiler
        try:
            if kind == "json":
                ebnf = str(self.xgr.Grammar.from_json_schema(json.dumps(value), any_whitespace=any_ws))
                # xgrammar 0.2.9 lets raw control characters into length-bounded strings; JSON forbids them
                return c.compile_grammar(ebnf.replace(_BOUNDED_STRING_CHAR, _JSON_STRING_CHAR))
            if kind == "json_object":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(value)
            return c.compile_grammar(choice_grammar(value) if kind == "choice" else value)
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / ValueError with the reason
            reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", reason)  # xgrammar's "[time] file.cc:line: " prefix
            raise InvalidRequest(f"structured_outputs.{kind} cannot be compiled: {reason}") from None

    def matcher(self, spec: dict):
        """A fresh matcher for one request (waits for the compile if it is still running)."""
        return self.xgr.GrammarMatcher(self.compile(spec).result())

    def apply_bitmask(self, logits: torch.Tensor, matchers: list[tuple[int, object]]) -> None:
        """In place on fp32 logits: each (row, matcher)'s disallowed tokens to -inf, on the device."""
        xgr = self.xgr
        bitmask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for j, (_, m) in enumerate(matchers):
            m.fill_next_token_bitmask(bitmask, j)
        rows = [r for r, _ in matchers]
        target = logits[rows]
        xgr.apply_token_bitmask_inplace(target, bitmask.to(logits.device), vocab_size=self.vocab_size)
        logits[rows] = target

    def close(self) -> None:
        """Compiles still running end on their own (xgrammar cannot stop one); nothing waits for them."""


def _failed(error: BaseException) -> Future:
    future = Future()
    future.set_exception(error)
    return future


def _encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each id's bytes; special added tokens (and ids the tokenizer lacks) are empty: never inside a grammar."""
    table = tokenizer.token_bytes
    vocab = []
    for i in range(vocab_size):
        added = tokenizer.added.get(i)
        if added is not None:
            vocab.append(b"" if added[1] else added[0].encode("utf-8"))
        elif table is not None:
            vocab.append(table[i] if i < len(table) else b"")
        else:
            vocab.append(tokenizer.decode([i], skip_special_tokens=False).encode("utf-8"))
    return vocab
