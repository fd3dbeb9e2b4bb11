"""tools/mixed_diag.py: every mixed step run three ways from one cache state (unpadded eager,
padded eager, the graph side) and the first differing cache write named by layer and kind. On the
CPU the graph side is the padded batch run eagerly too, so a sound step shows no difference and a
step that writes one cache entry wrongly is named by its layer and write."""

import torch

from engine.graphs.mixed import MixedStepGraphs, mixed_sizes
from engine.llm import LLM
from engine.request import SamplingParams
from tools.mixed_diag import diagnose, max_diff


def _engine(path, mixed_cls=MixedStepGraphs):
    llm = LLM(str(path), dtype="float32", max_model_len=256, max_num_batched_tokens=32)
    eng = llm.engine
    eng.runner.mixed = mixed_cls(eng.model, eng.cache, eng.max_model_len, eng.args.max_num_seqs,
                                 mixed_sizes(eng.args.max_num_batched_tokens))
    return llm, eng


def _prompts():
    g = torch.Generator().manual_seed(2)
    return [torch.randint(5, 4000, (n,), generator=g).tolist() for n in (9, 40)]


PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True, logprobs=1)


def test_sound_mixed_steps_show_no_difference(tiny_dir):
    llm, eng = _engine(tiny_dir)
    plain = LLM(str(tiny_dir), dtype="float32", max_model_len=256, max_num_batched_tokens=32).generate(_prompts(), PARAMS)
    outs = []
    rows = diagnose(eng, lambda: outs.extend(llm.generate(_prompts(), PARAMS)))
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]  # the diagnosed run is the run
    mixed = [r for r in rows if r["path"] == "mixed"]
    assert len(mixed) >= 2 and len(mixed) == len(rows)  # no decode graphs on the CPU
    for r in mixed:
        assert r["first_difference"] is None and r["logits_graph_vs_padded_eager"] == 0.0, r
        assert r["logits_padded_vs_unpadded_eager"] <= 1e-4, r


def test_a_wrong_cache_write_is_named_by_layer_and_kind(tiny_dir):
    class WrongPending(MixedStepGraphs):  # the graph side leaves layer 1's compressor open-block rows off by one
        def run(self, scheduled, pending, fill_pending):
            out = super().run(scheduled, pending, fill_pending)
            self.cache.comp_state[1].pend_kv.add_(1.0)
            return out

    llm, eng = _engine(tiny_dir, WrongPending)
    assert eng.cfg.compress_ratios[1] and eng.cfg.compress_ratios[0] == 0  # layer 1 compresses, layer 0 slides
    rows = diagnose(eng, lambda: llm.generate(_prompts()[:1], PARAMS))
    d = rows[0]["first_difference"]
    assert d is not None and (d["layer"], d["write"]) == (1, "compressor state pend_kv"), d
    assert abs(d["max_abs_diff"] - 1.0) < 1e-5 and d["layers_differing"] == [1]
    assert rows[0]["logits_graph_vs_padded_eager"] == 0.0  # the step's own logits came out right


def test_max_diff_counts_nan_and_bool():
    a = torch.tensor([1.0, float("nan"), 3.0])
    assert max_diff(a, a.clone()) == 0.0
    assert max_diff(a, torch.tensor([1.0, 2.0, 3.0])) == float("inf")
    assert max_diff(torch.tensor([1.0, 2.0]), torch.tensor([1.5, 2.0])) == 0.5
    assert max_diff(torch.tensor([True, False]), torch.tensor([False, False])) == 1.0
