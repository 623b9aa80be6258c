"""A stand-in for an OpenAI-compatible server, for the tests of benchmarks/bench_server_compare.py
(the benchmark's orchestration, not a server): ``/health``, ``/v1/models`` and streamed
``/v1/chat/completions`` that answer ``max_tokens`` chunks of one token each.

    python tests/openai_stub_server.py --port N [--name NAME] [--no-usage] [--start-delay S]
        [--loading-for S] [--cpu-ms-per-token MS] [--fail-at-start] [other arguments, ignored]

``--start-delay``: it listens only after S seconds; ``--loading-for``: then ``/health`` answers
503 ``{"status": "loading"}`` for S more seconds before 200, as a server loading its model.

With ``STUB_EVENTS=FILE`` in the environment it appends ``start NAME`` when it starts and
``stop NAME`` when SIGTERM stops it, so that a test can see which servers ran at the same time.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def record(event: str) -> None:
    path = os.environ.get("STUB_EVENTS")
    if path:
        with open(path, "a") as events:
            events.write(event + "\n")


def handler(name: str, usage: bool, cpu_s_per_token: float, ready_at: float = 0.0):
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):  # quiet
            pass

        def send_json(self, body: dict, status: int = 200) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            if self.path == "/health" and time.monotonic() < ready_at:
                self.send_json({"status": "loading"}, 503)
            elif self.path == "/health":
                self.send_json({"status": "ok"})
            elif self.path == "/v1/models":
                self.send_json({"data": [{"id": name}]})
            else:
                self.send_error(404)

        def do_POST(self):
            if self.path != "/v1/chat/completions":
                self.send_error(404)
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            for _ in range(body["max_tokens"]):
                spin_until = time.thread_time() + cpu_s_per_token
                while time.thread_time() < spin_until:  # the CPU a token costs
                    pass
                self.event({"choices": [{"index": 0, "delta": {"content": "x"}}]})
            if usage:
                self.event({"choices": [], "usage": {"completion_tokens": body["max_tokens"]}})
            self.wfile.write(b"data: [DONE]\n\n")

        def event(self, chunk: dict) -> None:
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.flush()

    return Handler


class Server(ThreadingHTTPServer):
    request_queue_size = 128  # 32 clients connect at once
    daemon_threads = True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--name", default=os.path.basename(sys.argv[0]))
    parser.add_argument("--no-usage", action="store_true")
    parser.add_argument("--start-delay", type=float, default=0.0)
    parser.add_argument("--loading-for", type=float, default=0.0)
    parser.add_argument("--cpu-ms-per-token", type=float, default=0.0)
    parser.add_argument("--fail-at-start", action="store_true")
    args, _ = parser.parse_known_args()
    record(f"start {args.name}")

    def stop(*_):
        record(f"stop {args.name}")
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    if args.fail_at_start:
        print(f"{args.name}: failing at start as asked", flush=True)
        sys.exit(3)
    time.sleep(args.start_delay)
    server = Server(
        ("127.0.0.1", args.port),
        handler(
            args.name,
            not args.no_usage,
            args.cpu_ms_per_token / 1e3,
            time.monotonic() + args.loading_for,
        ),
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
