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
    def __init__(self, kind: str, model: str, top_logprobs: int | None, echo: str | None = None):
        self.kind = kind  # "completion" | "chat"
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.top_logprobs = top_logprobs  # None: logprobs off
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text_offset = 0  # completions' logprobs.text_offset runs over the whole output
        self.echo = echo  # completions' echoed prompt: its tokens lead the logprobs (vLLM's echo + logprobs)

    def count(self, output: Output) -> None:
        if output.num_input_tokens is not None:
            self.prompt_tokens = output.num_input_tokens
        self.completion_tokens += output.num_output_tokens

    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}

    # ------------------------------------------------------------------ logprobs

    def completion_logprobs(self, output: Output) -> dict | None:
        if self.top_logprobs is None:
            return None
        tokens, token_logprobs, tops, offsets = [], [], [], []

        def add(token: str, logprob: float | None, top: dict | None) -> None:
            tokens.append(token)
            token_logprobs.append(logprob)
            tops.append(top)
            offsets.append(self.text_offset)
            self.text_offset += len(token)

        steps = output.logprobs or []
        if self.echo is not None and output.prompt_logprobs is not None:
            prompt = [s for s in output.prompt_logprobs if s is not None]
            # the first prompt token has no logprob (None, as vLLM) and no id here: its text is the
            # echo before the others' (empty for a BOS the tokenizer added)
            rest = "".join(next(iter(s.values()))["decoded_token"] or "" for s in prompt)
            add(self.echo[:len(self.echo) - len(rest)] if self.echo.endswith(rest) else "", None, None)
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

    def completion(self, text: str, output: Output) -> dict:
        choice = {"index": 0, "text": text, "logprobs": self.completion_logprobs(output),
                  "finish_reason": output.finish_reason}
        if output.prompt_logprobs is not None:  # vLLM's extra field (prompt_logprobs, or echo with logprobs)
            choice["prompt_logprobs"] = prompt_logprobs(output)
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [choice], "usage": self.usage()}

    def chat(self, content: str, reasoning: str | None, output: Output) -> dict:
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        body = {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": self.chat_logprobs(output),
                             "finish_reason": output.finish_reason}],
                "usage": self.usage()}
        if output.prompt_logprobs is not None:  # vLLM's extra field, beside the choices
            body["prompt_logprobs"] = prompt_logprobs(output)
        return body

    def completion_chunk(self, text: str, output: Output | None) -> dict:
        choice = {"index": 0, "text": text, "logprobs": None if output is None else self.completion_logprobs(output),
                  "finish_reason": None if output is None else output.finish_reason}
        return self._chunk("text_completion", [choice])

    def chat_chunk(self, delta: dict, output: Output | None) -> dict:
        choice = {"index": 0, "delta": delta, "logprobs": None if output is None else self.chat_logprobs(output),
                  "finish_reason": None if output is None else output.finish_reason}
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
