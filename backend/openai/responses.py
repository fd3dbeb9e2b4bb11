"""Triton outputs -> OpenAI response bodies and stream chunks.

Each request's Builder keeps what both forms need: the id, the token counts for `usage`, and the
logprobs in the shape each endpoint wants (completions: parallel lists; chat: one object per
token). The sampled token is the first entry of each logprobs step (backend/protocol.py)."""

from __future__ import annotations

import time
import uuid

from backend.openai.triton import Output


class Builder:
    def __init__(self, kind: str, model: str, top_logprobs: int | None):
        self.kind = kind  # "completion" | "chat"
        self.id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.model = model
        self.top_logprobs = top_logprobs  # None: logprobs off
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.text_offset = 0  # completions' logprobs.text_offset runs over the whole output

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
        for step in output.logprobs or []:
            sampled = next(iter(step.values()))
            tokens.append(sampled["decoded_token"] or "")
            token_logprobs.append(sampled["logprob"])
            tops.append({e["decoded_token"] or "": e["logprob"] for e in self._top(step)})
            offsets.append(self.text_offset)
            self.text_offset += len(tokens[-1])
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
        return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "text": text, "logprobs": self.completion_logprobs(output),
                             "finish_reason": output.finish_reason}],
                "usage": self.usage()}

    def chat(self, content: str, reasoning: str | None, output: Output) -> dict:
        message = {"role": "assistant", "content": content}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": message, "logprobs": self.chat_logprobs(output),
                             "finish_reason": output.finish_reason}],
                "usage": self.usage()}

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


def _chat_token(entry: dict) -> dict:
    token = entry["decoded_token"] or ""
    return {"token": token, "logprob": entry["logprob"], "bytes": list(token.encode("utf-8"))}
