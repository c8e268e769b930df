"""The committed OpenAPI document (docs/openapi.json) is the app's: it fails when they drift
(run `python scripts/openapi.py` to regenerate), and it names every telemetry content type."""

import json
import runpy
from pathlib import Path

from exitplane.wire import (
    AGGREGATE_JSON,
    AGGREGATE_MSGPACK,
    INTERVAL_JSON,
    INTERVAL_MSGPACK,
    RECORDS_JSON,
    RECORDS_MSGPACK,
)

ROOT = Path(__file__).resolve().parents[1]


def test_committed_openapi_matches_the_app():
    document = runpy.run_path(str(ROOT / "scripts" / "openapi.py"))["document"]()
    committed = (ROOT / "docs" / "openapi.json").read_text()
    assert committed == document, "docs/openapi.json is out of date: run python scripts/openapi.py"
    body = json.loads(committed)["paths"]["/v1/telemetry"]["post"]["requestBody"]["content"]
    assert set(body) == {RECORDS_JSON, RECORDS_MSGPACK, AGGREGATE_JSON, AGGREGATE_MSGPACK,
                         INTERVAL_JSON, INTERVAL_MSGPACK}
    assert body[AGGREGATE_JSON]["schema"]["title"] == "AggregateBatch"
    assert body[INTERVAL_JSON]["schema"]["title"] == "IntervalBatch"
