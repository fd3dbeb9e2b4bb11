"""tools/bench_unpack.py on the CPU (Triton's interpreter, small shapes): the table's tile equals the formats'
dequantizer, every candidate the table's output, and the JSON holds a row per candidate that fits the shape."""

import json

import pytest
import torch

from kernels.mxfp4_unpack import UNPACK_TILES, UnpackTiles, mxfp4_unpacked, table_tiles
from tools import bench_unpack


def test_cpu_run_checks_every_candidate_and_writes_rows(tmp_path):
    out = tmp_path / "unpack.json"
    assert bench_unpack.main(["--experts", "2", "--dims", "256,128", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert not result["failures"] and result["best"] is None  # nothing timed on the CPU
    fitting = [t for t in bench_unpack.candidates() if 128 % t.block_k == 0]
    assert len(result["rows"]) == len(fitting) and all(r["equal"] for r in result["rows"])
    assert result["layer_bytes"] == 2 * (2 * 128 * 128 + 2 * 128 * 8 + 2 * 2 * 128 * 256) + (
        2 * 256 * 64 + 2 * 256 * 4 + 2 * 2 * 256 * 128)


def test_unpack_refuses_a_k_its_tile_does_not_divide_and_the_table_fits_its_step():
    torch.manual_seed(0)
    w = torch.randint(-128, 128, (1, 4, 96), dtype=torch.int8)  # K 192: the table's 512 halves to 64
    s = torch.randint(120, 134, (1, 4, 6), dtype=torch.uint8)
    assert table_tiles(192).block_k == 64 and table_tiles(2304).block_k == 256 and table_tiles(4096) == UNPACK_TILES
    assert torch.equal(mxfp4_unpacked(w, s), mxfp4_unpacked(w, s, UnpackTiles(4, 64)))
    with pytest.raises(ValueError, match="multiple of 128"):
        mxfp4_unpacked(w, s, UnpackTiles(4, 128))
