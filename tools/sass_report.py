"""A Triton kernel compiled for the H200 (sm90) on this machine, no GPU needed: registers, stack (spills), and the
instructions that say whether it took the fast paths (HGMMA: wgmma; HMMA: mma.sync; LDGSTS: cp.async, the
pipeliner's loads; LDL / STL: spill traffic; BAR: barriers). Triton's wheel carries ptxas and cuobjdump. The local
Triton may be newer than the GPU image's (3.9 here, 3.6 there): a guide to read before spending device time, not a
measurement. The image's own compiler runs here too, and then registers match the GPU's (138 for the MoE's decode
tile, as Nsight Compute measured, where 3.9 says 160): `pip download --no-deps triton==3.6.0`, unzip the wheel into
DIR, run with PYTHONPATH=DIR:. (the compile needs no GPU; torch stays the venv's).

    python -m tools.sass_report kernels.fused_attention:_paged_attention_kernel \\
        --types '*bf16,*bf16,*fp32,*fp32,*fp32,*i64,*i64,*bf16,*i32,i32,*i64,*i32,i32,*i32,*fp32,fp32,i32,i32,i64,*fp32,*fp32,*i32' \\
        --const BS=128,RATIO=4,PER_BLOCK=32,HD=512,BLOCK_H=64,BLOCK_N=64,BLOCK_D=512,MODE=2,TOPK=512,NSPLIT=1,DOT_F32=False,R=0,COMBINE_LAST=False,CB_H=8,CB_D=128,PDL=False \\
        --div16 H,W,COMP_OFF --warps 8 --stages 2 --loop     (the CSA prefill tile: 2,169 a key step, Triton 3.6)

    python -m tools.sass_report kernels.fused_moe:_gate_up_kernel --loop \\
        --types '*bf16,*u8,*u8,*u8,*u8,*bf16,*fp32,*i32,*i32,*i32,*i32,*i32,i32,i32,i32,fp32,i32,i32' \\
        --const W_FMT=2,BLOCK_M=16,BLOCK_N=64,BLOCK_K=128,DOT_F32=False,MX=4,SPLITS=4,H_FRAG=False,PDL=True \\
        --div16 D,I,K_SPLIT --warps 4 --stages 3      (the MoE's one-row "bf16-frag" decode: 590 a K step, Triton 3.6)

--loop: the longest loop's instructions by opcode (a K step's cost per thread).
--types: the non-constexpr arguments in order; pointers are taken as 16-byte aligned (as the launcher specializes
them on the GPU), and so are the integer arguments named in --div16 (without that hint the loads compile scalar).
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

COUNTED = ("HGMMA", "HMMA", "LDGSTS", "LDL", "STL", "BAR")


def compile_sm90(kernel, types: list[str], consts: dict, div16: set[str], warps: int, stages: int):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    free = iter(types)
    sig = {a: "constexpr" if a in consts else next(free) for a in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(kernel.arg_names)
             if a not in consts and (sig[a].startswith("*") or a in div16)}
    src = ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


_INSTR = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)(.*)$", flags=re.M)


def _cuobjdump(cubin: bytes, flag: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), flag, f.name], capture_output=True, text=True, check=True).stdout


def report(cubin: bytes, sass: str) -> dict:
    """Registers, stack bytes and instruction counts of one compiled kernel (sass: its --dump-sass)."""
    usage = _cuobjdump(cubin, "--dump-resource-usage")
    ops = [m.group(2) for m in _INSTR.finditer(sass)]
    out = {"registers": int(re.search(r"REG:(\d+)", usage).group(1)),
           "stack_bytes": int(re.search(r"STACK:(\d+)", usage).group(1))}
    out.update({op: sum(o == op for o in ops) for op in COUNTED})
    return out


def main_loop(sass: str) -> Counter:
    """The instructions of the kernel's longest loop (the span of its longest backward branch: a K loop's step),
    by opcode: what one step costs each thread."""
    instrs = [(int(m.group(1), 16), m.group(2), m.group(3)) for m in _INSTR.finditer(sass)]
    spans = [(int(b.group(1), 16), at) for at, op, rest in instrs if op == "BRA"
             for b in [re.search(r"(0x[0-9a-f]+)", rest)] if b and int(b.group(1), 16) < at]
    if not spans:
        return Counter()
    lo, hi = max(spans, key=lambda sp: sp[1] - sp[0])
    return Counter(op for at, op, _ in instrs if lo <= at <= hi)


def _value(v: str):
    if v in ("True", "False"):
        return v == "True"
    return int(v) if re.fullmatch(r"-?\d+", v) else v


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.sass_report", description=__doc__.split("\n\n")[0])
    ap.add_argument("kernel", help="module:name of a @triton.jit function")
    ap.add_argument("--types", required=True, help="the non-constexpr arguments' Triton types, in order")
    ap.add_argument("--const", default="", help="NAME=value,... (the constexpr arguments; True / False for flags)")
    ap.add_argument("--div16", default="", help="integer arguments to take as multiples of 16")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=3)
    ap.add_argument("--loop", action="store_true",
                    help="also the longest loop's instructions (a K step's, per thread) by opcode, most first")
    a = ap.parse_args(argv)
    module, name = a.kernel.split(":")
    kernel = getattr(importlib.import_module(module), name)
    consts = {k: _value(v) for k, v in (kv.split("=") for kv in a.const.split(",") if kv)}
    compiled = compile_sm90(kernel, a.types.split(","), consts, set(filter(None, a.div16.split(","))), a.warps,
                            a.stages)
    sass = _cuobjdump(compiled.asm["cubin"], "--dump-sass")
    r = report(compiled.asm["cubin"], sass)
    print(" ".join(f"{k} {v}" for k, v in r.items()) + f" shared_bytes {compiled.metadata.shared}")
    if a.loop:
        loop = main_loop(sass)
        print(f"loop {sum(loop.values())} " + " ".join(f"{op} {n}" for op, n in loop.most_common()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
