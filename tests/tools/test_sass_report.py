"""tools/sass_report compiles a Triton kernel for sm90 here (no GPU) and reads its SASS: a bf16 tile product at 4
warps runs on wgmma (HGMMA) with its loads pipelined (LDGSTS), and the divisibility hint decides which loads are."""

import os
import subprocess
import sys

ARGS = ["tests.tools.sass_kernels:tile_product", "--types", "*bf16,*bf16,*fp32,i32", "--const", "BLOCK=64",
        "--warps", "4", "--stages", "3"]


def _report(*extra: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the real compiler, not the interpreter
    out = subprocess.run([sys.executable, "-m", "tools.sass_report", *ARGS, *extra], capture_output=True, text=True,
                         env=env, check=True).stdout.split()
    return {k: int(v) for k, v in zip(out[::2], out[1::2])}


def test_tile_product_takes_wgmma_and_cp_async():
    r = _report("--div16", "K")
    assert r["HGMMA"] > 0 and r["HMMA"] == 0
    assert r["LDGSTS"] > 0
    assert 0 < r["registers"] <= 255 and r["stack_bytes"] == 0
    assert r["shared_bytes"] > 0


def test_without_the_divisibility_hint_fewer_loads_are_pipelined():
    """K of unknown divisibility: a's rows are not provably 16-byte aligned, so only b's tiles go by cp.async."""
    assert 0 < _report()["LDGSTS"] < _report("--div16", "K")["LDGSTS"]
