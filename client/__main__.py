"""python -m client "prompt" [--stream] [--protocol grpc|http] [--url HOST:PORT] [--max-tokens N]
                             [--temperature T] [--chat]

Prints the generated text (as it streams with --stream) and a one-line summary on stderr.
"""

from __future__ import annotations

import argparse
import sys

from client.chat import chat_prompt
from client.types import ServerError

DEFAULT_URLS = {"grpc": "127.0.0.1:8001", "http": "127.0.0.1:8000"}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client", description="Generate text with the Triton server.")
    parser.add_argument("prompt")
    parser.add_argument("--stream", action="store_true", help="print tokens as they arrive")
    parser.add_argument("--protocol", choices=sorted(DEFAULT_URLS), default="grpc")
    parser.add_argument("--url", help="host:port (default 127.0.0.1:8001 for grpc, 127.0.0.1:8000 for http)")
    parser.add_argument("--model", default="deepseek_v4")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--chat", action="store_true",
                        help="wrap the prompt in DeepSeek's chat template: <｜User｜>PROMPT<｜Assistant｜>")
    parser.add_argument("--echo", action="store_true", help="include the prompt in the output (non-streaming)")
    args = parser.parse_args(argv)

    prompt = chat_prompt(args.prompt) if args.chat else args.prompt
    url = args.url or DEFAULT_URLS[args.protocol]
    if args.protocol == "grpc":
        from client.grpc import GrpcClient

        client = GrpcClient(url, args.model)
    else:
        from client.http import HttpClient

        client = HttpClient(url, args.model)
    try:
        if args.stream:
            from client.types import Result

            deltas = []
            for delta in client.generate_stream(prompt, args.max_tokens, args.temperature):
                deltas.append(delta)
                print(delta.text, end="", flush=True)
            print()
            result = Result.join(deltas)
        else:
            result = client.generate(prompt, args.max_tokens, args.temperature,
                                     exclude_input_in_output=not args.echo)
            print(result.text)
    except ServerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (ConnectionError, OSError) as e:
        print(f"error: cannot reach the server at {url} ({args.protocol}): {e}", file=sys.stderr)
        return 1
    ttft = "" if result.ttft_s is None else f", TTFT {result.ttft_s * 1000:.0f} ms"
    print(f"[{result.num_input_tokens} prompt tokens, {result.num_output_tokens} generated, finish "
          f"{result.finish_reason}{ttft}, total {result.e2e_s * 1000:.0f} ms]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
