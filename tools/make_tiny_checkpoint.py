"""Write a seeded random DeepSeek-V4 checkpoint in the official layout (engine/models/deepseek_v4/random_checkpoint.py).

    python -m tools.make_tiny_checkpoint OUT [--preset tiny|flash-shaped] [--seed N] [--override JSON]
        [--quant bf16|fp8|fp8-fp4]   (fp8: FP8 linears + FP8 experts, as Base; fp8-fp4: MXFP4 experts, as V4-Flash)
        [--layout preview|0731]      (0731: three DSpark draft stages under mtp.* instead of one MTP layer)
    DeepSeek-V4.1 (engine/models/deepseek_v41/random_checkpoint.py): --preset v41-tiny|v41-flash-shaped [--quant bf16|fp8-fp4]
        (fp8-fp4: FP8 32x32-tile linears, FP4 experts, FP8 Engram rows, as V4.1 ships)
"""

from __future__ import annotations

import argparse
import json

from engine.models.deepseek_v4.random_checkpoint import LAYOUTS, PRESETS, QUANTS, write_checkpoint
from engine.models.deepseek_v41.random_checkpoint import PRESETS as V41_PRESETS
from engine.models.deepseek_v41.random_checkpoint import write_v41_checkpoint


def main() -> None:
    ap = argparse.ArgumentParser(description="Write a seeded random DeepSeek-V4 checkpoint (official layout).")
    ap.add_argument("out")
    ap.add_argument("--preset", default="tiny", choices=sorted(PRESETS) + sorted(V41_PRESETS))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--override", default=None, help="JSON merged into config.json (e.g. '{\"sliding_window\": 8}')")
    ap.add_argument("--device", default="cpu", help="where to draw the random numbers (cuda: fast, other values)")
    ap.add_argument("--quant", default="bf16", choices=QUANTS,
                    help="stored format: bf16, fp8 (FP8 linears and experts, as V4-Flash-Base), "
                         "fp8-fp4 (FP8 linears, MXFP4 experts, as V4-Flash)")
    ap.add_argument("--layout", default="preview", choices=LAYOUTS,
                    help="draft section: preview (one NextN MTP layer) or 0731 (DSpark draft stages, as "
                         "DeepSeek-V4-Flash-0731 ships); DeepSeek-V4 presets only")
    ap.add_argument("--spill-dir", default=None, help="where shards go (linked from OUT) once OUT's disk is "
                                                      "nearly full, e.g. /dev/shm/ckpt")
    args = ap.parse_args()
    override = json.loads(args.override) if args.override else None
    if args.preset in V41_PRESETS:
        if args.layout != "preview":
            ap.error("--layout applies to the DeepSeek-V4 presets only")
        out = write_v41_checkpoint(args.out, args.preset, args.seed, override, args.device, args.quant)
    else:
        out = write_checkpoint(args.out, args.preset, args.seed, override, args.device, args.quant, args.spill_dir,
                               args.layout)
    print(f"wrote {args.preset} {args.quant} {args.layout} checkpoint to {out}")


if __name__ == "__main__":
    main()
