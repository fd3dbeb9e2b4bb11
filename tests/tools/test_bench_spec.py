"""tools/bench_spec.py on the CPU (tiny default checkpoint): the forced leg replays the
speculative run's own outputs, so every draft is accepted and the streams are the same; the
step-time legs run (the verify "graph" as its padded batch, eagerly) and the speed-up model."""

from engine.llm import LLM
from tools import bench_spec as bs

SPEC = {"method": "mtp", "num_speculative_tokens": 3}


def test_forced_drafts_replay_the_speculative_run_and_all_agree():
    eng = LLM("", dtype="float32", max_model_len=64, max_num_seqs=2, speculative_config=SPEC).engine
    r = bs.end_to_end(eng, eng.spec, batch=2, input_len=12, output_len=8)
    assert r["mtp_same_as_plain"] == 2  # greedy: speculation never changes the tokens
    assert r["mtp_acceptance"] < 0.5  # the random MTP's drafts
    assert r["forced_acceptance"] == 1.0 and r["forced_same_as_mtp"] == 2
    assert sum(r["forced_step_paths"].values()) > 0 and eng.spec.forced_drafts is None and eng.spec is not None


def test_step_times_and_the_speedup_model_run():
    eng = LLM("", dtype="float32", max_model_len=128, max_num_seqs=2, speculative_config=SPEC).engine
    row = bs.micro(eng, eng.spec, batch=2, input_len=20, reps=1)
    for k in (1, 2, 3):
        assert min(row[f"verify_k{k}_ms"], row[f"verify_k{k}_eager_ms"], row[f"mtp_rows{k + 1}_ms"],
                   row[f"draft_graph_k{k}_ms"]) > 0
    # at acceptance 1 a step yields k + 1 tokens: the modelled speed-up is exactly that over its cost ratio
    model, eager = bs.model_speedup(row), bs.model_speedup(row, graphs=False)
    assert abs(model["k3_a1"] - 4 * row["plain_ms"] / (row["verify_k3_ms"] + row["draft_graph_k3_ms"])) < 1e-9
    cost = row["verify_k3_eager_ms"] + row["mtp_rows4_ms"] + 2 * row["draft_ms"]
    assert abs(eager["k3_a1"] - 4 * row["plain_ms"] / cost) < 1e-9 and model["k3_a0"] < model["k3_a1"]
    assert not eng.has_unfinished()
