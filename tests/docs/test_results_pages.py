"""The results pages say what their raw data says: each generated page (docs/results/*.md and the
README's headline table) equals a fresh render by `python -m bench.results`, and every headline figure is
the median of the runs it counts. Broken links and anchors are `make docs`' part (mkdocs --strict)."""

from __future__ import annotations

import statistics

import pytest

from bench.results import data, figures
from bench.results.pages import README, gateway_runs_page, pages


@pytest.mark.parametrize("path", sorted(pages(), key=str), ids=lambda p: p.name)
def test_a_committed_results_page_equals_a_fresh_render_of_its_raw_data(path):
    fresh = pages()[path]
    assert path.exists(), f"{path} is missing: run python -m bench.results"
    assert path.read_text() == fresh, f"{path} differs from its raw data: run python -m bench.results"


def test_the_readme_carries_the_headline_table():
    assert README in pages()


def test_a_headline_is_the_median_of_its_runs_with_their_range_and_count():
    row = figures.Headline("x", [1.20, 1.26, 1.22, 1.23, 1.21], figures.ratio, "abc", "make bench", "p.md")
    assert row.cells("docs/") == ["[x](docs/p.md)", "**1.22x**", "1.20x - 1.26x", "5 runs", "abc", "`make bench`"]


def test_the_over_claimed_figures_are_the_typical_ones():
    by = {h.page.split("#")[1]: h for h in figures.headlines()}
    capped = by["two-workers-over-one"]
    assert len(capped.values) == 12 and statistics.median(capped.values) == pytest.approx(1.73)
    routing = by["cached-share-of-the-oracles"]
    assert len(routing.values) == 6 and min(routing.values) < 0.96  # not run f alone (0.98-1.01)


def test_a_run_on_an_uncommitted_tree_is_marked_on_its_page():
    dirty = [run for run in data.gateway_runs() if run["dirty"]]
    assert dirty
    page = gateway_runs_page()
    for run in dirty:
        assert f"{run['commit']} **(dirty tree)**" in page
