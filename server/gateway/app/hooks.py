"""Users' own routes, dependencies and middleware on the app the CLI serves: `app_hooks`.

A hook is `module:function`, a function that takes the FastAPI app and adds to it the FastAPI
way (`app.include_router(...)`, `app.add_middleware(...)`, `app.get(...)`). The config's
`app_hooks:` list and `python -m server serve --app-hook module:function` name them; every
worker process calls them on its own app, after the gateway's routes are in place:

    # myhooks.py (importable: on PYTHONPATH, or installed)
    from fastapi import FastAPI

    def setup(app: FastAPI) -> None:
        @app.get("/v1/whoami")
        async def whoami() -> dict[str, str]:
            return {"team": "planner"}

A hook that cannot be imported or called is refused at start with its name and the reason.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from typing import cast

from fastapi import FastAPI

from server.config import SettingsError


def load_hook(spec: str) -> Callable[[FastAPI], object]:
    """The function `module:function` names; SettingsError when it is not one."""
    module_name, sep, attribute = spec.partition(":")
    if not sep or not module_name or not attribute:
        raise SettingsError(f"app_hooks: {spec!r}: expected module:function")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # noqa: BLE001 - any import failure is the hook's, said as such
        raise SettingsError(f"app_hooks: {spec!r}: cannot import {module_name}: {exc}") from None
    hook = getattr(module, attribute, None)
    if not callable(hook):
        raise SettingsError(f"app_hooks: {spec!r}: {module_name} has no function {attribute}")
    return cast(Callable[[FastAPI], object], hook)


def apply_hooks(app: FastAPI, specs: Iterable[str]) -> None:
    """Call every hook with `app`, in order."""
    for spec in specs:
        hook = load_hook(spec)
        try:
            hook(app)
        except Exception as exc:  # noqa: BLE001
            raise SettingsError(f"app_hooks: {spec!r} failed: {type(exc).__name__}: {exc}") from None
