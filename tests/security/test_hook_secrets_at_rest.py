"""Hook credentials (webhook HMAC secrets, PagerDuty routing keys, Slack and
webhook URLs) are encrypted in the store with a key derived from the secret key, shown masked
after creation, and migration 0006 encrypts the rows stored before it."""

from __future__ import annotations

import hashlib
import hmac

from sqlalchemy import text
from sqlalchemy.orm import Session

from controlplane.alerts import delivery_service, hook_service, hooks, service
from controlplane.alerts.service import Condition
from controlplane.db import make_engine
from controlplane.keys import ENCRYPTED_PREFIX, Vault, vault
from controlplane.migrate import downgrade, upgrade
from controlplane.settings import Settings
from tests.support.alerts import Receiver, make_deployment

SLACK_PATH = "/services/T0SECRET/B0SECRET/slackkeyslackkeyslackkey"
HMAC_SECRET = "hmac-secret-hmac-secret-hmac-secret"
ROUTING_KEY = "pdroutingkeypdroutingkeypdrouting"


def _stored(engine) -> list[tuple]:
    with engine.connect() as connection:
        return [tuple(row) for row in connection.execute(text(
            "SELECT url, secret, routing_key FROM alert_hooks ORDER BY id"))]


def test_the_store_holds_no_plaintext_and_the_api_shows_it_masked(client, tokens, engine):
    admin = tokens.headers(tokens.admin)
    specs = [{"name": "slack", "kind": "slack", "url": f"https://hooks.slack.com{SLACK_PATH}"},
             {"name": "pd", "kind": "pagerduty", "routing_key": ROUTING_KEY,
              "url": "https://events.pagerduty.com/v2/enqueue"},
             {"name": "hook", "kind": "webhook", "secret": HMAC_SECRET,
              "url": "https://receiver.example.com/in?token=querytokenquerytoken"},
             {"name": "generated", "kind": "webhook", "url": "https://receiver.example.com/"}]
    created = [client.post("/v1/hooks", headers=admin, json=spec) for spec in specs]
    assert [answer.status_code for answer in created] == [201] * 4
    generated = created[3].json()["secret"]
    assert len(generated) >= 32  # shown once, in the clear, on creation

    stored = _stored(engine)
    everything = repr(stored)
    for plain in ("slackkey", "T0SECRET", HMAC_SECRET, ROUTING_KEY, "querytoken", generated,
                  "receiver.example.com", "hooks.slack.com"):
        assert plain not in everything, plain
    assert all(value.startswith(ENCRYPTED_PREFIX) for row in stored for value in row if value)

    listed = {hook["name"]: hook for hook in client.get("/v1/hooks", headers=admin).json()}
    assert listed["slack"]["url"] == "https://hooks.slack.com/…"
    assert listed["hook"]["url"] == "https://receiver.example.com/…"
    assert listed["pd"]["has_routing_key"] and listed["hook"]["has_secret"]
    shown = repr(listed)
    assert "slackkey" not in shown and "querytoken" not in shown and ROUTING_KEY not in shown
    assert HMAC_SECRET not in shown and generated not in shown


def test_a_key_derived_from_another_secret_cannot_read_them():
    sealed = Vault("a" * 48).encrypt(HMAC_SECRET)
    assert Vault("a" * 48).decrypt(sealed) == HMAC_SECRET
    try:
        Vault("b" * 48).decrypt(sealed)
    except Exception as error:  # SecretUnreadable, naming the likely cause
        assert "EXITPLANE_SECRET_KEY" in str(error)
    else:
        raise AssertionError("another key decrypted the secret")


def test_the_migration_encrypts_existing_rows_and_delivery_still_signs(db_url, outbox):
    downgrade(db_url, "0005")
    engine = make_engine(db_url)
    receiver = Receiver().start()
    try:
        with engine.begin() as connection:
            connection.execute(text(
                "INSERT INTO alert_hooks (name, kind, url, secret, routing_key, min_severity, "
                "enabled, created_by, created_at) VALUES ('old', 'webhook', :url, :secret, "
                "NULL, 'info', true, 'test', CURRENT_TIMESTAMP)"),
                {"url": receiver.url + "/old-hook", "secret": HMAC_SECRET})
            # What schema 0005's deliveries logged: the receiver's answer, the network error's text.
            for code, error in ((500, "HTTP 500: FATAL: password authentication failed"),
                                (None, "ConnectError: [Errno 111] Connection refused")):
                connection.execute(text(
                    "INSERT INTO alert_deliveries (hook_id, event, attempt, ok, status_code, "
                    "error, duration_ms, created_at) SELECT id, 'test', 1, false, :code, "
                    ":error, 1.0, CURRENT_TIMESTAMP FROM alert_hooks"),
                    {"code": code, "error": error})
        upgrade(db_url)
        with engine.connect() as connection:
            assert sorted(connection.execute(text(
                "SELECT error FROM alert_deliveries")).scalars()) == ["HTTP 500", hooks.NO_ANSWER]
        [(url, secret, routing_key)] = _stored(engine)
        assert url.startswith(ENCRYPTED_PREFIX) and secret.startswith(ENCRYPTED_PREFIX)
        assert HMAC_SECRET not in secret and "old-hook" not in url and routing_key is None
        sealed = vault(Settings())  # the test session's EXITPLANE_SECRET_KEY
        assert sealed.decrypt(secret) == HMAC_SECRET
        assert sealed.decrypt(url) == receiver.url + "/old-hook"

        with Session(engine) as session:
            deployment = make_deployment(session)
            alert, _ = service.fire(session=session, deployment=deployment, condition=Condition(
                kind="quality_regression", severity="critical", summary="disagreement up"))
            [hook] = hook_service.list_hooks(session=session)
            delivery = delivery_service.deliver(session=session, alert_id=alert.id, hook_id=hook.id,
                                                event="firing", base_url="http://exitplane.test")
            assert delivery.ok, delivery.error
            session.commit()
        [request] = receiver.requests
        assert request.path == "/old-hook"
        timestamp = request.headers["X-Exitplane-Timestamp"]
        expected = hmac.new(HMAC_SECRET.encode(), timestamp.encode() + b"." + request.body,
                            hashlib.sha256).hexdigest()
        assert request.headers["X-Exitplane-Signature"] == f"sha256={expected}"
        assert hooks.verify_signature(secret=HMAC_SECRET, timestamp=timestamp,
                                      body=request.body,
                                      signature=request.headers["X-Exitplane-Signature"])

        downgrade(db_url, "0005")  # and back: schema 0005's code can read its rows again
        [(url, secret, _)] = _stored(engine)
        assert (url, secret) == (receiver.url + "/old-hook", HMAC_SECRET)
    finally:
        upgrade(db_url)  # the session's PostgreSQL database is shared by the next tests
        receiver.stop()
        engine.dispose()
