"""python -m backend.openai --triton-grpc HOST:PORT [--host 127.0.0.1] [--port 9000] [--tokenizer DIR] [--workers N]"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys

import uvicorn

from backend.openai.admission import MAX_BODY_BYTES_IN_FLIGHT, MAX_CONCURRENT_REQUESTS
from backend.openai.app import Settings, build_app
from backend.openai.body_limits import MAX_BODY_BYTES, MAX_JSON_DEPTH
from backend.openai.forward_limits import ForwardLimits
from backend.openai.process import API_KEY_ENV, AUTO_WORKERS_MAX, workers_arg
from backend.openai.readiness import UNRESPONSIVE_AFTER_S

ARGV_ENV = "DSV4_OPENAI_ARGV"  # a worker process's options: uvicorn's workers build the app from an import string
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m backend.openai",
                                     description="OpenAI-compatible API in front of a Triton server")
    parser.add_argument("--triton-grpc", required=True, help="Triton's gRPC endpoint, HOST:PORT")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default loopback)")
    parser.add_argument("--port", type=int, default=9000)
    parser.add_argument("--model", default="deepseek_v4", help="the Triton model to send requests to")
    parser.add_argument("--served-model-name", help="the model name clients use (default: --model)")
    parser.add_argument("--tokenizer", help="checkpoint directory whose tokenizer_config.json has the chat template")
    parser.add_argument("--chat-template", help="a Jinja template file, or 'deepseek_v4' (shipped), over the "
                        "checkpoint's")
    parser.add_argument("--triton-metrics", help="Triton's metrics URL (http://HOST:PORT/metrics), served again "
                        "at /metrics on this port")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV),
                        help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV})")
    parser.add_argument("--max-body-bytes", type=int, default=MAX_BODY_BYTES)
    parser.add_argument("--max-json-depth", type=int, default=MAX_JSON_DEPTH)
    parser.add_argument("--max-concurrent-requests", type=int, default=MAX_CONCURRENT_REQUESTS,
                        help="requests in progress at once (a stream until its end); more get 503 with Retry-After")
    parser.add_argument("--max-body-bytes-in-flight", type=int, default=MAX_BODY_BYTES_IN_FLIGHT,
                        help="request-body bytes read or being parsed at once; past it: 503 with Retry-After")
    parser.add_argument("--unresponsive-after-s", type=float, default=UNRESPONSIVE_AFTER_S,
                        help="/health turns 503 while the engine's step has run longer than this (read from "
                        "--triton-metrics; 0: off)")
    parser.add_argument("--model-json", help="the served model's model.json: the front refuses what its engine "
                        "would (stop lists, prompt size) before sending it")
    parser.add_argument("--workers", type=workers_arg, default="auto", help="processes serving the port ('auto': one per 4 cores, "
                        f"at most {AUTO_WORKERS_MAX}); the request and body bounds are split between them")
    parser.add_argument("--log-level", default="warning")
    return parser.parse_args(argv)


def app_from(args: argparse.Namespace):
    """The app of one process: the bounds are the whole front's, so each of `args.workers` gets its share."""
    share = lambda bound: math.ceil(bound / args.workers)  # noqa: E731
    return build_app(Settings(triton_grpc=args.triton_grpc, model=args.model,
                             served_model_name=args.served_model_name, tokenizer=args.tokenizer,
                             chat_template=args.chat_template, api_key=args.api_key,
                             triton_metrics=args.triton_metrics,
                             max_body_bytes=args.max_body_bytes, max_json_depth=args.max_json_depth,
                             max_concurrent_requests=share(args.max_concurrent_requests),
                             max_body_bytes_in_flight=share(args.max_body_bytes_in_flight),
                             unresponsive_after_s=args.unresponsive_after_s,
                             forward_limits=ForwardLimits.from_model_json(args.model_json)))


def worker_app():
    """uvicorn's factory in each worker process: the options the parent was started with."""
    return app_from(parse_args(json.loads(os.environ[ARGV_ENV])))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    # uvicorn's own limit on header + request-line size stays; the body limits are the app's
    options = {"host": args.host, "port": args.port, "log_level": args.log_level, "timeout_graceful_shutdown": 10}
    if args.workers == 1:
        uvicorn.run(app_from(args), **options)
    else:
        os.environ[ARGV_ENV] = json.dumps(argv)
        uvicorn.run("backend.openai.__main__:worker_app", factory=True, workers=args.workers, **options)
    return 0


if __name__ == "__main__":
    sys.exit(main())
