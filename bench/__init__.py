"""Benchmarks (`make bench`): the gateway against direct access and vLLM's Rust router, on a stand-in engine."""
