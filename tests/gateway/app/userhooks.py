"""A user's own additions to the gateway, as the README shows them: a route, a dependency, a middleware."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, HTTPException


def team(x_team: Annotated[str | None, Header()] = None) -> str:
    """A user's dependency: the caller's team, from a header of theirs."""
    if x_team is None:
        raise HTTPException(status_code=400, detail="send x-team")
    return x_team


class CountChunks:
    """A pure-ASGI middleware (as starlette recommends): marks every answer and counts body messages."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bodies = 0

        async def counting(message: Any) -> None:
            nonlocal bodies
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-user-middleware", b"seen")]}
            elif message["type"] == "http.response.body":
                bodies += 1
            await send(message)

        await self.app(scope, receive, counting)


def setup(app: FastAPI) -> None:
    @app.get("/v1/whoami")
    async def whoami(name: Annotated[str, Depends(team)]) -> dict[str, str]:
        return {"team": name}

    app.add_middleware(CountChunks)
