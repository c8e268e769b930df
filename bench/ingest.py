"""Ingestion benchmark: end-to-end records/s (HTTP + validation + store + rollups) against the
raw bulk-write ceiling of the same rows, same run: the store's own bulk writer (one binary COPY
on PostgreSQL, executemany on SQLite) with no HTTP, no validation and no rollups.

Starts `exitplane up` on a fresh database per backend, sends pre-encoded msgpack batches from
a few concurrent senders, then writes the same rows straight into a fresh copy of the schema.

    .venv/bin/python bench/ingest.py --records 200000 --postgres-url postgresql+psycopg://...
    (make services writes the bench URL to var/services/env as EXITPLANE_BENCH_POSTGRES_URL)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgpack
from sqlalchemy import text

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from controlplane.db import make_engine
from controlplane.migrate import upgrade
from controlplane.telemetry.bulk import write_rows
from controlplane.telemetry.columns import parse_batch
from controlplane.telemetry.tables import tables_of

NUM_LAYERS = 30
EXIT_LAYERS = list(range(6, 30, 3))


def synthetic_batches(records: int, batch_size: int, shadow_rate: float) -> list[dict]:
    """Batches shaped like a SmolLM2 runtime's: 8 exit layers, ~shadow_rate shadow tokens."""
    rng = random.Random(0)
    now = time.time()
    batches = []
    for seq in range(records // batch_size):
        rows = []
        for i in range(batch_size):
            shadow = rng.random() < shadow_rate
            exit_layer = NUM_LAYERS if shadow else rng.choice([*EXIT_LAYERS, NUM_LAYERS])
            row = {"threshold_version": 2, "request_id": f"req-{seq}-{i // 64}",
                   "position": i % 64, "exit_layer": exit_layer,
                   "signal_value": round(rng.random(), 4), "latency_us": rng.randint(800, 40000),
                   "ts": now + (seq * batch_size + i) * 0.001}
            if shadow:
                row["shadow"] = [{"layer": k, "signal": round(rng.random(), 4),
                                  "matched": rng.random() < 0.7} for k in EXIT_LAYERS]
            rows.append(row)
        batches.append({"batch_id": uuid.uuid4().hex, "deployment": "bench",
                        "runtime_id": f"rt-{seq % 8}", "seq": seq, "num_layers": NUM_LAYERS,
                        "records": rows})
    return batches


def fresh_database(url: str, workdir: Path, label: str) -> str:
    if url.startswith("sqlite"):
        url = f"sqlite:///{workdir / f'{label}.db'}"
    else:
        engine = make_engine(url)
        with engine.begin() as connection:
            connection.execute(text("DROP SCHEMA public CASCADE; CREATE SCHEMA public"))
        engine.dispose()
    upgrade(url)
    return url


def end_to_end(url: str, batches: list[dict], senders: int, workdir: Path) -> float:
    env = {**os.environ, "EXITPLANE_DATABASE_URL": url, "EXITPLANE_VAR_DIR": str(workdir),
           "EXITPLANE_LOG_LEVEL": "warning", "EXITPLANE_MAX_BODY_BYTES": str(64 << 20)}
    exe = str(Path(sys.executable).parent / "exitplane")
    admin = subprocess.run([exe, "bootstrap", "token", "--name", "bench", "--scope", "admin"],
                           env=env, check=True, capture_output=True, text=True).stdout.strip()
    port = 18000 + random.Random().randint(0, 999)
    # No Celery worker and beat: they take no part in ingestion, and `up` would start them
    # next to the API, importing their stack (seconds of CPU) while the senders are timed.
    server = subprocess.Popen([exe, "up", "--port", str(port), "--no-migrate", "--no-workers"],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(300):
            try:
                if httpx.get(f"{base}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        auth = {"Authorization": f"Bearer {admin}"}
        httpx.post(f"{base}/v1/deployments", headers=auth, json={
            "name": "bench", "model_ref": "smollm2-135m", "num_layers": NUM_LAYERS}
        ).raise_for_status()
        httpx.post(f"{base}/v1/deployments/bench/threshold-sets", headers=auth, json={
            "thresholds": {str(k): 0.9 for k in EXIT_LAYERS}, "reason": "bench",
            "activate": True}).raise_for_status()
        runtime = httpx.post(f"{base}/v1/tokens", headers=auth, json={
            "name": "rt", "scope": "runtime", "deployment": "bench"}).json()["token"]
        bodies = [msgpack.packb(b) for b in batches]
        headers = {"Authorization": f"Bearer {runtime}", "Content-Type": "application/msgpack"}

        def send(http: httpx.Client, chunk: list[bytes]) -> None:
            for body in chunk:
                http.post("/v1/telemetry", content=body, headers=headers).raise_for_status()

        # Clients are built, connected and the server warmed up (compiled statements, first
        # partition, caches: the first batch takes twice as long) before the clock starts.
        clients = [httpx.Client(base_url=base, timeout=120) for _ in range(senders)]
        warmup = [{**batch, "batch_id": uuid.uuid4().hex} for batch in batches[:senders]]
        for http, batch in zip(clients, warmup, strict=False):  # fewer batches than senders
            send(http, [msgpack.packb(batch)])
        chunks = [bodies[i::senders] for i in range(senders)]
        started = time.perf_counter()
        with ThreadPoolExecutor(senders) as pool:
            list(pool.map(send, clients, chunks))
        elapsed = time.perf_counter() - started
        for http in clients:
            http.close()
        stored = httpx.get(f"{base}/v1/deployments/bench/telemetry/count",
                           headers=headers).json()["records"]
        timed = sum(len(b["records"]) for b in batches)
        expected = timed + sum(len(b["records"]) for b in warmup)
        if stored != expected:
            raise RuntimeError(f"stored {stored} records, sent {expected}")
        return timed / elapsed
    finally:
        server.terminate()
        server.wait(timeout=30)


def raw_ceiling(url: str, batches: list[dict]) -> float:
    """The same token and shadow rows written with the bare bulk path, no HTTP, no checks."""
    import numpy as np
    from sqlalchemy.orm import Session

    from controlplane.telemetry.models import ShadowSampleRow, TokenRecordRow

    engine = make_engine(url)
    tables = tables_of(deployment_id=1, exit_layers=EXIT_LAYERS, num_layers=NUM_LAYERS,
                       batches=[parse_batch(b) for b in batches],
                       thresholds={2: np.full(len(EXIT_LAYERS), 0.9)})
    started = time.perf_counter()
    with Session(engine) as session:
        write_rows(session, TokenRecordRow, tables.tokens)
        write_rows(session, ShadowSampleRow, tables.shadows)
        session.commit()
    elapsed = time.perf_counter() - started
    engine.dispose()
    return len(tables.tokens["idx"]) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--records", type=int, default=200_000)
    parser.add_argument("--batch-size", type=int, default=2_000)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--shadow-rate", type=float, default=0.05)
    parser.add_argument("--postgres-url", default=os.environ.get("EXITPLANE_BENCH_POSTGRES_URL",
                                                                 ""))
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-ingest-"))
    batches = synthetic_batches(args.records, args.batch_size, args.shadow_rate)
    records = sum(len(b["records"]) for b in batches)
    results: dict[str, float | int | str] = {"records": records, "batch_size": args.batch_size,
                                             "senders": args.senders,
                                             "shadow_rate": args.shadow_rate}
    backends = [("sqlite", "sqlite://")] + ([("pg", args.postgres_url)] if args.postgres_url
                                            else [])
    for label, url in backends:
        results[f"{label}_e2e_rps"] = round(end_to_end(fresh_database(url, workdir, label + "_e2e"),
                                                       batches, args.senders, workdir))
        results[f"{label}_raw_rps"] = round(raw_ceiling(fresh_database(url, workdir,
                                                                       label + "_raw"), batches))
        results[f"{label}_ratio"] = round(results[f"{label}_e2e_rps"]
                                          / results[f"{label}_raw_rps"], 3)
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    print(f"{'backend':<10}{'e2e rec/s':>12}{'raw rec/s':>12}{'ratio':>8}")
    for label, _ in backends:
        print(f"{label:<10}{results[f'{label}_e2e_rps']:>12,}{results[f'{label}_raw_rps']:>12,}"
              f"{results[f'{label}_ratio']:>8.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
