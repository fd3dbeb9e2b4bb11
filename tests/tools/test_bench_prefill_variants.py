"""tools/bench_prefill_variants.py on the tiny checkpoint, on the CPU: one engine, a row per (shape, set) with its
times and the first tokens compared against the first set's. On the CPU's backend (the torch references) no
variant runs, so every set's tokens must equal the first set's."""

import json

from kernels import variants
from tools import bench_prefill_variants


def test_cpu_run_writes_a_row_per_shape_and_set(tmp_path):
    out = tmp_path / "variants.json"
    engine_args = '{"dtype":"float32","max_model_len":64,"max_num_seqs":4,"block_size":16}'
    rc = bench_prefill_variants.main(["--model", "", "--sets", "none,mix_bf16x3+rope_tiles,rope_tiles",
                                      "--shapes", "1x16,2x16,1x80", "--rounds", "1", "--engine-args", engine_args,
                                      "--json", str(out)])
    assert rc == 0
    result = json.loads(out.read_text())
    assert result["device"] == "cpu" and result["engine_args"]["cudagraph_mode"] == "FULL_DECODE_ONLY"
    rows = {(r["shape"], r["set"]): r for r in result["rows"]}
    sets = ("none", "mix_bf16x3+rope_tiles", "rope_tiles")
    assert list(rows) == [(shape, s) for shape in ("1x16", "2x16") for s in sets]  # 1x80 exceeds max_model_len
    for (shape, _), row in rows.items():
        assert len(row["times_ms"]) == 1 and row["min_ms"] == row["median_ms"] > 0
        assert row["tokens_total"] == int(shape.split("x")[0])
    assert rows[("2x16", "mix_bf16x3+rope_tiles")]["variants"] == ["rope_tiles", "mix_bf16x3"]
    assert all(row["tokens_equal"] == row["tokens_total"] for row in rows.values())
    assert rows[("1x16", "none")]["speedup"] == 1.0
    assert variants.enabled() == variants.DEFAULT


def test_a_failing_set_is_an_error_row_and_only_all_failing_fails(tmp_path, monkeypatch):
    real = bench_prefill_variants.first_tokens

    def rope_tiles_fails(llm, prompts):
        if variants.on("rope_tiles"):
            raise RuntimeError("planted")
        return real(llm, prompts)

    monkeypatch.setattr(bench_prefill_variants, "first_tokens", rope_tiles_fails)
    args = ["--model", "", "--shapes", "1x8", "--rounds", "1", "--engine-args",
            '{"dtype":"float32","max_model_len":32,"max_num_seqs":2,"block_size":16}']
    assert bench_prefill_variants.main([*args, "--sets", "rope_tiles,none", "--json", str(tmp_path / "a.json")]) == 0
    failed, ok = json.loads((tmp_path / "a.json").read_text())["rows"]
    assert failed["error"] == "RuntimeError: planted" and ok["speedup"] is None and ok["tokens_total"] == 0
    assert bench_prefill_variants.main([*args, "--sets", "rope_tiles,all"]) == 1
    assert variants.enabled() == variants.DEFAULT
