"""Alert hook payloads, signing and the HTTP call: one builder per hook kind.

- webhook: our JSON document, signed: `X-Exitplane-Signature: sha256=<hex>` is
  HMAC-SHA256(secret, "<X-Exitplane-Timestamp>." + body); receivers recompute it and refuse
  stale timestamps (`verify_signature`).
- alertmanager: `POST <url>/api/v2/alerts` with one alert (labels, annotations, startsAt,
  endsAt, generatorURL); a resolve sends endsAt = the resolution time.
- pagerduty: Events API v2 (`trigger` / `acknowledge` / `resolve` on the alert's dedup key).
- slack: an incoming-webhook message (text plus blocks).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import secrets
import ssl
import time
from contextvars import ContextVar
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx

from controlplane.alerts.kinds import AlertKind

SIGNATURE_HEADER = "X-Exitplane-Signature"
TIMESTAMP_HEADER = "X-Exitplane-Timestamp"
EVENT_HEADER = "X-Exitplane-Event"
USER_AGENT = "exitplane-alerts/1"
PAGERDUTY_SEVERITY = {"critical": "critical", "warning": "warning", "info": "info"}
PAGERDUTY_ACTION = {"firing": "trigger", "test": "trigger", "acknowledged": "acknowledge",
                    "resolved": "resolve"}
EVENTS = ("firing", "acknowledged", "resolved", "refresh", "test")
# Alertmanager forgets an alert whose endsAt passed: firing alerts are held this long and
# refreshed by the drift check while the condition lasts.
ALERTMANAGER_HOLD = timedelta(hours=1)
SLACK_ICON = {"firing": ":rotating_light:", "test": ":test_tube:", "acknowledged": ":eyes:",
              "resolved": ":white_check_mark:"}


@dataclass(frozen=True)
class HookTarget:
    """A hook's kind and its credentials in the clear: built for one delivery, never stored."""

    kind: str
    url: str
    secret: str | None = None
    routing_key: str | None = None


@dataclass(frozen=True)
class HookRequest:
    url: str
    headers: dict[str, str]
    body: bytes


@dataclass(frozen=True)
class Outcome:
    ok: bool
    status_code: int | None
    error: str | None
    retryable: bool


def new_secret() -> str:
    return secrets.token_urlsafe(32)


def accepts(kind: str, event: str) -> bool:
    """Alertmanager has no acknowledgement; only Alertmanager needs a still-firing refresh."""
    if kind == "alertmanager":
        return event != "acknowledged"
    return event != "refresh"


def sign(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


def verify_signature(*, secret: str, timestamp: str, body: bytes, signature: str,
                     tolerance_s: float = 300.0, now: float | None = None) -> bool:
    """What a webhook receiver does: constant-time compare and a fresh timestamp."""
    if not timestamp.isdigit() or abs((now or time.time()) - int(timestamp)) > tolerance_s:
        return False
    return hmac.compare_digest(sign(secret, timestamp, body), signature)


def _iso(moment: datetime | None) -> str | None:
    return moment.astimezone(UTC).isoformat().replace("+00:00", "Z") if moment else None


def snapshot(*, alert, deployment: str, base_url: str) -> dict[str, Any]:
    """The alert as every payload sees it (JSON-ready)."""
    base = base_url.rstrip("/")
    # A segment's alert names it; a 'default' one has no segment field, like any alert of a
    # deployment without segments.
    segment = getattr(alert, "segment", None)
    named = {"segment": segment} if segment and segment != "default" else {}
    return named | {
        "id": alert.id, "deployment": deployment, "kind": alert.kind, "layer": alert.layer,
        "severity": alert.severity, "status": alert.status, "dedup_key": alert.dedup_key,
        "summary": alert.summary, "evidence": alert.evidence,
        "action_taken": alert.action_taken, "fired_at": _iso(alert.fired_at),
        "acknowledged_at": _iso(alert.acknowledged_at),
        "acknowledged_by": alert.acknowledged_by, "resolved_at": _iso(alert.resolved_at),
        "resolved_by": alert.resolved_by, "resolution": alert.resolution,
        "url": f"{base}/ui/alerts/{alert.id}",
        # The UI's route: people follow this link from a page, with a browser session.
        "report_url": f"{base}/ui/alerts/{alert.id}/report" if alert.has_report else None,
    }


def test_snapshot(*, hook_id: int, deployment: str, actor: str, base_url: str) -> dict[str, Any]:
    """A test alert that reads as one: kind "test", its own dedup key."""
    now = datetime.now(UTC)
    return {
        "id": None, "deployment": deployment, "kind": "test", "layer": None,
        "severity": "info", "status": "firing",
        "dedup_key": f"exitplane:test:hook-{hook_id}:{int(now.timestamp())}",
        "summary": f"exitplane test alert for hook {hook_id}, sent by {actor}",
        "evidence": {}, "action_taken": "none (test)", "fired_at": _iso(now),
        "acknowledged_at": None, "acknowledged_by": None, "resolved_at": None,
        "resolved_by": None, "resolution": "", "url": f"{base_url.rstrip('/')}/ui/alerts",
        "report_url": None,
    }


def build_request(*, hook, alert: dict[str, Any], event: str,
                  now: datetime | None = None) -> HookRequest:
    """The HTTP request that delivers `event` of `alert` to `hook`."""
    now = now or datetime.now(UTC)
    builder = {"webhook": _webhook, "alertmanager": _alertmanager, "pagerduty": _pagerduty,
               "slack": _slack}[hook.kind]
    return builder(hook, alert, event, now)


def _json(payload: Any) -> bytes:
    return json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()


def _headers(**extra: str) -> dict[str, str]:
    return {"Content-Type": "application/json", "User-Agent": USER_AGENT, **extra}


def _webhook(hook, alert: dict, event: str, now: datetime) -> HookRequest:
    body = _json({"version": "1", "event": event, "sent_at": _iso(now), "alert": alert})
    timestamp = str(int(now.timestamp()))
    headers = _headers(**{TIMESTAMP_HEADER: timestamp, EVENT_HEADER: event})
    if hook.secret:
        headers[SIGNATURE_HEADER] = sign(hook.secret, timestamp, body)
    return HookRequest(hook.url, headers, body)


def _alertmanager(hook, alert: dict, event: str, now: datetime) -> HookRequest:
    layer = "all" if alert["layer"] is None else str(alert["layer"])
    labels = {"alertname": alert["kind"], "deployment": alert["deployment"], "layer": layer,
              "severity": alert["severity"], "source": "exitplane"}
    if alert["kind"] == AlertKind.RUNTIME_STALE:
        labels["runtime"] = alert["dedup_key"].rsplit(":", 1)[-1]
    if alert.get("segment"):
        labels["segment"] = alert["segment"]
    annotations = {"summary": alert["summary"], "action_taken": alert["action_taken"] or "none",
                   "dedup_key": alert["dedup_key"]}
    if alert["report_url"]:
        annotations["report_url"] = alert["report_url"]
    ends = (datetime.fromisoformat(alert["resolved_at"]) if event == "resolved"
            and alert["resolved_at"] else now + ALERTMANAGER_HOLD)
    payload = [{"labels": labels, "annotations": annotations, "startsAt": alert["fired_at"],
                "endsAt": _iso(ends), "generatorURL": alert["url"]}]
    return HookRequest(hook.url.rstrip("/") + "/api/v2/alerts", _headers(), _json(payload))


def _pagerduty(hook, alert: dict, event: str, now: datetime) -> HookRequest:
    action = PAGERDUTY_ACTION[event]
    payload: dict[str, Any] = {"routing_key": hook.routing_key, "event_action": action,
                               "dedup_key": alert["dedup_key"]}
    if action == "trigger":
        layer = "all layers" if alert["layer"] is None else f"layer {alert['layer']}"
        payload |= {
            "payload": {
                "summary": alert["summary"][:1024],
                "source": f"exitplane/{alert['deployment']}",
                "severity": PAGERDUTY_SEVERITY[alert["severity"]],
                "timestamp": alert["fired_at"],
                "component": alert["deployment"], "group": layer, "class": alert["kind"],
                "custom_details": {"action_taken": alert["action_taken"],
                                   "evidence": alert["evidence"]},
            },
            "client": "exitplane", "client_url": alert["url"],
            "links": [{"href": alert["url"], "text": "alert in exitplane"}]
            + ([{"href": alert["report_url"], "text": "drift report"}]
               if alert["report_url"] else []),
        }
    return HookRequest(hook.url, _headers(), _json(payload))


def slack_escape(text: str) -> str:
    """Text as Slack shows it literally: `<...>` would otherwise be a link or a mention
    (`<!channel>` pages a whole channel) and `&` starts an entity."""
    return text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _slack(hook, alert: dict, event: str, now: datetime) -> HookRequest:
    # Names, summaries and resolutions come from users and runtimes: escaped, all of them.
    title = slack_escape(f"{SLACK_ICON[event]} [{event.upper()}] {alert['deployment']}: "
                         f"{alert['kind']}")
    if alert["layer"] is not None:
        title += f" at layer {alert['layer']}"
    summary = slack_escape(alert["summary"])
    lines = [f"*{title}*", summary, f"severity: *{slack_escape(alert['severity'])}*"]
    if alert["action_taken"]:
        lines.append(f"action taken: {slack_escape(alert['action_taken'])}")
    if event == "resolved" and alert["resolution"]:
        lines.append(slack_escape(f"resolved by {alert['resolved_by']}: "
                                  f"{alert['resolution']}"))
    links = f"<{_slack_link(alert['url'])}|open in exitplane>"
    if alert["report_url"]:
        links += f" · <{_slack_link(alert['report_url'])}|drift report>"
    payload = {"text": f"{title}: {summary}",
               "blocks": [{"type": "section", "text": {"type": "mrkdwn",
                                                       "text": "\n".join(lines)}},
                          {"type": "context", "elements": [{"type": "mrkdwn", "text": links}]}]}
    return HookRequest(hook.url, _headers(), _json(payload))


def _slack_link(url: str) -> str:
    # Inside <url|label> only these three are special; a URL never legitimately has them raw.
    return url.replace("&", "&amp;").replace("<", "%3C").replace(">", "%3E").replace("|", "%7C")


# What a failed delivery records: the status code and one of these fixed reasons, never the
# receiver's answer nor the network error's text (both would turn "send test" into a way to
# read internal services or scan ports).
NO_ANSWER = "no answer from the destination (connection failed or timed out)"
REFUSED = "destination refused"  # by controlplane.alerts.guard: not retried
UNRESOLVED = "destination unresolved"  # DNS had no answer: retried
UNREADABLE = "credentials unreadable"  # the secret key changed: not retried
REDIRECT_REFUSED = "redirect refused: hooks do not follow redirects"


def post(request: HookRequest, *, destination, timeout_s: float,
         verify: ssl.SSLContext | bool = True) -> Outcome:
    """Send the request to the vetted `destination` (a `guard.Destination`): the connection
    goes to its checked address while the Host header and TLS name stay the URL's host, so
    DNS is not asked again. 2xx is success, 429/5xx and network errors may be retried, and
    redirects are not followed.

    A hook's URL is a credential (Slack, Teams and many webhooks carry their key in the path
    or the query), so httpx's request log says no more of it than scheme, host and port."""
    url = httpx.URL(request.url)
    pinned = url.copy_with(host=destination.address)
    headers = {**request.headers, "Host": url.netloc.decode("ascii")}
    extensions = {"sni_hostname": url.host} if url.scheme == "https" else {}
    sending = _sending_to_hook.set(True)
    try:
        # An explicit transport: no proxy from the environment (it would connect on its own
        # terms); trust_env=False on the client: no ~/.netrc credentials sent to a hook. The
        # transport still honours SSL_CERT_FILE for a private CA.
        transport = httpx.HTTPTransport(verify=verify)
        with httpx.Client(transport=transport, trust_env=False, follow_redirects=False,
                          timeout=timeout_s) as client:
            response = client.post(pinned, content=request.body, headers=headers,
                                   extensions=extensions)
    except httpx.HTTPError:
        return Outcome(False, None, NO_ANSWER, True)
    finally:
        _sending_to_hook.reset(sending)
    code = response.status_code
    if 200 <= code < 300:
        return Outcome(True, code, None, False)
    if 300 <= code < 400:
        return Outcome(False, code, f"HTTP {code}: {REDIRECT_REFUSED}", False)
    return Outcome(False, code, f"HTTP {code}", code == 429 or code >= 500)


def redact_url(url: str | httpx.URL) -> str:
    """What may be said of a hook's URL: its scheme, host and port."""
    parsed = httpx.URL(str(url))
    host = f"[{parsed.host}]" if ":" in parsed.host else parsed.host
    port = f":{parsed.port}" if parsed.port else ""
    return f"{parsed.scheme}://{host}{port}/…"


_sending_to_hook: ContextVar[bool] = ContextVar("exitplane_sending_to_hook", default=False)


class _HookUrlFilter(logging.Filter):
    """httpx logs each request's full URL at INFO; while a hook is sent, only its origin."""

    def filter(self, record: logging.LogRecord) -> bool:
        if _sending_to_hook.get() and isinstance(record.args, tuple):
            record.args = tuple(redact_url(arg) if isinstance(arg, httpx.URL) else arg
                                for arg in record.args)
        return True


if not any(isinstance(f, _HookUrlFilter) for f in logging.getLogger("httpx").filters):
    logging.getLogger("httpx").addFilter(_HookUrlFilter())
