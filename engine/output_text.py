"""A request's output text: incremental detokenization, stop strings, and the text held back.

One implementation for both places that turn token ids into text: the in-process engine
(`LLMEngine` with detokenization on) and the front process of the engine core
(`engine/core_client.py`), whose core ships token ids only.
"""

from __future__ import annotations

from engine.request import SamplingParams
from engine.tokenizer import Detokenizer, Tokenizer


class OutputText:
    def __init__(self, tokenizer: Tokenizer, sampling: SamplingParams):
        self.detok = Detokenizer(tokenizer, sampling.skip_special_tokens)
        self.stop, self.min_tokens = sampling.stop, sampling.min_tokens
        self.stop_len = max(map(len, sampling.stop), default=0)  # the longest stop string
        self.text = ""  # not handed out yet (held back while it may be the start of a stop string)

    def push(self, token: int, num_output_tokens: int) -> bool:
        """Add one generated token (not an EOS / stop token: those add no text); True when a stop
        string now matches (the text is cut before it: the request ends with "stop")."""
        new = self.detok.push(token)
        self.text += new
        if self.stop and num_output_tokens >= self.min_tokens:
            # a new match ends in the new text (the text before it was searched on earlier tokens;
            # stop strings count from min_tokens on)
            start = max(0, len(self.text) - len(new) - self.stop_len + 1)
            hits = [i for s in self.stop if (i := self.text.find(s, start)) >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                return True
        return False

    def take(self, finished: bool) -> str:
        """The text that may go out now: never the start of a stop string that may still
        complete; what is held back is also all the earlier text a stop string can match into."""
        end = len(self.text) if finished else max(0, len(self.text) - max(0, self.stop_len - 1))
        text, self.text = self.text[:end], self.text[end:]
        return text
