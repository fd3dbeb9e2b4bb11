"""The hop table of `tools.profile_serving --hops`: per-request marks (engine/hop_trace.py, plus the
client's) turned into how long each hop of the serving path took, for the first token and for the
tokens after it.

A token's time at a hop is the hop's first mark holding it (marks carry the request's output tokens
so far), so a response that carries several tokens counts, for each of them, from the step that
made it. Hops a path does not pass (the in-process engine has no core) are left out.
"""

from __future__ import annotations

import glob
import json
import statistics
from collections import defaultdict

from engine.hop_trace import HOPS

ADMISSION = HOPS[:HOPS.index("core_received") + 1]  # marked once per request, before any token
DELIVERY = HOPS[HOPS.index("core_sent"):]  # marked per delta, with the tokens it holds


def load(prefix: str) -> dict[str, list[tuple[str, int, float]]]:
    """Every process's marks, by request id, in time order."""
    marks: dict[str, list] = defaultdict(list)
    for path in glob.glob(f"{glob.escape(prefix)}.*.jsonl"):
        with open(path, encoding="utf-8") as f:
            for line in f:
                record = json.loads(line)
                marks[record["id"]].extend(tuple(m) for m in record["hops"])
    return {rid: sorted(m, key=lambda m: m[2]) for rid, m in marks.items()}


def token_times(marks: list[tuple[str, int, float]], tokens: int) -> dict[str, list[float | None]]:
    """hop -> when each of tokens 1..`tokens` passed it (None: not marked there)."""
    out = {}
    for hop in DELIVERY:
        held = [(n, t) for h, n, t in marks if h == hop]
        times, j = [], 0
        for i in range(1, tokens + 1):  # one pass: linear in the marks (150 users' runs are long)
            while j < len(held) and held[j][0] < i:
                j += 1
            times.append(held[j][1] if j < len(held) else None)
        out[hop] = times
    for hop in ADMISSION:
        t = next((t for h, _, t in marks if h == hop), None)
        out[hop] = [t] * tokens
    return out


def stats(values: list[float]) -> dict:
    if not values:
        return {}
    q = statistics.quantiles(values, n=10) if len(values) > 1 else [values[0]] * 9
    return {"n": len(values), "p10": q[0], "p50": statistics.median(values), "p90": q[8],
            "mean": statistics.fmean(values)}


def table(requests: list[dict[str, list[float | None]]]) -> dict:
    """requests: token_times() of each. Per consecutive pair of hops a path passes, in ms: the first
    token's and the later tokens' figures; and the totals that matter (TTFT, its part outside the
    engine, each later token's delivery from the core's step to the client)."""
    present = [h for h in HOPS if any(any(t is not None for t in r.get(h, ())) for r in requests)]
    first, later = defaultdict(list), defaultdict(list)
    totals = defaultdict(list)
    for r in requests:
        for i in range(len(r["client_received"])):
            row = first if i == 0 else later
            for a, b in zip(present, present[1:]):
                if i > 0 and a in ADMISSION:
                    continue
                if r[a][i] is not None and r[b][i] is not None:
                    row[f"{a} -> {b}"].append((r[b][i] - r[a][i]) * 1e3)
        received, sent = r["client_received"], r["client_sent"][0]
        if received and received[0] is not None:
            totals["client TTFT"].append((received[0] - sent) * 1e3)
            core = r.get("core_sent", [None])[0], r.get("core_received", [None])[0]
            if None not in core:
                totals["engine: queue + prefill (core_received -> core_sent)"].append((core[0] - core[1]) * 1e3)
                totals["TTFT outside the engine"].append((received[0] - sent - (core[0] - core[1])) * 1e3)
        if "core_sent" in present:
            totals["later tokens: core_sent -> client_received"] += [
                (c - s) * 1e3 for s, c in zip(r["core_sent"][1:], received[1:]) if s is not None and c is not None]
    return {"first_token": {k: stats(v) for k, v in first.items()},
            "later_tokens": {k: stats(v) for k, v in later.items()},
            "totals": {k: stats(v) for k, v in totals.items()}}


def print_table(result: dict) -> None:
    for title, rows in (("first token", result["first_token"]), ("later tokens", result["later_tokens"]),
                        ("totals", result["totals"])):
        print(f"\n{title:52s} |    n |   p10 ms |   p50 ms |   p90 ms |  mean ms")
        for name, s in rows.items():
            if s:
                print(f"{name:52s} | {s['n']:4d} | {s['p10']:8.3f} | {s['p50']:8.3f} | {s['p90']:8.3f} | "
                      f"{s['mean']:8.3f}")
