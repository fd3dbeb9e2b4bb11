"""A stand-in for Triton's `generate_stream` (server-sent events) whose speed the test chooses:
instant (the clients are then the only limit) or paced with a cap on requests served at once
(the server is then the limit). For the load generator's saturation check, whose verdict depends
on who was slower, not on what the model computes."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class FakeTriton:
    def __init__(self, token_delay_s: float = 0.0, max_running: int | None = None):
        self.token_delay_s = token_delay_s
        self.slots = threading.Semaphore(max_running) if max_running else None
        self.requests = 0
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 - http.server's name
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                max_tokens = int(json.loads(body["sampling_parameters"]).get("max_tokens", 1))
                if server.slots is not None:
                    server.slots.acquire()
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "text/event-stream")
                    self.end_headers()
                    events = []
                    for i in range(max_tokens):
                        last = i == max_tokens - 1
                        delta = {"text_output": " a", "num_output_tokens": 1, "num_input_tokens": 1,
                                 "finish_reason": "length" if last else None}
                        events.append(f"data: {json.dumps(delta)}\n\n".encode())
                        if server.token_delay_s:
                            time.sleep(server.token_delay_s)
                            self.wfile.write(events.pop())
                            self.wfile.flush()
                    self.wfile.write(b"".join(events))  # instant: the whole stream in one write
                finally:
                    if server.slots is not None:
                        server.slots.release()
                server.requests += 1

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FakeTriton:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
