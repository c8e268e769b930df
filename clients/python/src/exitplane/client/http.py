"""How every request of the client reaches the control plane: one place builds the httpx
clients of the threshold pull (pulls, long-polls, heartbeats), the telemetry shipper and the
leave message, from the same options.

- `verify`: True (httpx's default trust: certifi's CAs, or `SSL_CERT_FILE` /
  `SSL_CERT_DIR`), False (no verification: tests only), the path of a CA bundle file or
  directory, or an `ssl.SSLContext` of the caller's.
- `cert`: a client certificate for mutual TLS, as one PEM file holding certificate and key,
  or a `(certificate, key)` pair of paths.
- `proxy`: the proxy URL every request goes through (without it, httpx honours
  `HTTPS_PROXY` / `HTTP_PROXY` / `NO_PROXY`).
- `headers`: extra headers on every request; the runtime token's `Authorization` is the
  client's own and cannot be set here, and a `User-Agent` given here goes before the client's.
- `transport`: an httpx transport (tests, a custom network stack); it replaces httpx's own,
  so TLS and the proxy are then the transport's to configure. The parts share it and never
  close it: its owner does, after `close()`.

Every request says `User-Agent: exitplane-client/<version> (python <x.y>)`.
"""

from __future__ import annotations

import os
import ssl
import sys
from collections.abc import Mapping
from importlib import metadata
from typing import Any

import httpx

Verify = bool | str | os.PathLike | ssl.SSLContext
Cert = str | os.PathLike | tuple[str | os.PathLike, str | os.PathLike]

HTTP_OPTIONS = ("verify", "cert", "proxy", "headers", "transport")


def client_version() -> str:
    """The exitplane-client distribution's version ("unknown" when run from a source tree
    that is not installed)."""
    try:
        return metadata.version("exitplane-client")
    except metadata.PackageNotFoundError:
        return "unknown"


USER_AGENT = (f"exitplane-client/{client_version()} "
              f"(python {sys.version_info.major}.{sys.version_info.minor})")


def http_options(*, verify: Verify = True, cert: Cert | None = None,
                 proxy: str | httpx.Proxy | None = None,
                 headers: Mapping[str, str] | None = None,
                 transport: httpx.BaseTransport | None = None) -> dict[str, Any]:
    """The options checked and resolved once (the CA bundle and client certificate loaded
    into an SSLContext): a dict to pass on as keywords to `http_client` or to the client's
    parts, which then share the one context."""
    if transport is not None and (proxy is not None or cert is not None or verify is not True):
        raise ValueError("transport replaces httpx's network stack, so verify, cert and proxy "
                         "would not reach it: configure TLS and the proxy on the transport, "
                         "or leave transport out")
    return {"verify": _tls(verify, cert), "cert": None, "proxy": proxy,
            "headers": _extra_headers(headers), "transport": transport}


def http_client(*, base_url: str, token: str | None, timeout: float | httpx.Timeout,
                **options: Any) -> httpx.Client:
    """An httpx client on `base_url` with the runtime token, the User-Agent and `options`
    (the keywords of `http_options`)."""
    unknown = sorted(set(options) - set(HTTP_OPTIONS))
    if unknown:
        raise TypeError(f"unexpected keyword arguments {', '.join(unknown)}; the HTTP options "
                        f"are {', '.join(HTTP_OPTIONS)}")
    resolved = http_options(**options)
    if resolved["transport"] is not None:
        resolved["transport"] = _Borrowed(resolved["transport"])
    headers = resolved.pop("headers")
    theirs = headers.pop("user-agent", None)
    headers["user-agent"] = f"{theirs} {USER_AGENT}" if theirs else USER_AGENT
    headers["authorization"] = f"Bearer {token}"
    return httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, headers=headers,
                        **{key: value for key, value in resolved.items() if value is not None})


class _Borrowed(httpx.BaseTransport):
    """The caller's transport, shared by the client's parts: closing one part's client leaves
    it open for the others (its owner closes it)."""

    def __init__(self, transport: httpx.BaseTransport) -> None:
        self.transport = transport

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        return self.transport.handle_request(request)

    def close(self) -> None:
        pass


def _extra_headers(headers: Mapping[str, str] | None) -> dict[str, str]:
    """The extra headers, names in lower case; Authorization refused."""
    extra = httpx.Headers(headers or {})
    if "authorization" in extra:
        raise ValueError("headers cannot set Authorization: it carries the runtime token "
                         "(give token or token_file instead)")
    return dict(extra.items())


def _tls(verify: Verify, cert: Cert | None) -> bool | ssl.SSLContext:
    """`verify` and `cert` as httpx takes them: True or False as they are without a client
    certificate, otherwise an SSLContext with the CA bundle and the certificate loaded."""
    if isinstance(verify, ssl.SSLContext):
        if cert is not None:
            raise ValueError("with an SSLContext as verify, load the client certificate into "
                             "it (context.load_cert_chain(certificate, key)) instead of cert")
        return verify
    if isinstance(verify, bool):
        if cert is None:
            return verify
        context = httpx.create_ssl_context(verify=verify)
    else:
        context = _ca_context(os.fspath(verify))
    if cert is None:
        return context
    certificate, key = (cert, None) if isinstance(cert, (str, os.PathLike)) else cert
    try:
        context.load_cert_chain(os.fspath(certificate), None if key is None else os.fspath(key))
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the client certificate {os.fspath(certificate)!r}"
                         + ("" if key is None else f" with key {os.fspath(key)!r}")
                         + f": {exc}; give a PEM certificate and its unencrypted key") from exc
    return context


def _ca_context(path: str) -> ssl.SSLContext:
    try:
        if os.path.isdir(path):
            return ssl.create_default_context(capath=path)
        return ssl.create_default_context(cafile=path)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"cannot load the CA bundle {path!r} given as verify: {exc}; give "
                         "a PEM file (or directory) of the CA certificates that sign the "
                         "control plane's certificate") from exc
