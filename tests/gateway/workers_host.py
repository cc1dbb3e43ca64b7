"""A gateway supervisor with its worker processes, for the `gateway` fixture's two-worker runs.

`python -m tests.gateway.workers_host` reads `{"settings", "models"}` (pickled) on stdin and runs
`server.gateway.serving.serve` with them: the supervisor `python -m server serve --workers N`
becomes, with the test's settings exactly as built (no YAML round trip), on the port they name
(0: one picked for all workers, logged as `gateway on http://host:port/v1 ... with N workers`).
"""

from __future__ import annotations

import pickle
import sys

from server.gateway.serving import configure_logging, run, serve


def main() -> int:
    spec = pickle.load(sys.stdin.buffer)
    configure_logging(spec["settings"])
    return int(run(serve(spec["settings"], spec["models"])))


if __name__ == "__main__":
    sys.exit(main())
