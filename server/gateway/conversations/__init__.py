"""Conversations the gateway owns: the Responses API's stored state (a response store with SQLite
and PostgreSQL backends), chains loaded and trimmed here and sent to engines stateless. Above
`proxy`, `trimming` and `tenants`, which it uses; below `app`, which serves its routes."""
