"""Why a config cannot be deployed: the compose renderer's error, with the reason for the operator.

`ComposeError` is raised by the compose renderer (server.deploy.compose) and the services it
renders (server.deploy.engine_service, server.deploy.gateway_service); `python -m server compose`
prints it as `error: <reason>` and exits 2. The Helm values' `HelmError` (server.deploy.helm) and
`ScaledServiceError` (server.deploy.scaled) are siblings, kept beside their renderers.
"""

from __future__ import annotations


class ComposeError(ValueError):
    """A gateway config that cannot be turned into a compose deployment, with the reason."""
