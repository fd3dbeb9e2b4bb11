"""Concurrency sweep: Locust headless at each level, against a running server or one it starts.

    python -m loadtest.sweep --url 127.0.0.1:8001 --concurrency 1,2,4,8,16,32,64,100,150 \\
        --duration 60s --workload agentic [--protocol grpc|http] [--label A] [--out DIR]
    python -m loadtest.sweep --serve --engine-args '{"enable_prefix_caching": false}' ...

Each level runs `locust -f loadtest/locustfile.py` (or `python -m loadtest.threads`) in its own
process group, closed-loop users (each sends its next request when the last one ends) spread over
--client-processes (auto: sized from the level), for --duration; then in-flight requests get
--stop-timeout to finish (the rest are cancelled). Rates count what happened inside the window
[start + --warmup, end of --duration] and latencies cover the requests sent inside it
(loadtest.window, the accounting tools.bench_engine --duration shares). Every level is checked for the clients being the
limit (loadtest.saturation): such a level is marked client-bound and the sweep exits 3 unless
--allow-client-bound. A level that outlives duration + stop-timeout
+ a grace period is killed (process group, SIGTERM then SIGKILL) and marked so. Triton's metrics
are read before and after each level (prefix-cache hits, the server's own token totals).

Writes OUT/LABEL.json (settings, one summary per level: p50/p90/p99 TTFT, ITL, TPOT, E2E,
request/s, output tok/s, and the throughput-vs-interactivity point: tok/s per user = 1000 / mean
TPOT and output tok/s per GPU (--gpus, else the GPUs Triton reports, else 1; loadtest.interactivity
compares two sweeps at a fixed tok/s per user), error rate, server counters, and every request's record) and
OUT/LABEL.csv (one row per level); Locust's logs, CSV and raw records go to OUT/raw/LABEL/cN/.
`python -m loadtest.report` plots and compares sweeps.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from backend.process_tree import exec_dying_with_this_process
from loadtest import interactivity, saturation, scrape, window
from loadtest.workloads import Length, LoadConfig, WorkloadConfig, resolve_tokenizer

REPO_ROOT = Path(__file__).resolve().parent.parent
LOCUSTFILE = Path(__file__).resolve().parent / "locustfile.py"
USER_CLASSES = {"grpc": "GrpcStreamUser", "http": "HttpSseUser", "openai": "OpenAIUser"}
DEFAULT_URLS = {"grpc": ("TRITON_GRPC_URL", "127.0.0.1:8001"), "http": ("TRITON_HTTP_URL", "127.0.0.1:8000"),
                "openai": ("OPENAI_URL", "127.0.0.1:9000")}
STARTUP_GRACE_S = 60.0  # Locust's own start (imports, tokenizer) and exit, beyond run + stop timeouts
PROGRESS_EVERY_S = 10.0


def parse_seconds(text: str) -> float:
    """'60', '60s', '2m', '1h', '1m30s' -> seconds."""
    parts = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*", text)
    if not parts or not any(parts.groups()):
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (60, 60s, 2m, 1m30s)")
    h, m, s = (float(g or 0) for g in parts.groups())
    return h * 3600 + m * 60 + s


def parse_levels(text: str) -> list[int]:
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError("concurrency levels must be integers >= 1")
    return levels


# ------------------------------------------------------------------------------------------ stats


def read_records(path: Path) -> tuple[list[dict], dict]:
    """The load processes' JSON lines (PATH, and PATH.<suffix> of each worker process: Locust's
    `--processes`, the thread driver's) merged -> (request records, {"start"|"stopping"|"stop":
    earliest time, "cpu": each process's CPU over the window, when any wrote it})."""
    requests, marks = [], {}
    for part in [path, *sorted(path.parent.glob(path.name + ".*"))]:
        if not part.exists():
            continue
        for line in part.read_text(encoding="utf-8").splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a killed process
            kind = rec.pop("kind", None)
            if kind == "request":
                requests.append(rec)
            elif kind in ("start", "stopping", "stop"):
                marks[kind] = min(rec["t"], marks.get(kind, rec["t"]))
            elif kind == "cpu":
                marks.setdefault("cpu", []).append(rec)
    return requests, marks


def summarize(requests: list[dict], marks: dict, concurrency: int, warmup_s: float = 0.0) -> dict:
    """One level's figures: counts over every request, rates and latencies over the window
    (loadtest.window: [start + warm-up, when the users began stopping])."""
    ok = [r for r in requests if r["ok"]]
    errors = [r for r in requests if not r["ok"] and not r["cancelled"]]
    cancelled = [r for r in requests if r["cancelled"]]
    inside = window.figures(requests, window.window_of(requests, marks, warmup_s))
    sent = len(ok) + len(errors)
    return {
        "concurrency": concurrency,
        "window_s": inside["window_s"],
        "warmup_s": inside["warmup_s"],
        "requests": len(ok),
        "errors": len(errors),
        "cancelled": len(cancelled),
        "error_rate": len(errors) / sent if sent else 0.0,
        "request_per_s": inside["request_per_s"],
        "output_tok_per_s": inside["output_tok_per_s"],
        "input_tok_per_s": inside["input_tok_per_s"],
        "output_tokens": sum(r["server_num_output_tokens"] or 0 for r in ok),
        "prompt_tokens_mean": statistics.fmean(r["prompt_tokens"] for r in ok) if ok else None,
        **{k: inside[k] for k in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms")},
        "error_samples": sorted({r["error"] for r in errors})[:5],
    }


# ------------------------------------------------------------------------------------------ locust


def _kill_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(grace_s)
            return
        except subprocess.TimeoutExpired:
            continue


def run_driver(cmd: list[str], log_path: Path, records: Path, hard_timeout_s: float, say) -> dict:
    """Run one load process (Locust, or the thread driver) in its own process group; print progress;
    kill the group past the bound."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
    env.setdefault("PYTHONUNBUFFERED", "1")
    t0 = time.monotonic()
    killed = False
    with open(log_path, "w") as log:
        # SIGTERM if the sweep dies, so no Locust outlives it (no preexec_fn: backend/child_exec.py says why)
        proc = subprocess.Popen(exec_dying_with_this_process(cmd), cwd=REPO_ROOT, env=env, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            next_progress = t0 + PROGRESS_EVERY_S
            while proc.poll() is None:
                now = time.monotonic()
                if now - t0 > hard_timeout_s:
                    say(f"    load process still running after {hard_timeout_s:.0f} s: killing its process group")
                    killed = True
                    _kill_group(proc)
                    break
                if now >= next_progress:
                    reqs, _ = read_records(records)
                    bad = sum(1 for r in reqs if not r["ok"] and not r["cancelled"])
                    toks = sum(r["server_num_output_tokens"] or 0 for r in reqs if r["ok"])
                    say(f"    {now - t0:5.0f} s: {len(reqs)} requests, {bad} errors, {toks} output tokens")
                    next_progress = now + PROGRESS_EVERY_S
                time.sleep(0.2)
        except BaseException:
            _kill_group(proc, grace_s=2.0)
            raise
    log_text = log_path.read_text(errors="replace")
    return {"exit_code": proc.returncode, "elapsed_s": time.monotonic() - t0, "killed": killed,
            "cpu_warning": "CPU usage above" in log_text, "log": str(log_path)}


# ------------------------------------------------------------------------------------------ sweep


def workload_config(args) -> WorkloadConfig:
    return WorkloadConfig(kind=args.workload, tokenizer=str(args.tokenizer), input_len=args.input_len,
                          output_len=args.output_len, system_len=args.system_len, turn_len=args.turn_len,
                          turns=args.turns, prompts_file=args.prompts_file, seed=args.seed)


def run_level(args, concurrency: int, url: str, metrics_url: str | None, level_dir: Path, say) -> dict:
    level_dir.mkdir(parents=True, exist_ok=True)
    records = level_dir / "records.jsonl"
    for old in [records, *level_dir.glob("records.jsonl.*")]:
        old.unlink(missing_ok=True)
    config = LoadConfig(workload=asdict(workload_config(args)), url=url, temperature=args.temperature,
                        ignore_eos=not args.no_ignore_eos, request_timeout_s=args.request_timeout,
                        level_seed=concurrency, records=str(records))
    config_path = level_dir / "config.json"
    config_path.write_text(json.dumps(asdict(config), indent=2))
    processes = min(args.client_processes or saturation.auto_processes(concurrency), concurrency)
    if args.driver == "locust":  # Locust's own distributed mode: a master and `processes` workers
        cmd = [sys.executable, "-m", "locust", "-f", str(LOCUSTFILE), "--headless",
               "-u", str(concurrency), "-r", str(concurrency), "-t", f"{args.duration:g}s",
               "--stop-timeout", f"{args.stop_timeout:g}", "--only-summary", "--csv", str(level_dir / "locust"),
               "--host", url, "--exit-code-on-error", "0", "--loadtest-config", str(config_path),
               *(["--processes", str(processes)] if processes > 1 else []), USER_CLASSES[args.protocol]]
    else:
        cmd = [sys.executable, "-m", "loadtest.threads", str(config_path), "--protocol", args.protocol,
               "--users", str(concurrency), "--duration", f"{args.duration:g}",
               "--stop-timeout", f"{args.stop_timeout:g}", "--processes", str(processes)]
    before = scrape.scrape(metrics_url)
    load_before = os.getloadavg()
    t0 = time.monotonic()
    run = run_driver(cmd, level_dir / f"{args.driver}.log", records,
                     args.duration + args.stop_timeout + STARTUP_GRACE_S, say)
    elapsed = time.monotonic() - t0
    if metrics_url:
        time.sleep(scrape.SETTLE_S)
    server = scrape.delta(before, scrape.scrape(metrics_url))
    if server is not None and "response_thread_cpu_s" in server:
        server["response_thread_busy"] = server["response_thread_cpu_s"] / elapsed
    requests, marks = read_records(records)
    summary = summarize(requests, marks, concurrency, args.warmup)
    sat = window.client_saturation(requests, window.window_of(requests, marks, args.warmup), concurrency,
                                   summary["request_per_s"], marks.get("cpu", []))
    return {**summary, "client_processes": processes, "saturation": sat, "client_bound": sat["client_bound"],
            "server": server, "driver": run, "failure": level_failure(summary, run),
            "load_avg": {"before": load_before, "after": os.getloadavg()},
            "records": [{k: v for k, v in r.items() if k not in ("delta_ms", "delta_tokens")} for r in requests]}


def level_failure(summary: dict, run: dict) -> str | None:
    """Why a level measured nothing worth reading (None: it measured). A driver that fails to start
    (say, its client library does not import) writes no records: that is an error, never a row of zeros."""
    if run["exit_code"] not in (0, None) and not run["killed"]:
        tail = [line for line in Path(run["log"]).read_text(errors="replace").splitlines() if line.strip()][-3:]
        return f"the load driver exited with code {run['exit_code']}: " + " / ".join(tail)
    if summary["requests"] == 0 and summary["output_tok_per_s"] == 0:  # users cut off at the stop still streamed
        why = f": {summary['error_samples'][0]}" if summary["error_samples"] else ""
        return f"no request completed and no token came ({summary['errors']} errors{why}; driver log {run['log']})"
    return None


def describe_level(level: dict) -> str:
    if level.get("failure"):
        return f"c={level['concurrency']:<4} | FAILED: {level['failure']}"
    ttft, itl, e2e = level["ttft_ms"], level["itl_ms"], level["e2e_ms"]
    hit = (level["server"] or {}).get("prefix_hit_ratio")
    parts = [f"c={level['concurrency']:<4}", f"{level['requests']:5d} req", f"{level['request_per_s']:7.2f} req/s",
             f"{level['output_tok_per_s']:8.1f} tok/s",
             f"TTFT p50 {ttft.get('p50', float('nan')):7.1f} p99 {ttft.get('p99', float('nan')):7.1f} ms",
             f"ITL p50 {itl.get('p50', float('nan')):6.1f} ms", f"E2E p50 {e2e.get('p50', float('nan')):7.1f} ms",
             f"{level.get('tok_per_s_per_user') or float('nan'):6.1f} tok/s/user",
             f"{level.get('output_tok_per_s_per_gpu', float('nan')):8.1f} tok/s/GPU", f"err {level['error_rate']:.1%}"]
    if hit is not None:
        parts.append(f"prefix hit {hit:.0%}")
    parts.append(saturation.describe(level.get("saturation")))
    if level["driver"]["killed"]:
        parts.append("LOAD PROCESS KILLED")
    if level["driver"]["cpu_warning"]:
        parts.append("Locust CPU > 90%: it may be the bottleneck (--processes)")
    return " | ".join(parts)


CSV_FIELDS = ["label", "protocol", "workload", "concurrency", "requests", "errors", "cancelled", "error_rate",
              "request_per_s", "output_tok_per_s", "input_tok_per_s", "tok_per_s_per_user",
              "output_tok_per_s_per_gpu"] + [
    f"{m}_{p}" for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms") for p in ("p50", "p90", "p99", "mean")] + [
    "prefix_hit_ratio", "client_bound", "client_processes", "client_cpu_busiest_cores", "client_cpu_total_cores",
    "users_busy_ratio", "window_s", "warmup_s", "driver_killed", "driver_elapsed_s", "failure"]


def write_outputs(result: dict, out: Path, label: str) -> tuple[Path, Path]:
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / f"{label}.json", out / f"{label}.csv"
    tmp = json_path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(json_path)  # a sweep stopped half-way still leaves a readable file
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        w.writeheader()
        for lv in result["levels"]:
            row = {k: lv.get(k) for k in CSV_FIELDS}
            row.update(label=label, protocol=result["protocol"], workload=result["workload"]["kind"],
                       prefix_hit_ratio=(lv["server"] or {}).get("prefix_hit_ratio"),
                       driver_killed=lv["driver"]["killed"], driver_elapsed_s=round(lv["driver"]["elapsed_s"], 2))
            sat = lv.get("saturation")
            if sat:
                row.update(client_cpu_busiest_cores=sat["client_cpu"]["busiest_cores"],
                           client_cpu_total_cores=sat["client_cpu"]["total_cores"],
                           users_busy_ratio=sat["littles_law"]["busy_ratio"])
            for m in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
                for p in ("p50", "p90", "p99", "mean"):
                    row[f"{m}_{p}"] = lv[m].get(p)
            w.writerow(row)
    return json_path, csv_path


def gpus_of(args, metrics_url: str | None) -> dict:
    """What output tok/s per GPU divides by, and where that number came from."""
    if args.gpus:
        return {"gpus": args.gpus, "gpus_source": "--gpus"}
    try:
        found = scrape.gpu_count(scrape.metrics_text(metrics_url)) if metrics_url else None
    except (OSError, ValueError):  # URLError is an OSError
        found = None
    return {"gpus": found, "gpus_source": "the server's metrics"} if found else {"gpus": 1, "gpus_source": "default"}


def sweep(args, url: str, metrics_url: str | None, server_info: dict, say=print) -> dict:
    label = args.label
    out = Path(args.out)
    result = {
        "label": label,
        "command": "python -m loadtest.sweep " + shlex.join(args.argv),
        "protocol": args.protocol,
        "driver": args.driver,
        "client_processes": "auto" if args.client_processes is None else args.client_processes,
        "allow_client_bound": args.allow_client_bound,
        "workload": asdict(workload_config(args)),
        "sampling": {"temperature": args.temperature, "ignore_eos": not args.no_ignore_eos},
        "duration_s": args.duration, "warmup_s": args.warmup, "stop_timeout_s": args.stop_timeout,
        "server": {"url": url, "metrics_url": metrics_url, **server_info},
        **gpus_of(args, metrics_url),
        "host": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "levels": [],
    }
    levels = args.concurrency
    budget = len(levels) * (args.duration + 5)
    warm = f" ({args.warmup:g} s warm-up)" if args.warmup else ""
    say(f"sweep {label}: {args.protocol} {args.workload} ({args.driver}) against {url}, levels {levels}, {args.duration:g} s "
        f"each{warm} (about {budget / 60:.1f} min, plus up to {args.stop_timeout:g} s per level for in-flight requests)")
    for i, c in enumerate(levels, 1):
        say(f"[{i}/{len(levels)}] concurrency {c} ...")
        level = run_level(args, c, url, metrics_url, out / "raw" / label / f"c{c}", say)
        level["tok_per_s_per_user"] = interactivity.tok_per_s_per_user(level)
        level["output_tok_per_s_per_gpu"] = level["output_tok_per_s"] / result["gpus"]
        result["levels"].append(level)
        say(f"  {describe_level(level)}")
        write_outputs(result, out, label)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    json_path, csv_path = write_outputs(result, out, label)
    say(f"wrote {json_path} and {csv_path}")
    failed = [lv["concurrency"] for lv in result["levels"] if lv["failure"]]
    if failed:
        say(f"error: level(s) {', '.join(map(str, failed))} measured nothing (see FAILED above)")
    bound = [lv for lv in result["levels"] if lv.get("client_bound") and not lv["failure"]]
    for lv in bound:
        say(f"{'warning' if args.allow_client_bound else 'error'}: c={lv['concurrency']} was client-bound: "
            f"{'; '.join(lv['saturation']['reasons'])}; its figures are the load generator's, not the server's "
            f"(more --client-processes, or a bigger client host)")
    return result


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m loadtest.sweep", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", help="server address for --protocol, host:port (default $TRITON_GRPC_URL or "
                   "127.0.0.1:8001 for grpc, $TRITON_HTTP_URL or 127.0.0.1:8000 for http)")
    p.add_argument("--protocol", choices=sorted(USER_CLASSES), default="grpc")
    p.add_argument("--driver", choices=["locust", "threads"], default="locust",
                   help="locust: Locust's users (gevent); threads: the same load from OS threads, a reference")
    p.add_argument("--client-processes", "--processes", type=client_processes_arg, default=None,
                   metavar="N|auto", help="client processes per level (threads: worker processes; locust: its "
                   "--processes workers); auto (default): one per 16 users, at most the cores less 2")
    p.add_argument("--allow-client-bound", action="store_true", help="exit 0 even when a level's clients were "
                   "the limit (the level is still marked client-bound)")
    p.add_argument("--metrics-url", help="Triton metrics (default $TRITON_METRICS_URL or http://HOST:8002/metrics); "
                   "'none' to skip")
    p.add_argument("--serve", action="store_true", help="start a server (backend.serve, free loopback ports) "
                   "for the sweep and stop it after")
    p.add_argument("--model", help="with --serve: checkpoint dir (default model.json's, the tiny model)")
    p.add_argument("--engine-args", default="{}", help="with --serve: JSON merged into model.json")
    p.add_argument("--concurrency", type=parse_levels, default=parse_levels("1,2,4,8,16,32,64,100,150"))
    p.add_argument("--duration", type=parse_seconds, default=60.0, help="per level (60, 60s, 2m), the warm-up "
                   "included")
    p.add_argument("--warmup", type=parse_seconds, default=0.0, help="the first seconds of each level that the rates "
                   "and latencies leave out (loadtest.window); below --duration")
    p.add_argument("--stop-timeout", type=parse_seconds, default=30.0,
                   help="after each level, time for in-flight requests to finish before they are cancelled")
    p.add_argument("--workload", choices=["random", "agentic", "prompts"], default="random")
    p.add_argument("--input-len", default="256", help="random: prompt tokens, N or LOW:HIGH")
    p.add_argument("--output-len", default="64", help="max_tokens, N or LOW:HIGH (exact with ignore_eos)")
    p.add_argument("--system-len", type=int, default=512, help="agentic: shared system prompt tokens")
    p.add_argument("--turn-len", default="64", help="agentic: tokens per new user message, N or LOW:HIGH")
    p.add_argument("--turns", type=int, default=6, help="agentic: turns per conversation")
    p.add_argument("--prompts-file", default="", help="prompts: .jsonl (prompt, max_tokens) or .txt")
    p.add_argument("--tokenizer", default="", help="dir with the model's tokenizer.json (default: --model's "
                   "with --serve, else the tiny checkpoint's)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--no-ignore-eos", action="store_true", help="let requests stop at EOS (lengths vary)")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds, per request")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--gpus", type=int, default=None, help="GPUs serving the model, for output tok/s per GPU "
                   "(default: the GPUs Triton's metrics report, else 1)")
    p.add_argument("--label", help="name of this configuration (default PROTOCOL-WORKLOAD)")
    p.add_argument("--out", default="loadtest-results")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if not 0 <= args.warmup < args.duration:
        parser.error(f"--warmup ({args.warmup:g} s) must be below --duration ({args.duration:g} s)")
    args.label = args.label or f"{args.protocol}-{args.workload}" + ("-threads" if args.driver == "threads" else "")
    if not re.fullmatch(r"[\w.-]+", args.label):
        parser.error("--label: letters, digits, '.', '_' and '-' only (it names files)")
    for name in ("input_len", "output_len", "turn_len"):
        try:
            Length.parse(getattr(args, name))
        except ValueError as e:
            parser.error(f"--{name.replace('_', '-')}: {e}")
    from backend.serve import parse_engine_args

    try:
        engine_args = parse_engine_args(args.engine_args)
    except ValueError as e:
        parser.error(str(e))
    if not args.tokenizer and args.serve and args.model and args.model != "tiny":
        args.tokenizer = args.model
    args.tokenizer = str(resolve_tokenizer(args.tokenizer))

    try:
        if not args.serve:
            env, default = DEFAULT_URLS[args.protocol]
            url = args.url or os.environ.get(env) or default
            metrics_url = args.metrics_url or os.environ.get("TRITON_METRICS_URL") or \
                f"http://{url.rpartition(':')[0] or '127.0.0.1'}:8002/metrics"
            if metrics_url == "none":
                metrics_url = None
            return exit_code(sweep(args, url, metrics_url, {"serve": False}))
        from backend.serve import ServerError, TritonServer

        print(f"starting a server (engine args {engine_args or 'from model.json'}) ...", flush=True)
        try:
            server = TritonServer(model=args.model, engine_args=engine_args, http_port=0, grpc_port=0,
                                  metrics_port=0).start()
        except ServerError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        front = None
        try:
            url = server.grpc_url if args.protocol == "grpc" else server.http_url
            if args.protocol == "openai":  # the OpenAI service in front of this server
                from backend.openai.process import OpenAIProcess, tokenizer_dir

                model_json = server.workdir / "model_repository" / "deepseek_v4" / "1" / "model.json"
                front = OpenAIProcess(server.grpc_url, port=0, tokenizer=tokenizer_dir(model_json)).start()
                url = front.base_url.removeprefix("http://").removesuffix("/v1")
            info = {"serve": True, "model": args.model or "model.json's", "engine_args": engine_args}
            result = sweep(args, url, server.metrics_url, info)
        finally:
            if front is not None:
                front.stop()
            server.stop()
        return exit_code(result)
    except KeyboardInterrupt:
        print("interrupted; results so far are in the JSON", file=sys.stderr)
        return 130


def exit_code(result: dict) -> int:
    """1 when any level measured nothing: a load test that measured nothing did not succeed; 3 when a
    level's clients were the limit (unless allowed): its figures describe the load generator."""
    if any(level["failure"] for level in result["levels"]):
        return 1
    if not result.get("allow_client_bound") and any(level.get("client_bound") for level in result["levels"]):
        return 3
    return 0


def client_processes_arg(text: str) -> int | None:
    try:
        return saturation.parse_processes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not 'auto' or an integer >= 1: {text!r}") from None


if __name__ == "__main__":
    sys.exit(main())
