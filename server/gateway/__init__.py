"""The OpenAI-compatible gateway in front of vLLM engines."""
