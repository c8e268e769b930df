"""No single client can make the API buffer or decode without bound (telemetry and heartbeats):

- the token and its rate limit are checked from the headers before a byte of the body is read
  (a caller without a valid token, or past its rate, is answered while its body is still
  arriving, so the body is never buffered);
- a body decodes to at most EXITPLANE_TELEMETRY_MAX_BATCH_ITEMS values, counted while it is
  decoded (413: the runtime splits it), so a small body cannot expand in memory;
- at most EXITPLANE_TELEMETRY_MAX_DECODES large bodies are read and decoded at once per process
  (past it: 429 with Retry-After, before the body is read: one client can fill them, so never
  a 5xx);
- deeply nested JSON is a 4xx on every route, never a 500.

Memory figures against a real API process: bench/telemetry_bounds.py."""

from __future__ import annotations

import contextlib
import json
import random
import re
import socket
import threading
import time
import tracemalloc
import uuid

import httpx
import msgpack
import pytest
from fastapi.testclient import TestClient
from sqlalchemy.orm import Session

from controlplane.auth.service import create_token
from controlplane.deployments.service import get_deployment
from exitplane.app import create_app
from exitplane.kit.json_depth import MAX_JSON_DEPTH
from exitplane.wire import INTERVAL_JSON, RECORDS_JSON, RECORDS_MSGPACK
from tests.support.batches import random_batch, telemetry_batch
from tests.support.deployments import deploy_for_telemetry
from tests.support.network import free_port, raw_response

pytestmark = pytest.mark.parametrize("db_url", ["sqlite"], indirect=True)

MIB = 1024 * 1024


@contextlib.contextmanager
def serving(settings, engine, **update):
    """The app for `settings` (with `update`) on a real uvicorn, on a loopback port; yields
    (port, an httpx client to it)."""
    import uvicorn

    app = create_app(settings.model_copy(update=update), engine=engine)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=30) as client:
            yield port, client
    finally:
        server.should_exit = True
        thread.join(10)
        app.state.config_delivery.close()
        app.state.heartbeats.close()


def _head(path: str, port: int, length: int, headers: dict[str, str],
          content_type: str = "application/json") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: 127.0.0.1:{port}", f"Content-Type: {content_type}",
             f"Content-Length: {length}", *(f"{k}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _response(connection: socket.socket) -> tuple[int, dict, dict]:
    """(status, JSON body, headers) of the answer on `connection`."""
    status, headers, body = raw_response(connection)
    return status, json.loads(body), headers


@contextlib.contextmanager
def partial_post(port: int, path: str, *, length: int, sent: bytes, headers: dict[str, str],
                 content_type: str = "application/json"):
    """A connection that declared a `length`-byte body and sent only `sent` of it."""
    # A refusal comes at once; the wait bounds only how long a failing test hangs, and a whole
    # batch stored on a loaded machine's SQLite can take seconds.
    connection = socket.create_connection(("127.0.0.1", port), timeout=30)
    try:
        connection.sendall(_head(path, port, length, headers, content_type) + sent)
        yield connection
    finally:
        connection.close()


def _records_msgpack(rng: random.Random, n: int, **kwargs) -> bytes:
    # Timed in the past: a batch's tokens are 0.7 s apart, and the API refuses the future.
    return msgpack.packb(random_batch(rng, n=n, ts=time.time() - n, **kwargs), use_bin_type=True)


def test_telemetry_refuses_by_the_headers_before_reading_the_body(settings, engine, tokens):
    # A burst of one, then one batch every 20 s: the second batch is past the rate.
    with serving(settings, engine, rate_limit_ingest_per_s=0.05) as (port, client):
        runtime = deploy_for_telemetry(client, tokens, engine)
        # 15 MiB declared (within EXITPLANE_MAX_BODY_BYTES), 64 KiB sent, then silence: only
        # a server that answers before reading the body answers at all.
        for headers, status in (({}, 401), ({"Authorization": "Bearer ept_unknown"}, 401)):
            with partial_post(port, "/v1/telemetry", length=15 * MIB, sent=b"{" * 65536,
                              headers=headers) as connection:
                answer = _response(connection)
            assert answer[0] == status and "token" in answer[1]["detail"], answer
        first = client.post("/v1/telemetry", headers={**runtime, "Content-Type": RECORDS_MSGPACK},
                            content=_records_msgpack(random.Random(1), 20))
        assert first.status_code == 202, first.text
        with partial_post(port, "/v1/telemetry", length=15 * MIB, sent=b"\x80" * 65536,
                          headers=runtime, content_type=RECORDS_MSGPACK) as connection:
            status, body, headers = _response(connection)
        assert status == 429 and "too many ingest requests" in body["detail"]
        assert headers["retry-after"] == "20"


def test_heartbeats_refuse_by_the_headers_before_reading_the_body(settings, engine, tokens):
    with serving(settings, engine) as (port, client):
        deploy_for_telemetry(client, tokens, engine)
        with partial_post(port, "/v1/deployments/chat/heartbeats", length=60_000,
                          sent=b"[" * 1000, headers={}) as connection:
            status, body, headers = _response(connection)
    assert status == 401 and headers["www-authenticate"] == "Bearer", body


@pytest.mark.parametrize("content_type", [RECORDS_MSGPACK, RECORDS_JSON])
def test_a_batch_past_the_value_budget_is_413_and_its_halves_pass(tokens, engine, content_type,
                                                                  settings):
    app = create_app(settings.model_copy(update={"telemetry_max_batch_items": 10_000}),
                     engine=engine)
    with TestClient(app) as client:
        runtime = deploy_for_telemetry(client, tokens, engine)
        batch = random_batch(random.Random(2), n=2000, shadow_rate=0,  # ~16,000 values
                             ts=time.time() - 1500)
        encode = (lambda b: msgpack.packb(b, use_bin_type=True)) if "msgpack" in content_type \
            else (lambda b: json.dumps(b).encode())
        headers = {**runtime, "Content-Type": content_type}
        whole = client.post("/v1/telemetry", headers=headers, content=encode(batch))
        assert whole.status_code == 413, whole.text
        assert "more than 10000 values" in whole.json()["detail"]
        assert "split it" in whole.json()["detail"]
        for index, half in enumerate((batch["records"][:1000], batch["records"][1000:])):
            part = {**batch, "batch_id": batch["batch_id"] + "ab"[index], "records": half}
            answer = client.post("/v1/telemetry", headers=headers, content=encode(part))
            assert answer.status_code == 202, answer.text
    app.state.config_delivery.close()
    app.state.heartbeats.close()


def _peak_mib(act) -> float:
    tracemalloc.start()
    try:
        act()
        return tracemalloc.get_traced_memory()[1] / MIB
    finally:
        tracemalloc.stop()


@pytest.mark.slow
@pytest.mark.parametrize("content_type", [RECORDS_MSGPACK, INTERVAL_JSON])
def test_an_expanding_body_costs_no_more_than_its_bytes(client, tokens, engine, content_type):
    """A 6 MiB body of tiny values (what decodes to the most objects per byte) costs about
    what a 6 MiB body refused at its first byte costs: the decode stops at the value budget."""
    runtime = deploy_for_telemetry(client, tokens, engine)
    headers = {**runtime, "Content-Type": content_type}
    size = 6 * MIB
    if "msgpack" in content_type:  # 6,000 lists of 1,000 zeros (1 byte each): 6M values
        packer = msgpack.Packer(use_bin_type=True)
        header = {"batch_id": uuid.uuid4().hex, "deployment": "chat", "runtime_id": "rt-1",
                  "seq": 0, "num_layers": 12}
        inner = packer.pack_array_header(1000) + b"\x00" * 1000
        count = size // len(inner)
        expanding = packer.pack_map_header(len(header) + 1) + b"".join(
            packer.pack(key) + packer.pack(value) for key, value in header.items()) + \
            packer.pack("records") + packer.pack_array_header(count) + inner * count
        refused = b"\xc1" + b"\x00" * (len(expanding) - 1)
    else:  # record columns of 0s: 2 bytes ("0,") a value
        values = ",".join(["0"] * (size // 2))
        expanding = (f'{{"batch_id": "{uuid.uuid4().hex}", "deployment": "chat", '
                     f'"runtime_id": "rt-1", "seq": 0, "num_layers": 12, '
                     f'"raw_sample_rate": 0, "records": {{"position": [{values}]}}}}').encode()
        refused = b"}" + b" " * (len(expanding) - 1)
    answers = []
    cheap = _peak_mib(lambda: answers.append(client.post(
        "/v1/telemetry", headers=headers, content=refused)))
    costly = _peak_mib(lambda: answers.append(client.post(
        "/v1/telemetry", headers=headers, content=expanding)))
    # Unbounded, the 6M values cost ~50 MiB of pointers alone, and more to validate.
    assert costly - cheap < 16, (cheap, costly)
    assert [answer.status_code for answer in answers] == [422, 413], [a.text for a in answers]


def test_large_bodies_past_the_decode_slots_get_429_before_they_are_read(settings, engine,
                                                                          tokens):
    with serving(settings, engine, telemetry_max_decodes=1) as (port, client):
        runtime = deploy_for_telemetry(client, tokens, engine)
        large = _records_msgpack(random.Random(3), 2000, shadow_rate=0)
        assert len(large) > 64 * 1024
        with partial_post(port, "/v1/telemetry", length=len(large), sent=large[:4096],
                          headers=runtime, content_type=RECORDS_MSGPACK) as holding:
            time.sleep(0.3)  # its slot is taken while its body arrives
            with partial_post(port, "/v1/telemetry", length=len(large), sent=large[:4096],
                              headers=runtime, content_type=RECORDS_MSGPACK) as second:
                status, body, headers = _response(second)
            assert status == 429 and headers["retry-after"] == "1", body
            assert "EXITPLANE_TELEMETRY_MAX_DECODES" in body["detail"]
            # A small batch needs no slot.
            small = client.post("/v1/telemetry", content=_records_msgpack(
                random.Random(4), 20, seq=1), headers={**runtime, "Content-Type": RECORDS_MSGPACK})
            assert small.status_code == 202, small.text
            holding.sendall(large[4096:])
            assert _response(holding)[0] == 202
        # The slot is free again.
        again = client.post("/v1/telemetry", content=_records_msgpack(
            random.Random(5), 2000, shadow_rate=0, seq=2),
            headers={**runtime, "Content-Type": RECORDS_MSGPACK})
        assert again.status_code == 202, again.text


def _nested(depth: int, kind: str) -> bytes:
    if kind == "list":
        return b"[" * depth + b"]" * depth
    return b'{"a":' * depth + b"1" + b"}" * depth


@pytest.mark.parametrize("fast_path", [True, False])
def test_deeply_nested_json_is_4xx_on_every_route(settings, engine, tokens, fast_path):
    app = create_app(settings.model_copy(update={"telemetry_fast_path": fast_path}),
                     engine=engine)
    failures = []
    with TestClient(app, raise_server_exceptions=False) as client:
        runtime = deploy_for_telemetry(client, tokens, engine)
        spec = client.get("/openapi.json").json()
        targets = []
        for path, operations in spec["paths"].items():
            for method in operations:
                if method in ("post", "put", "patch"):
                    concrete = re.sub(r"\{[^}]+\}", "1", path.replace("{name}", "chat"))
                    targets.append((method.upper(), concrete, "application/json"))
        targets += [("POST", "/v1/telemetry", media) for media in (
            INTERVAL_JSON, "application/vnd.exitplane.aggregate+json")]
        assert len(targets) >= 15
        scopes = [runtime, tokens.headers(tokens.operator), tokens.headers(tokens.admin), {}]
        for method, path, media in targets:
            for depth in (MAX_JSON_DEPTH + 1, 200, 990, 3000, 12_000):
                for kind in ("list", "dict"):
                    for headers in scopes:
                        answer = client.request(method, path, content=_nested(depth, kind),
                                                headers={**headers, "Content-Type": media})
                        # Refused before any decoder saw it: by the caller check, its size or
                        # its depth (a decoder's failure would be a 400 or a 5xx).
                        if answer.status_code not in (401, 403, 413, 422) or (
                                answer.status_code == 422
                                and "nests deeper than" not in answer.json()["detail"]):
                            failures.append(f"{method} {path} {media} {depth} {kind} "
                                            f"{sorted(headers)}: {answer.status_code}")
    app.state.config_delivery.close()
    app.state.heartbeats.close()
    assert failures == [], "\n".join(failures[:20])


def test_a_body_at_the_depth_limit_reaches_validation(settings, engine, tokens):
    """The depth gate refuses only past the limit: a body exactly at it is decoded and
    validated as usual (a field error)."""
    app = create_app(settings, engine=engine)
    with TestClient(app) as client:
        for headers in ({"Content-Type": "application/json"},
                        {"Content-Type": "application/merge-patch+json; charset=utf-8"}):
            answer = client.post("/v1/deployments",
                                 content=_nested(MAX_JSON_DEPTH, "dict"),
                                 headers={**tokens.headers(tokens.admin), **headers})
            assert answer.status_code == 422
            assert answer.json()["detail"].startswith("body.name:"), answer.json()
            deeper = client.post("/v1/deployments",
                                 content=_nested(MAX_JSON_DEPTH + 1, "dict"),
                                 headers={**tokens.headers(tokens.admin), **headers})
            assert deeper.status_code == 422
            assert "nests deeper than" in deeper.json()["detail"]


def test_large_bodies_past_the_decode_budget_get_429_before_they_are_read(settings, engine,
                                                                           tokens):
    """The budget is charged twice a body's declared length on arrival: with a 4 MiB budget,
    one 1.5 MiB body under way leaves no room for another, whatever slots are free."""
    with serving(settings, engine, telemetry_max_decodes=8,
                 telemetry_decode_budget_mib=4) as (port, client):
        runtime = deploy_for_telemetry(client, tokens, engine)
        length = 3 * MIB // 2
        with partial_post(port, "/v1/telemetry", length=length, sent=b"\x80" * 4096,
                          headers=runtime, content_type=RECORDS_MSGPACK):
            time.sleep(0.3)  # its share is taken while its body arrives
            with partial_post(port, "/v1/telemetry", length=length, sent=b"\x80" * 4096,
                              headers=runtime, content_type=RECORDS_MSGPACK) as second:
                status, body, headers = _response(second)
            assert status == 429 and headers["retry-after"] == "1", body
            assert "EXITPLANE_TELEMETRY_DECODE_BUDGET_MIB" in body["detail"]
        # The first client left: its share is free again.
        batch = _records_msgpack(random.Random(6), 1000, shadow_rate=0)
        assert len(batch) > 64 * 1024
        deadline = time.monotonic() + 5
        while True:
            answer = client.post("/v1/telemetry", content=batch,
                                 headers={**runtime, "Content-Type": RECORDS_MSGPACK})
            if answer.status_code != 429 or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert answer.status_code == 202, answer.text


def test_a_batch_needing_more_than_the_whole_budget_is_413_and_its_halves_pass(
        settings, engine, tokens):
    app = create_app(settings.model_copy(update={"telemetry_decode_budget_mib": 4}),
                     engine=engine)
    with TestClient(app) as client:
        runtime = deploy_for_telemetry(client, tokens, engine)
        # 4,000 records of 7 fields: ~60,000 values with the keys, ~6 MB at 100 bytes each.
        batch = random_batch(random.Random(7), n=4000, shadow_rate=0, ts=time.time() - 3000)
        headers = {**runtime, "Content-Type": RECORDS_MSGPACK}
        whole = client.post("/v1/telemetry", headers=headers,
                            content=msgpack.packb(batch, use_bin_type=True))
        assert whole.status_code == 413, whole.text
        assert "EXITPLANE_TELEMETRY_DECODE_BUDGET_MIB" in whole.json()["detail"]
        assert "split it" in whole.json()["detail"]
        for index, half in enumerate((batch["records"][:2000], batch["records"][2000:])):
            part = {**batch, "batch_id": batch["batch_id"] + "ab"[index], "records": half}
            answer = client.post("/v1/telemetry", headers=headers,
                                 content=msgpack.packb(part, use_bin_type=True))
            assert answer.status_code == 202, answer.text
    app.state.config_delivery.close()
    app.state.heartbeats.close()


def _keyed_maps(size: int) -> bytes:
    """A record batch of one-entry maps keyed by new strings: ~70 bytes a value decoded, the
    most of any shape (bench/telemetry_bounds.py's `keyed_maps`)."""
    return msgpack.packb(telemetry_batch([{f"k{i:x}": 0} for i in range(size // 10)],
                                         num_layers=12), use_bin_type=True)


@pytest.mark.slow
def test_decode_memory_is_bounded_by_bytes_whatever_the_bodies_hold(settings, engine, tokens):
    """Eight 1.7 MiB bodies of the costliest shape at once, eight decode slots: with slots
    alone each decoded to ~60 MiB (about 500 MiB together); the budget holds them to it."""
    budget = 16
    with serving(settings, engine, telemetry_max_decodes=8,
                 telemetry_decode_budget_mib=budget) as (port, client):
        runtime = deploy_for_telemetry(client, tokens, engine)
        bodies = [_keyed_maps(2 * MIB) for _ in range(8)]
        headers = {**runtime, "Content-Type": RECORDS_MSGPACK}
        statuses: list[int] = []

        def post(body: bytes) -> None:
            with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=120) as own:
                statuses.append(own.post("/v1/telemetry", content=body,
                                         headers=headers).status_code)

        def all_at_once() -> None:
            threads = [threading.Thread(target=post, args=(body,)) for body in bodies]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(120)

        peak = _peak_mib(all_at_once)
        # Together they are refused: 429 while others hold the budget, 413 for one that got
        # far enough to show it alone needs more than all of it; which, depends on the race.
        assert len(statuses) == 8 and set(statuses) <= {413, 429}, statuses
        # Retried alone, as a runtime does after 429, the batch is told to split.
        alone = client.post("/v1/telemetry", content=bodies[0], headers=headers)
        assert alone.status_code == 413 and "split" in alone.json()["detail"], alone.text
    # The budget, plus what the eight bodies cost on their way in (client and server side).
    assert peak < budget + 8 * 2 * 2 + 8, peak


def test_an_answer_before_the_body_closes_the_connection(settings, engine, tokens):
    """A caller refused before its body was read (no token; no decode slot) is answered and
    disconnected: the rest of its body is never read, where keeping the connection would read
    and discard up to EXITPLANE_MAX_BODY_BYTES on the event loop every pull waits for."""
    with serving(settings, engine, telemetry_max_decodes=1) as (port, client):
        runtime = deploy_for_telemetry(client, tokens, engine)
        large = _records_msgpack(random.Random(8), 2000, shadow_rate=0)
        with partial_post(port, "/v1/telemetry", length=len(large), sent=large[:4096],
                          headers=runtime, content_type=RECORDS_MSGPACK) as holding:
            time.sleep(0.3)
            for headers, status in (({}, 401), (runtime, 429)):
                with partial_post(port, "/v1/telemetry", length=15 * MIB, sent=b"\x80" * 4096,
                                  headers=headers, content_type=RECORDS_MSGPACK) as refused:
                    answer = _response(refused)
                    assert answer[0] == status and answer[2]["connection"] == "close", answer
                    assert refused.recv(65536) == b"", "the connection stayed open"
            holding.sendall(large[4096:])
            status, _, headers = _response(holding)
            assert status == 202 and "connection" not in headers  # a whole body keeps it


def test_a_batch_too_large_to_decode_costs_its_token_what_it_cost_to_read(settings, engine,
                                                                           tokens):
    """A body refused only while decoding has been read and partly decoded: the token owes
    one ingest unit per 64 KiB of it (at one request of its rate, repeating it would cost next
    to nothing), so its next batch waits (429) and another token's does not."""
    with serving(settings, engine, telemetry_decode_budget_mib=16,
                 rate_limit_ingest_per_s=10) as (_port, client):  # bursts of 20 units
        runtime = deploy_for_telemetry(client, tokens, engine)
        with Session(engine) as session:
            deployment = get_deployment(session=session, name="chat")
            _, other = create_token(session=session, name="rt-other", scope="runtime",
                                    deployment=deployment)
            session.commit()
        large = client.post("/v1/telemetry", content=_keyed_maps(2 * MIB),  # ~32 units
                            headers={**runtime, "Content-Type": RECORDS_MSGPACK})
        assert large.status_code == 413, large.text
        small = _records_msgpack(random.Random(3), 10, shadow_rate=0)
        after = client.post("/v1/telemetry", content=small,
                            headers={**runtime, "Content-Type": RECORDS_MSGPACK})
        assert after.status_code == 429 and float(after.headers["Retry-After"]) >= 1, after.text
        elsewhere = client.post("/v1/telemetry", content=small, headers={
            "Authorization": f"Bearer {other}", "Content-Type": RECORDS_MSGPACK})
        assert elsewhere.status_code == 202, elsewhere.text
