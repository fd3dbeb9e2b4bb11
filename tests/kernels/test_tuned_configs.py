"""kernels/tuned_configs.py: the tables load as stored and a sweep's winners merge into them by row bound."""

import json
import shutil

import pytest

from kernels import tuned_configs


@pytest.fixture
def config_dir(tmp_path, monkeypatch):
    for op in ("fp8_linear", "moe"):
        shutil.copy(tuned_configs.config_path(op), tmp_path)
    monkeypatch.setattr(tuned_configs, "CONFIG_DIR", tmp_path)
    tuned_configs.load.cache_clear()
    yield tmp_path
    tuned_configs.load.cache_clear()


def test_tables_name_their_measurement():
    lin, moe = tuned_configs.load("fp8_linear"), tuned_configs.load("moe")
    assert set(lin["measured_by"]) == {"tiles", "gemv"} and set(moe["measured_by"]) == {"decode", "prefill"}
    for rows in list(lin["shapes"].values()) + list(moe["prefill"].values()):
        bounds = [b for b, _ in rows]
        assert bounds[-1] is None and bounds[:-1] == sorted(bounds[:-1]), bounds  # ascending, any count last


def test_merge_sweep_replaces_swept_rows_and_keeps_the_rest(config_dir):
    old = tuned_configs.load("fp8_linear")["shapes"]["1024x4096"]
    tile = {"variant": "mma", "BLOCK_M": 64, "BLOCK_N": 64, "GROUP_M": 8, "num_warps": 4, "num_stages": 3}
    dec = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_K": 128, "num_warps": 8, "num_stages": 3, "MX": "bf16"}
    pre = {"BLOCK_M": 128, "BLOCK_N": 128, "BLOCK_K": 64, "num_warps": 8, "num_stages": 3, "MX": "bf16"}
    results = [{"op": "fp8_linear", "n": 1024, "k": 4096, "rows": 150, "best": tile},
               {"op": "fp8_linear", "n": 77, "k": 256, "rows": 8192, "best": tile},
               {"op": "fp8_linear", "n": 1024, "k": 4096, "rows": 32, "error": "no candidate ran"},
               {"op": "moe", "fmt": "mxfp4", "rows": 32, "best": {"gate_up": dec, "down": dec}},
               {"op": "moe", "fmt": "mxfp4", "rows": 2048, "best": {"gate_up": pre, "down": pre}}]
    paths = tuned_configs.merge_sweep(results, "tools/bench_quant.py --quick", top_k=6)
    assert sorted(p.name for p in paths) == ["fp8_linear,device_name=NVIDIA_H200.json", "moe,device_name=NVIDIA_H200.json"]
    lin = json.loads((config_dir / paths[0].name).read_text())
    assert lin["measured_by"]["tiles"] == "tools/bench_quant.py --quick"
    assert lin["shapes"]["1024x4096"] == [[b, tile if b == 512 else c] for b, c in old]  # 150 rows serve up to 512
    assert lin["shapes"]["77x256"] == [[None, tile]]
    moe = tuned_configs.load("moe")  # the writer cleared the cache
    assert moe["decode"]["mxfp4"]["32"] == dec and moe["measured_by"]["decode"] == "tools/bench_quant.py --quick"
    assert moe["prefill"]["mxfp4"][0] == [4096 * 6, pre] and moe["prefill"]["mxfp4"][-1][0] is None


def test_merge_sweep_refuses_other_block_sizes(config_dir):
    with pytest.raises(ValueError, match="128x128"):
        tuned_configs.merge_sweep([{"op": "fp8_linear", "n": 1280, "k": 5120, "rows": 1, "block": 32, "best": {}}],
                                  "tools/bench_quant.py --v41", top_k=6)
