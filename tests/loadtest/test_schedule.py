"""Open-loop arrival schedules: mean rate, burstiness, constant spacing."""

import itertools
import random
import statistics

import pytest

from loadtest.schedule import arrival_times, gaps


def take(iterator, n):
    return list(itertools.islice(iterator, n))


@pytest.mark.parametrize("rate", [0.5, 4.0, 50.0])
def test_poisson_schedule_has_the_requested_mean_rate(rate):
    times = take(arrival_times(rate, arrival="poisson", rng=random.Random(1)), 20001)
    assert times[0] == 0.0
    measured = (len(times) - 1) / times[-1]
    assert measured == pytest.approx(rate, rel=0.03)
    # exponential gaps: coefficient of variation 1
    g = [b - a for a, b in zip(times, times[1:])]
    assert statistics.stdev(g) / statistics.mean(g) == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("burstiness", [0.25, 4.0])
def test_gamma_burstiness_sets_the_spread_not_the_rate(burstiness):
    g = take(gaps(10.0, arrival="gamma", burstiness=burstiness, rng=random.Random(2)), 20000)
    assert 1 / statistics.mean(g) == pytest.approx(10.0, rel=0.04)
    cv = statistics.stdev(g) / statistics.mean(g)
    assert cv == pytest.approx(burstiness**-0.5, rel=0.06)


def test_constant_and_seeded_determinism():
    assert take(arrival_times(4.0, arrival="constant", rng=random.Random(0)), 3) == [0, 0.25, 0.5]
    first = take(arrival_times(3.0, rng=random.Random(7)), 50)
    assert first == take(arrival_times(3.0, rng=random.Random(7)), 50)
    assert first != take(arrival_times(3.0, rng=random.Random(8)), 50)


def test_bad_parameters():
    with pytest.raises(ValueError):
        next(gaps(0, rng=random.Random()))
    with pytest.raises(ValueError):
        next(gaps(1, arrival="weird", rng=random.Random()))
