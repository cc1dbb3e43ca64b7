"""The gateway's own store of Responses (OpenAI's `store: true`), so engines keep no state.

    records     what one stored response is (`StoredResponse`), and the pure functions around it:
                an input as items, a chain as the next request's input, the OpenAI shapes
    answer      reading an engine's answer (a JSON body or a Responses SSE stream) for its record
    store       the interface (`ResponseStore`), its errors, and `open_store` for the settings
    migrations  the versioned schema, one list per backend
    sqlite      the embedded default: one file, WAL, off the event loop (a thread)
    postgres    several gateway replicas on one database (psycopg 3, async pool)

The routes that use it (create, retrieve, delete, input items, cancel) are app.responses.
"""
