"""Tenants: who is calling (from the API key alone), what they may use, and how much (quotas, usage).

Pure parts, tested without I/O: `directory` (key -> tenant, constant time), `quota` (token
buckets with an injected clock, reservation and settlement), `usage` (what each tenant used, per
model and minute). The app layer wires them into the request path (server.gateway.app.proxied).
"""
