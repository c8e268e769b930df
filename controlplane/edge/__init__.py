"""The HTTP edge of the control plane, one concern per module: the API composed (`app.py`), its
front door and request context (`front.py`), the body gate, reader and replay (`body.py`), the
pure-ASGI JSON answers (`answers.py`), error handlers (`handlers.py`), the OpenAPI document's
completion (`openapi.py`), the probes (`probes.py`), and the fast paths of the config pull
(`pull_fast_path.py`) and of telemetry and heartbeats (`telemetry_fast_path.py`), which apply
their routes' own rules and the guards' policy table."""
