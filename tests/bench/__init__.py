"""Tests of the benchmark tools in bench/."""
