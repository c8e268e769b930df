"""The OpenAI-compatible runtime server, one job per module.

schemas.py    request shapes and bounds (pydantic)
worker.py     the engine thread: continuous batching, per-request queues, death and hangs
detokenize.py incremental detokenizer with stop strings
respond.py    one completion or chat request: JSON answer or SSE stream
state.py      ServeState and build_state (engine thread, threshold client, shipper)
app.py        the FastAPI app: probes, /metrics, routes, shutdown

Metrics live in runtime/server_metrics.py, the API-key and body-size front door in
runtime/serve_guard.py; runtime/server.py is the entry point the CLI imports.
"""
