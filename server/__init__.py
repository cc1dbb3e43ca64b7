"""Serving infrastructure for large language models on vLLM: profiles, engines, gateway."""
