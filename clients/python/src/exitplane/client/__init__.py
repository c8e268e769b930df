"""The runtime side of exitplane, for any decode loop: `Runtime` (and `AsyncRuntime` for
asyncio), the one object a loop holds, built from its parts: the threshold pull
(`ThresholdClient`), exact edge aggregation (`Aggregator`) and the telemetry shipper with its
disk spool (`TelemetryShipper`). Depends on pydantic, httpx and msgpack only (`pip install
./clients/python`, the exitplane-client distribution): no torch, FastAPI, SQLAlchemy or
Celery. How requests reach the control plane (TLS, client certificate, proxy, headers):
`exitplane.client.http`; the counters on Prometheus: `exitplane.client.metrics` (with
prometheus_client installed). See docs/client.md and the protocol in docs/protocol.md."""

from exitplane.client.aggregate import Aggregator
from exitplane.client.aio import AsyncRuntime
from exitplane.client.codec import EncodedBatch
from exitplane.client.runtime import Runtime
from exitplane.client.shipper import TelemetryShipper
from exitplane.client.spool import Spool
from exitplane.client.thresholds import RefusedThresholdSet, ThresholdClient

__all__ = ["Aggregator", "AsyncRuntime", "EncodedBatch", "RefusedThresholdSet", "Runtime",
           "Spool", "TelemetryShipper", "ThresholdClient"]
