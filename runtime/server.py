"""OpenAI-compatible HTTP inference on the early-exit engine: the entry points of the server,
whose parts live in runtime/serving/ (see its __init__ for the map).

One engine thread owns the model and runs continuous batching: requests join and leave between
steps, tokens flow back to the asyncio side through per-request queues. The threshold client
and the telemetry shipper run in their own background threads; the decode loop never waits on
the network.
"""

from runtime.server_metrics import ServeMetrics
from runtime.serving.app import create_serve_app, exit_when_engine_dies
from runtime.serving.schemas import MAX_STOP_CHARS, ChatRequest, CompletionRequest
from runtime.serving.state import ServeState, build_state
from runtime.serving.worker import EngineWorker

__all__ = ["MAX_STOP_CHARS", "ChatRequest", "CompletionRequest", "EngineWorker", "ServeMetrics",
           "ServeState", "build_state", "create_serve_app", "exit_when_engine_dies"]
