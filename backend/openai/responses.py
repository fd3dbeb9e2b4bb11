"""Triton outputs -> OpenAI response bodies and stream chunks.

Each request's Builder keeps what both forms need: the id, the token counts for `usage`, and the
logprobs in the shape each endpoint wants (completions: parallel lists; chat: one object per
token). The sampled token is the first entry of each logprobs step (backend/protocol.py), the prompt
token the first of each prompt_logprobs step."""

from __future__ import annotations

import time
import uuid

from backend.openai.triton import Output


class Builder:
    def __init__(self, kind: str, model: str, top_logprobs: int | None, echoes: list[str] | None = None):
        self.kind = kind  # "completion" | "chat"
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.top_logprobs = top_logprobs  # None: logprobs off
        self.prompt_tokens: dict[int, int] = {}  # per prompt: n choices of one prompt count it once
        self.completion_tokens = 0
        self.text_offsets: dict[int, int] = {}  # per choice: completions' logprobs.text_offset runs over its output
        self.echoes = echoes  # per choice, completions' echoed prompt: its tokens lead the logprobs (vLLM's)

    def count(self, output: Output, prompt_index: int = 0) -> None:
        if output.num_input_tokens is not None:
            self.prompt_tokens[prompt_index] = output.num_input_tokens
        self.completion_tokens += output.num_output_tokens

    def usage(self) -> dict:
        prompt = sum(self.prompt_tokens.values())
        return {"prompt_tokens": prompt, "completion_tokens": self.completion_tokens,
                "total_tokens": prompt + self.completion_tokens}

    # ------------------------------------------------------------------ logprobs

    def completion_logprobs(self, output: Output, index: int = 0) -> dict | None:
        if self.top_logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []

        def add(token: str, logprob: float | None, top: dict | None) -> None:
            tokens.append(token)
            token_logprobs.append(logprob)
            tops.append(top)
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(token)

        steps = output.logprobs or []
        echo = self.echoes[index] if self.echoes else None
        if echo is not None and output.prompt_logprobs is not None:
            prompt = [s for s in output.prompt_logprobs if s is not None]
            # the first prompt token has no logprob (None, as vLLM) and no id here: its text is the
            # echo before the others' (empty for a BOS the tokenizer added)
            rest = "".join(next(iter(s.values()))["decoded_token"] or "" for s in prompt)
            add(echo[:len(echo) - len(rest)] if echo.endswith(rest) else "", None, None)
            steps = prompt + steps
        for step in steps:
            sampled = next(iter(step.values()))
            add(sampled["decoded_token"] or "", _clamp(sampled["logprob"]),
                {e["decoded_token"] or "": _clamp(e["logprob"]) for e in self._top(step)})
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}

    def chat_logprobs(self, output: Output) -> dict | None:
        if self.top_logprobs is None:
            return None
        content = []
        for step in output.logprobs or []:
            sampled = next(iter(step.values()))
            content.append({**_chat_token(sampled), "top_logprobs": [_chat_token(e) for e in self._top(step)]})
        return {"content": content}

    def _top(self, step: dict) -> list[dict]:
        """The step's top-n (rank <= n) in rank order: the sampled token only when it is one of them."""
        return sorted((e for e in step.values() if e["rank"] <= self.top_logprobs), key=lambda e: e["rank"])

    # ------------------------------------------------------------------ bodies and chunks

    def completion_choice(self, index: int, text: str, output: Output) -> dict:
        choice = {"index": index, "text": text, "logprobs": self.completion_logprobs(output, index),
                  "finish_reason": output.finish_reason}
        if output.prompt_logprobs is not None:  # vLLM's extra field (prompt_logprobs, or echo with logprobs)
            choice["prompt_logprobs"] = prompt_logprobs(output)
        return choice

    def completion(self, choices: list[dict]) -> dict:
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}

    def chat_choice(self, index: int, message: dict, output: Output, finish_reason: str | None) -> dict:
        return {"index": index, "message": message, "logprobs": self.chat_logprobs(output),
                "finish_reason": finish_reason}

    def chat(self, choices: list[dict], first: Output) -> dict:
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": choices, "usage": self.usage()}
        if first.prompt_logprobs is not None:  # vLLM's extra field, beside the choices
            body["prompt_logprobs"] = prompt_logprobs(first)
        return body

    def completion_chunk(self, index: int, text: str, output: Output | None) -> dict:
        choice = {"index": index, "text": text,
                  "logprobs": None if output is None else self.completion_logprobs(output, index),
                  "finish_reason": None if output is None else output.finish_reason}
        return self._chunk("text_completion", [choice])

    def chat_chunk(self, index: int, delta: dict, output: Output | None, finish_reason: str | None = None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": None if output is None else self.chat_logprobs(output),
                  "finish_reason": finish_reason}
        return self._chunk("chat.completion.chunk", [choice])

    def usage_chunk(self) -> dict:
        """stream_options.include_usage: a last chunk with no choices and the usage."""
        return {**self._chunk("text_completion" if self.kind == "completion" else "chat.completion.chunk", []),
                "usage": self.usage()}

    def _chunk(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)  # vLLM's (and OpenAI's) stand-in for -inf, which JSON cannot carry


def prompt_logprobs(output: Output) -> list[dict | None]:
    """vLLM's prompt_logprobs field: None, then {token id: {"logprob", "rank", "decoded_token"}} per token."""
    return [None if step is None else {t: {**e, "logprob": _clamp(e["logprob"])} for t, e in step.items()}
            for step in output.prompt_logprobs]


def _chat_token(entry: dict) -> dict:
    token = entry["decoded_token"] or ""
    return {"token": token, "logprob": entry["logprob"], "bytes": list(token.encode("utf-8"))}
