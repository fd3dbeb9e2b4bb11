"""The CUDA-graph decode path packs a step into one flat buffer (the graph's static tensors are
views of it). On the CPU, where graphs do not run, check the packing itself: the real rows equal
what the eager path's build_batch gives, the padding rows what the captured batch was built with."""

import numpy as np
import torch

from engine.llm_engine import LLMEngine
from engine.request import GenerationRequest, SamplingParams


def test_packed_decode_rows_equal_build_batch_and_padding_rows_the_captured_batch(tiny_dir):
    eng = LLMEngine({"model": str(tiny_dir), "dtype": "float32", "max_model_len": 256})
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    for i, n in enumerate((5, 37, 70)):  # windows slid past their first blocks for the longer ones
        eng.add_request(GenerationRequest(f"r{i}", prompt_token_ids=[7 + (j * 13 + i) % 200 for j in range(n)],
                                          sampling=sp))
    for _ in range(30):
        eng.step()
    scheduled = eng.scheduler.schedule()
    assert len(scheduled) == 3 and all(k == 1 for _, k in scheduled)
    runner, size, n = eng.runner, 4, 3
    fb_pad, flat = runner._padding_batch(size)
    pad_host = flat.numpy().copy()
    host = np.full(flat.shape, 12345, dtype=np.int64)
    runner.pack_decode(scheduled, size, host)
    flat.copy_(torch.from_numpy(host))  # the views of the padding batch now hold this step
    want = runner.build_batch(scheduled)
    width = fb_pad.window_tables.shape[1]
    for name in ("input_ids", "positions", "window_slots", "replay_start_t", "state_slot_t"):
        assert getattr(fb_pad, name)[:n].tolist() == getattr(want, name).tolist(), name
    for name, fill in (("window_tables", -1), ("full_tables", 0)):
        got, ref = getattr(fb_pad, name)[:n], getattr(want, name)
        assert got[:, :ref.shape[1]].tolist() == ref.tolist(), name
        assert (got[:, ref.shape[1]:] == fill).all(), name
    assert (host[:5 * size].reshape(5, size)[:, n:] == pad_host[:5 * size].reshape(5, size)[:, n:]).all()
    tables, pad_tables = host[5 * size:].reshape(2, size, width), pad_host[5 * size:].reshape(2, size, width)
    assert (tables[:, n:] == pad_tables[:, n:]).all()
