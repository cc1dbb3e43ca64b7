"""The top of the gateway: the application `create_app` assembles, its own routes and its auth."""

from server.gateway.app.factory import create_app

__all__ = ["create_app"]
