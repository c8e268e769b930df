"""Fill one key of a Kubernetes Secret with a token that a command mints, once.

    python runtime-token-secret.py --secret NAME --key KEY -- COMMAND... --out FILE

Run in the bootstrap Job's pod (the controlplane image's Python; standard library only). It reads
the Secret through the Kubernetes API with the pod's projected service-account token. When the key
already holds a value it keeps it and exits 0: a re-run never rotates the token (remove the key to
have the next run mint a new one). Otherwise it runs COMMAND (`exitplane bootstrap token ... --out
FILE`), reads FILE and patches the key in, guarded by the Secret's resourceVersion, so two runs at
once cannot both write. FILE is removed once the Secret holds it; a retry of a failed patch reuses
it (`--if-missing`) instead of minting another token. Any failure ends with one line on stderr and
exit status 1.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

ACCOUNT = "/var/run/secrets/kubernetes.io/serviceaccount"
TIMEOUT = 30


class Failure(Exception):
    """A reason to stop, said in one line."""


class Cluster:
    """The Kubernetes API as this pod's service account sees it."""

    def __init__(self, account: Path) -> None:
        host = os.environ.get("KUBERNETES_SERVICE_HOST")
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise Failure("KUBERNETES_SERVICE_HOST is not set: run this in a pod")
        try:
            self.token = (account / "token").read_text().strip()
            self.namespace = (account / "namespace").read_text().strip()
            self.context = ssl.create_default_context(cafile=str(account / "ca.crt"))
        except (OSError, ssl.SSLError) as error:
            raise Failure(f"no service-account credentials in {account}: {error}") from None
        self.base = f"https://[{host}]:{port}" if ":" in host else f"https://{host}:{port}"

    def secret_url(self, name: str) -> str:
        return f"{self.base}/api/v1/namespaces/{self.namespace}/secrets/{name}"

    def call(self, method: str, url: str, body: dict | None = None) -> dict:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(url, data=data, method=method, headers={
            "Authorization": f"Bearer {self.token}", "Accept": "application/json",
            **({"Content-Type": "application/merge-patch+json"} if data else {})})
        try:
            with urllib.request.urlopen(request, timeout=TIMEOUT, context=self.context) as answer:
                return json.load(answer)
        except urllib.error.HTTPError as error:
            raise Failure(f"{method} {url}: HTTP {error.code} {_reason(error)}") from None
        except (urllib.error.URLError, OSError) as error:
            raise Failure(f"{method} {url}: {getattr(error, 'reason', error)}") from None


def _reason(error: urllib.error.HTTPError) -> str:
    """The API server's message for a refused request (a Status object), else its reason."""
    try:
        return json.loads(error.read())["message"]
    except (ValueError, KeyError, TypeError, OSError):
        return str(error.reason)


def _out_file(command: list[str]) -> Path:
    if "--out" not in command or command.index("--out") + 1 >= len(command):
        raise Failure("the command must write the token to a file: give it --out FILE")
    return Path(command[command.index("--out") + 1])


def fill(cluster: Cluster, secret: str, key: str, command: list[str]) -> str:
    """Make `key` of `secret` hold a token; what was done, in one line."""
    out = _out_file(command)
    url = cluster.secret_url(secret)
    current = cluster.call("GET", url)
    if (current.get("data") or {}).get(key):
        out.unlink(missing_ok=True)
        return (f"Secret {secret} already holds {key!r}: kept (remove the key to have the next "
                f"run mint a new token)")
    minted = subprocess.run(command, stdin=subprocess.DEVNULL, check=False)
    if minted.returncode != 0:
        raise Failure(f"{command[0]} exited with {minted.returncode}; the Secret is unchanged")
    try:
        token = out.read_text().strip()
    except OSError as error:
        raise Failure(f"cannot read the token file {out}: {error.strerror or error}") from None
    if not token:
        raise Failure(f"the token file {out} is empty")
    cluster.call("PATCH", url, {
        "metadata": {"resourceVersion": current["metadata"]["resourceVersion"]},
        "data": {key: base64.b64encode(token.encode()).decode()}})
    out.unlink(missing_ok=True)
    return f"Secret {secret} now holds {key!r}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--secret", required=True, help="the Secret's name (in the pod's "
                        "namespace); it must exist")
    parser.add_argument("--key", required=True, help="the key that holds the token")
    parser.add_argument("--account", default=ACCOUNT, type=Path,
                        help=f"the service-account files: token, namespace, ca.crt "
                             f"(default: {ACCOUNT})")
    parser.add_argument("command", nargs=argparse.REMAINDER,
                        help="after --: the command that mints the token into --out FILE")
    args = parser.parse_args(argv)
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command that mints the token after --")
    try:
        print(fill(Cluster(args.account), args.secret, args.key, command), file=sys.stderr)
    except Failure as failure:
        print(f"runtime-token-secret: {failure}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
