"""The committed OpenAPI document (docs/openapi.json) is the app's: it fails when they drift
(run `python scripts/openapi.py` to regenerate), and it names every telemetry content type."""

import json
import re
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
    # JSON bodies refer to components (generators resolve no `$defs` inside an operation)
    assert body[RECORDS_JSON]["schema"] == {"$ref": "#/components/schemas/TelemetryBatch"}
    assert body[AGGREGATE_JSON]["schema"] == {"$ref": "#/components/schemas/AggregateBatch"}
    assert body[INTERVAL_JSON]["schema"] == {"$ref": "#/components/schemas/IntervalBatch"}
    assert "$defs" not in committed


def _table_statuses(text: str, heading: str) -> set[int]:
    """The status codes in the first table after `heading` in docs/protocol.md."""
    section = text[text.index(heading):]
    table = section[section.index("\n|"):]
    rows = [line for line in table.split("\n\n", 1)[0].splitlines() if line.startswith("| ")]
    codes: set[int] = set()
    for row in rows:
        codes |= {int(code) for code in re.findall(r"\b([1-5]\d\d)\b", row.split("|")[1])}
    return codes


def test_every_status_the_protocol_names_is_in_the_openapi_document():
    """A third-party runtime reads either document: a status one of them names and the other
    does not is a client that handles one it never gets, or misses one it does."""
    protocol = (ROOT / "docs" / "protocol.md").read_text()
    paths = json.loads((ROOT / "docs" / "openapi.json").read_text())["paths"]

    def answers(path: str, method: str) -> set[int]:
        return {int(code) for code in paths[path][method]["responses"]}

    pull = _table_statuses(protocol, "## Pull:")
    assert pull >= {200, 304, 401, 403, 404, 422, 429, 503}
    assert pull == answers("/v1/deployments/{name}/thresholds", "get")
    telemetry = _table_statuses(protocol, "### Answers and what to do")
    proxies_only = {408}  # a proxy in front of the control plane may answer it; we never do
    assert telemetry - proxies_only == answers("/v1/telemetry", "post")
    assert {409, 401, 403, 404, 422, 429, 503} <= answers(
        "/v1/deployments/{name}/heartbeats", "post")


def test_every_422_documents_the_body_the_app_sends():
    """The app answers a request that does not validate with `{detail, errors}`, not FastAPI's
    list of errors; a client generated from the document must read what it gets."""
    document = json.loads((ROOT / "docs" / "openapi.json").read_text())
    assert "HTTPValidationError" not in document["components"]["schemas"]
    refused = [op["responses"]["422"] for ops in document["paths"].values()
               for op in ops.values() if "422" in op["responses"]]
    assert len(refused) > 30
    assert {answer["content"]["application/json"]["schema"]["$ref"] for answer in refused} == {
        "#/components/schemas/Error"}
    error = document["components"]["schemas"]["Error"]
    assert error["required"] == ["detail"] and error["properties"]["errors"]["type"] == "array"


# -- what client generators need ---------------------------------------------------------------

DOCUMENT = json.loads((ROOT / "docs" / "openapi.json").read_text())
OPERATIONS = [(path, method, operation) for path, methods in DOCUMENT["paths"].items()
              for method, operation in methods.items()]
OPEN = {("/healthz", "get"), ("/readyz", "get")}


def test_every_operation_has_a_description_and_a_stable_unique_operation_id():
    ids = [operation["operationId"] for _, _, operation in OPERATIONS]
    assert len(ids) == len(set(ids))
    for path, method, operation in OPERATIONS:
        assert re.fullmatch(r"[a-z][a-z_]*", operation["operationId"]), (path, method)
        # more than the summary FastAPI makes of the function's name, and the token it needs
        said = operation["description"].split(" Needs ")[0].rstrip(".")
        assert len(said) > 10 and said != operation["summary"], (path, method)


def test_every_route_that_needs_a_token_names_the_bearer_scheme():
    assert DOCUMENT["components"]["securitySchemes"]["bearerAuth"] == {
        **DOCUMENT["components"]["securitySchemes"]["bearerAuth"], "type": "http",
        "scheme": "bearer"}
    for path, method, operation in OPERATIONS:
        if (path, method) in OPEN:
            assert "security" not in operation
            continue
        assert operation["security"] == [{"bearerAuth": []}], (path, method)
        assert {"401", "403"} <= set(operation["responses"]), (path, method)


def test_every_error_status_is_documented_with_the_one_error_schema():
    for path, method, operation in OPERATIONS:
        for status, answer in operation["responses"].items():
            if int(status) >= 400:
                assert answer["content"]["application/json"]["schema"] == {
                    "$ref": "#/components/schemas/Error"}, (path, method, status)
        if "requestBody" in operation and path != "/v1/telemetry":
            assert "415" in operation["responses"], (path, method)
        if method != "get":  # the body size limit reads every other request's body
            assert "413" in operation["responses"], (path, method)
        if "{" in path:  # what the path names may not exist
            assert "404" in operation["responses"], (path, method)
    error = DOCUMENT["components"]["schemas"]["Error"]
    assert error["required"] == ["detail"]
    assert error["properties"]["errors"]["items"]["properties"]["loc"]["type"] == "array"
    assert "HTTPValidationError" not in json.dumps(DOCUMENT)


def test_kinds_and_states_are_enums():
    schemas = DOCUMENT["components"]["schemas"]
    enums = {(name, field): set(schemas[name]["properties"][field]["enum"]) for name, field in [
        ("AlertRead", "kind"), ("AlertRead", "status"), ("AlertRead", "severity"),
        ("CalibrationJobRead", "status"), ("TokenRead", "scope"), ("TokenCreate", "scope"),
        ("HookRead", "kind")]}
    assert {"exit_rate_collapse", "runtime_stale"} <= enums[("AlertRead", "kind")]
    assert enums[("AlertRead", "status")] == {"firing", "acknowledged", "resolved"}
    assert "waiting_for_data" in enums[("CalibrationJobRead", "status")]
    assert enums[("TokenRead", "scope")] == {"runtime", "operator", "admin"}
