"""Chat messages -> prompt text, and the thinking / answer split of what comes back.

The template is the checkpoint's own (`chat_template` in tokenizer_config.json); a checkpoint
without one, or `--chat-template deepseek_v4`, gets DeepSeek's format shipped in templates/.
Rendering follows transformers' `apply_chat_template` (sandboxed Jinja, trim_blocks,
lstrip_blocks, `raise_exception`, `tojson`), so templates written for it render the same here."""

from __future__ import annotations

import json
from pathlib import Path

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from backend.openai.errors import bad_request

TEMPLATES = Path(__file__).parent / "templates"
SHIPPED = "deepseek_v4"
THINK_START, THINK_END = "<think>", "</think>"
DEEPSEEK_BOS, DEEPSEEK_EOS = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"


def _raise(message: str):
    raise jinja2.TemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.globals["raise_exception"] = _raise
        env.filters["tojson"] = lambda value, indent=None: json.dumps(value, ensure_ascii=False, indent=indent)
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def load(cls, tokenizer_dir: str | None = None, override: str | None = None) -> ChatTemplate:
        """`override`: a template file, or the name of a shipped one; else the checkpoint's own."""
        config = {}
        if tokenizer_dir and (Path(tokenizer_dir) / "tokenizer_config.json").exists():
            config = json.loads((Path(tokenizer_dir) / "tokenizer_config.json").read_text(encoding="utf-8"))
        source = config.get("chat_template")
        if isinstance(source, list):  # transformers' named templates: [{"name": "default", "template": ...}]
            source = next((t["template"] for t in source if t.get("name") == "default"), None)
        if override:
            path = Path(override) if Path(override).exists() else TEMPLATES / f"{override}.jinja"
            source = path.read_text(encoding="utf-8")
        elif not source:
            source = (TEMPLATES / f"{SHIPPED}.jinja").read_text(encoding="utf-8")
        if not config:  # no checkpoint to ask: DeepSeek's special tokens
            return cls(source, DEEPSEEK_BOS, DEEPSEEK_EOS)
        return cls(source, _token(config.get("bos_token")) or "", _token(config.get("eos_token")) or "")

    def render(self, messages: list[dict], add_generation_prompt: bool = True, **kwargs) -> str:
        """OpenAI messages (content a string or a list of text parts) -> prompt text; a template
        error (an unsupported role, ...) is the client's: 400."""
        plain = [{**m, "content": _text_content(m.get("content"))} for m in messages]
        try:
            return self.template.render(messages=plain, add_generation_prompt=add_generation_prompt,
                                        bos_token=self.bos_token, eos_token=self.eos_token, **kwargs)
        except jinja2.TemplateError as e:
            raise bad_request(f"messages cannot be rendered by the chat template: {e}", "messages") from e


def opens_thinking(prompt: str) -> bool:
    """The template left the model inside a thinking block: its text is reasoning until </think>."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningSplitter:
    """Streamed text -> (reasoning, content) deltas, split at the first </think>; a tail that may be
    the start of a marker is held back until the next delta decides. `calls_start` (a tool-call
    block's opening tag) also ends the reasoning, and stays in the content: a model that forgets
    </think> before calling a tool still calls it."""

    def __init__(self, thinking: bool, calls_start: str | None = None):
        self.thinking = thinking
        self.ends = [(THINK_END, False)] + ([(calls_start, True)] if calls_start else [])
        self.held = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.thinking:
            return "", text
        text = self.held + text
        self.held = ""
        found = [(text.find(marker), marker, kept) for marker, kept in self.ends if marker in text]
        if found:
            end, marker, kept = min(found)
            self.thinking = False
            return text[:end], text[end if kept else end + len(marker):]
        keep = max(partial_suffix(text, marker) for marker, _ in self.ends)
        self.held = text[len(text) - keep:] if keep else ""
        return text[:len(text) - keep], ""

    def flush(self) -> tuple[str, str]:
        held, self.held = self.held, ""
        return (held, "") if self.thinking else ("", held)


def partial_suffix(text: str, marker: str) -> int:
    """How many of the text's last characters could begin `marker`."""
    return next((n for n in range(min(len(marker) - 1, len(text)), 0, -1) if marker.startswith(text[-n:])), 0)


def _token(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _text_content(content) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise bad_request("only text content parts are supported ({'type': 'text', 'text': ...})",
                                  "messages")
            parts.append(part["text"])
        return "".join(parts)
    raise bad_request("message content must be a string or a list of text parts", "messages")
