"""The results pages, rendered from the raw data of every recorded run, so that a figure in prose
cannot drift from its data and the figure a reader takes away is the typical one.

A headline figure is the median of every recorded run of one code, with the range and the count
("1.22x, 1.20-1.23x over 3 runs"); a run left out says why, and a run measured on an uncommitted
tree says so. The raw data: `docs/results/data/gateway-runs.json` (the relay runs of
`bench.workers_bench` and `bench.answer_length`), `loadtest/results/cache-aware-routing/*/summary.json`
(`make routing-experiment`), `loadtest/results/client-overhead/overhead.json`
(`python -m loadtest.selfcheck`) and `loadtest/results/watermark-trimming/` (the load tester's
requests). Pages written: docs/results/*.md and the headline table between the markers in
README.md; `tests/docs/test_results_pages.py` fails when a committed page differs from a fresh
render.

    python -m bench.results            # re-render the pages
    python -m bench.results --check    # exit 1 if a page differs from a fresh render
    python -m bench.results --plots    # also redraw docs/results/img/*.png (matplotlib)
"""
