"""The runtime-side client any decode loop can embed: threshold pull (`ThresholdClient`), exact
edge aggregation (`Aggregator`), and the telemetry shipper with its disk spool
(`TelemetryShipper`). Depends on pydantic, httpx and msgpack only (`pip install
'exitplane[client]'`): no torch, FastAPI, SQLAlchemy or Celery. See docs/client.md and the
protocol in docs/protocol.md."""

from exitplane.client.aggregate import Aggregator
from exitplane.client.codec import EncodedBatch
from exitplane.client.shipper import TelemetryShipper
from exitplane.client.spool import Spool
from exitplane.client.thresholds import RefusedThresholdSet, ThresholdClient

__all__ = ["Aggregator", "EncodedBatch", "RefusedThresholdSet", "Spool", "TelemetryShipper",
           "ThresholdClient"]
