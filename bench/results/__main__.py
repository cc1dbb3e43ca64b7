"""python -m bench.results [--check] [--plots]"""

from __future__ import annotations

import argparse
import sys

from bench.results import __doc__ as DOC
from bench.results.data import RESULTS, ROOT
from bench.results.pages import pages, stale
from bench.results.plots import plots


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.results", description=DOC.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page differs from a fresh render")
    parser.add_argument("--plots", action="store_true", help="also redraw docs/results/img/*.png")
    args = parser.parse_args(argv)
    if args.check:
        for path in stale():
            print(f"stale: {path.relative_to(ROOT)} (run: python -m bench.results)")
        return 1 if stale() else 0
    for path, text in pages().items():
        path.write_text(text)
        print(f"wrote {path.relative_to(ROOT)}")
    if args.plots:
        plots()
        print(f"wrote {(RESULTS / 'img').relative_to(ROOT)}/*.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
