"""What a model family declares to the engine. The engine reads these once (at load, when it
builds the cache, the runner and the graphs) and never probes a model with hasattr.

A family's model class subclasses `ModelFamily` and overrides what differs; the defaults are
DeepSeek-V4's (the family the engine was built around)."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from engine.cache import KVCache
from engine.models.config import DeepseekConfig


class ModelFamily(nn.Module):
    # the paged cache this family's layers read and write (a subclass of engine/cache.py's KVCache)
    cache_class: ClassVar[type[KVCache]] = KVCache
    supports_cuda_graphs: ClassVar[bool] = True
    supports_mixed_graphs: ClassVar[bool] = True  # prefill chunks and decodes in one padded graph
    supports_tensor_parallel: ClassVar[bool] = False  # heads and experts split over ranks (engine/parallel.py)
    supports_prompt_logprobs: ClassVar[bool] = False  # needs hidden_states() + compute_logits()
    # speculative methods (engine/spec/): "mtp" needs mtp_draft(), "dspark" dspark_draft() and dspark_features()
    speculative_methods: ClassVar[tuple[str, ...]] = ()
    # the layers after the last KV source may run on each sequence's last window only at prefill
    # (an approximation, measured); engine argument swa_decoder_trim sets it
    supports_decoder_trim: ClassVar[bool] = False
    # Engram tables in host memory (engine argument engram_tables; V4.1)
    supports_host_engram: ClassVar[bool] = False

    cfg: DeepseekConfig  # the family's config

    @property
    def lookback_tokens(self) -> int:
        """How many tokens before each row the runner passes in ForwardBatch.lookback_ids (Engram)."""
        return 0

    @property
    def compressed_ratios(self) -> list[int]:
        """The compress ratios the step's compressor plans are built for, ascending."""
        return sorted({r for r in self.cfg.compress_ratios if r})

    @property
    def needs_host_tokens(self) -> bool:
        """The step's input tokens must be on the host when it is packed (no async scheduling): a
        decode graph's replay is preceded by prefetch_host_inputs."""
        return False

    def prefetch_host_inputs(self, size: int, input_ids, lookback) -> None:
        """Before a decode graph of `size` rows is captured (its padding batch) and before each replay:
        host arrays of its input ids [size] and look-back ids [size, k] (needs_host_tokens)."""

    def refuses_token(self, ids: list[int]) -> str | None:
        """Why a prompt with these token ids cannot be served (None: it can)."""
        return None

    def set_decoder_trim(self, on: bool) -> None:
        if on:
            raise ValueError(f"{type(self).__name__} has no decoder trim")

    def mixed_rows(self, cache: KVCache):
        """This family's own fields of a padded mixed step (engine/graphs/mixed.py); None: none."""
        return None

    def mixed_split(self, cache: KVCache, sizes: list[int], max_num_seqs: int, width: int, max_model_len: int):
        """A padded mixed step as two graphs (engine/graphs/mixed.py); None: one graph per size."""
        return None

    def hidden_states(self, fb, cache: KVCache) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not expose its hidden states")

    def mtp_draft(self):
        """The MTP draft module built from this model's `mtp.*` weights (speculative_methods has "mtp")."""
        raise NotImplementedError(f"{type(self).__name__} has no MTP draft")

    def dspark_draft(self):
        """The DSpark drafter built from this model's `mtp.*` stages (speculative_methods has "dspark")."""
        raise NotImplementedError(f"{type(self).__name__} has no DSpark drafter")

    def dspark_features(self, fb, cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
        """(hidden_states, the DSpark target features of every row) in one forward."""
        raise NotImplementedError(f"{type(self).__name__} exposes no DSpark target features")
