"""A stand-in for a vLLM process, for supervisor tests: serves /health, forks a grandchild.

`python -m tests.engine.fake_engine PORT [--crash-after S] [--exit-now]` — the grandchild
(`sleep`) checks that stopping the supervisor takes the whole process tree down.
"""

import argparse
import http.server
import subprocess
import sys
import threading
import time


class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - http.server's naming
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args):
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("port", type=int)
    parser.add_argument("--crash-after", type=float, default=None)
    parser.add_argument("--exit-now", action="store_true")
    parser.add_argument("--pidfile", default=None)
    args = parser.parse_args()
    print("fake engine starting", flush=True)
    if args.exit_now:
        print("fake engine: fatal error at start-up", flush=True)
        sys.exit(3)
    child = subprocess.Popen(["sleep", "600"])
    if args.pidfile:
        with open(args.pidfile, "a") as f:
            f.write(f"{child.pid}\n")
    server = http.server.HTTPServer(("127.0.0.1", args.port), Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    print(f"fake engine listening on {args.port}", flush=True)
    if args.crash_after is not None:
        time.sleep(args.crash_after)
        print("fake engine crashing", flush=True)
        sys.exit(1)  # the grandchild stays behind, in the same process group
    while True:
        time.sleep(1)


if __name__ == "__main__":
    main()
