"""python -m benchmarks list | run SUITE [--preset P] [--out FILE] | report FILE... | compare A B"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from pathlib import Path

from benchmarks.compare import compare_markdown
from benchmarks.report import result_markdown
from benchmarks.runner import run_suite
from benchmarks.suites import SUITES


def list_suites() -> str:
    lines = []
    for s in SUITES.values():
        extra = f" [preset {s.preset}]" if s.preset else ""
        lines.append(f"{s.name:<24}{s.machine:<6}{extra}")
        lines += textwrap.wrap(s.question + (f" ({s.notes})" if s.notes else ""), 100, initial_indent=" " * 4,
                               subsequent_indent=" " * 4)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sub.add_parser("list", help="the suites and the question each answers")
    run = sub.add_parser("run", help="run one suite, write one JSON result file")
    run.add_argument("suite", choices=sorted(SUITES))
    run.add_argument("--preset", default=None, help="the model preset for suites that take one (e.g. tiny on a CPU)")
    run.add_argument("--out", default=None, help="result file (default results/SUITE.json)")
    run.add_argument("--work", default=None, help="folder for logs and files the tools write (default: --out's)")
    run.add_argument("--ckpt", default="/tmp/ckpt", help="where random checkpoints are written and reused")
    rep = sub.add_parser("report", help="result files as markdown tables")
    rep.add_argument("files", nargs="+")
    cmp = sub.add_parser("compare", help="two result files side by side with ratios")
    cmp.add_argument("a")
    cmp.add_argument("b")
    args = ap.parse_args(argv)
    if args.cmd == "list":
        print(list_suites())
    elif args.cmd == "run":
        out = Path(args.out or f"results/{args.suite}.json")
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            result = run_suite(SUITES[args.suite], args.preset, Path(args.work) if args.work else out.parent,
                               args.ckpt)
        except ValueError as e:
            ap.error(str(e))
        out.write_text(json.dumps(result, indent=1, default=str))
        print(result_markdown(result))
        print(f"wrote {out}")
        return 0 if result["ok"] else 1
    elif args.cmd == "report":
        print("\n".join(result_markdown(json.loads(Path(f).read_text())) for f in args.files))
    else:
        a, b = (json.loads(Path(f).read_text()) for f in (args.a, args.b))
        print(compare_markdown(a, b, args.a, args.b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
