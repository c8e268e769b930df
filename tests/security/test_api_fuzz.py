"""Schemathesis over every /v1 operation of the OpenAPI spec, with a token of each scope:
no input may produce a 5xx, every answer's status is one the document lists for the operation
(a generated client reads it), and every 4xx says what was wrong."""

import random

import msgpack
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment


@schemathesis.serializer("application/msgpack")
def _msgpack(_ctx, value) -> bytes:
    return msgpack.packb(value) if not isinstance(value, bytes) else value


@pytest.mark.slow
@pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)
def test_no_operation_answers_5xx_and_every_4xx_has_a_message(client, app, tokens, engine):
    op = tokens.headers(tokens.operator)
    assert client.post("/v1/deployments", headers=op, json={
        "name": "chat", "model_ref": "m", "num_layers": 12, "exit_layers": [3, 6, 9],
        "signal": "maxprob"}).status_code == 201
    client.post("/v1/deployments/chat/threshold-sets", headers=op, json={
        "thresholds": {"3": 0.9, "6": 0.9, "9": 0.9}, "reason": "r", "activate": True})
    with Session(engine) as session:
        _, runtime = create_token(session=session, name="rt", scope="runtime",
                                  deployment=get_deployment(session=session, name="chat"))
        session.commit()
    scopes = [tokens.headers(tokens.admin), op, {"Authorization": f"Bearer {runtime}"}]
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        if not operation.path.startswith("/v1/"):
            continue
        operations += 1

        exercise(operation, scopes, failures)
    assert operations >= 15
    assert failures == [], "\n".join(failures[:20])


def exercise(operation, scopes, failures) -> None:
    @settings(max_examples=12, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy())
    def run(case):
        headers = random.Random(str(case.path_parameters)).choice(scopes)
        if case.path_parameters and "name" in case.path_parameters and \
                random.Random(str(case.body)).random() < 0.5:
            case.path_parameters["name"] = "chat"  # reach the handlers, not only 404s
        response = case.call(headers=headers)
        where = f"{operation.method.upper()} {operation.path}"
        if response.status_code >= 500:
            failures.append(f"{where} -> {response.status_code}: {response.text[:200]}")
        elif str(response.status_code) not in operation.definition.raw["responses"]:
            failures.append(f"{where} -> {response.status_code}, which the OpenAPI document "
                            f"does not list: {response.text[:200]}")
        elif 400 <= response.status_code < 500:
            body = response.json()
            if not (body.get("detail") or body.get("error")):
                failures.append(f"{where} -> {response.status_code} without a message")

    run()
