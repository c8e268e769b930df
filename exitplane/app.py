"""The composition root of the control plane's process: the HTTP API with the admin UI mounted.

    uvicorn --factory exitplane.app:create_app      # what `exitplane up` serves

The API (`controlplane.edge.app`) knows nothing of the UI; the UI (`dashboards`) stands on the
API's services and guards. Only this module puts the two together.
"""

from __future__ import annotations

from fastapi import FastAPI
from sqlalchemy.engine import Engine

from controlplane.edge.app import create_api
from controlplane.settings import Settings
from dashboards.app import mount_ui


def create_app(settings: Settings | None = None, engine: Engine | None = None) -> FastAPI:
    """The control plane as served: the API for `settings` (default: the environment's),
    optionally on `engine`, with the admin UI under /ui."""
    app = create_api(settings, engine)
    mount_ui(app)
    return app
