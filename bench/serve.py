"""Serving benchmark: N concurrent streaming clients on loopback against `exitplane runtime
serve` on the default model, with early exit on (thresholds calibrated for <= 1% per-token
disagreement on shadow tokens of calibration prompts) and off (never exit), in the same run.

    .venv/bin/python bench/serve.py --clients 4 --max-tokens 48
    .venv/bin/python bench/serve.py --model tiny --clients 8     # seconds, for a smoke run

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def calibrated_thresholds(args, workdir: Path) -> tuple[Path, Path, dict]:
    """(early-exit file, never-exit file, info) from a shadow run on calibration prompts."""
    import torch

    from exitplane.wire import Signal, ThresholdSetWire
    from runtime import corpus
    from runtime.benchmark import calibrate
    from runtime.engine import Engine, EngineConfig
    from runtime.model import load_served, tiny_llama
    from runtime.testing import ascii_tokenizer

    torch.set_num_threads(2)
    if args.model == "tiny":
        model, tokenizer, heads = tiny_llama(), ascii_tokenizer(), None
    else:
        model, tokenizer, heads = load_served(args.model, heads_path=args.heads)
    signal = Signal.learned if heads is not None else Signal.maxprob
    engine = Engine(model, heads=heads, config=EngineConfig(max_batch=4, shadow_rate=1.0))
    prompts = corpus.HELD_OUT_PROMPTS[-args.calibration_prompts:]
    ids = [corpus.chat_prompt_ids(tokenizer, p) for p in prompts]
    engine.generate(ids, max_new_tokens=args.max_tokens)
    policy, info = calibrate(engine.drain_records(), engine.exit_layers, 0.01, signal,
                             engine.parts.num_layers)
    files = []
    for name, thresholds in (("ee", policy.thresholds),
                             ("full", dict.fromkeys(engine.exit_layers, 1.0))):
        wire = ThresholdSetWire.build(deployment="bench", version=1 if name == "ee" else 0,
                                      signal=signal, thresholds=thresholds)
        path = workdir / f"{name}.json"
        path.write_text(wire.model_dump_json())
        files.append(path)
    return files[0], files[1], {**info, "signal": str(signal),
                                "thresholds": {str(k): round(float(v), 4)
                                               for k, v in policy.thresholds.items()}}


async def one_client(http: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    started = time.perf_counter()
    stamps: list[float] = []
    body = {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "stream": True, "ignore_eos": True}
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            delta = chunk["choices"][0]["delta"]
            # The first chunk only announces the role; tokens are the chunks after it.
            if "role" not in delta and chunk["choices"][0]["finish_reason"] is None:
                stamps.append(time.perf_counter())
            if chunk["choices"][0]["finish_reason"] is not None:
                tokens = chunk["usage"]["completion_tokens"]
    gaps = [b - a for a, b in itertools.pairwise(stamps)]
    return {"ttft": (stamps[0] if stamps else time.perf_counter()) - started, "gaps": gaps,
            "tokens": tokens}


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] * 1000 if values else float("nan")


def run_load(args, thresholds: Path, label: str) -> dict:
    from runtime import corpus

    port = free_port()
    command = [str(Path(sys.executable).parent / "exitplane"), "runtime", "serve",
               "--thresholds", str(thresholds), "--port", str(port),
               "--max-batch", str(args.clients), "--shadow-rate", "0"]
    if args.model:
        command += ["--model", args.model]
    if args.heads and args.model != "tiny":
        command += ["--heads", args.heads]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"server did not start: {server.stderr.read().decode()[-2000:]}")
            time.sleep(0.5)
        prompts = corpus.HELD_OUT_PROMPTS[: args.clients]

        async def main() -> tuple[list[dict], float]:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}",
                                         timeout=600) as http:
                await one_client(http, prompts[0], 4)  # warm-up
                started = time.perf_counter()
                results = await asyncio.gather(*(one_client(http, p, args.max_tokens)
                                                 for p in prompts))
                return results, time.perf_counter() - started

        results, wall = asyncio.run(main())
    finally:
        server.terminate()
        server.wait(timeout=60)
    gaps = [g for r in results for g in r["gaps"]]
    tokens = sum(r["tokens"] for r in results)
    return {"label": label, "tok_s": tokens / wall, "tokens": tokens,
            "ttft_p50_ms": percentile([r["ttft"] for r in results], 0.5),
            "ttft_p99_ms": percentile([r["ttft"] for r in results], 0.99),
            "itl_p50_ms": percentile(gaps, 0.5), "itl_p99_ms": percentile(gaps, 0.99),
            "itl_mean_ms": statistics.fmean(gaps) * 1000 if gaps else float("nan")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--calibration-prompts", type=int, default=6)
    parser.add_argument("--model", default=None, help="default SmolLM2; 'tiny' for a smoke run")
    parser.add_argument("--heads", default=None,
                        help="exit heads (default: var/runtime/heads-post-hoc.safetensors "
                             "when it exists; else the maxprob signal)")
    args = parser.parse_args()
    if args.heads is None and args.model != "tiny":
        from runtime.cli import default_heads_path

        found = [default_heads_path(m) for m in ("joint", "post-hoc")]
        args.heads = next((str(p) for p in found if p.exists()), None)
    workdir = Path(tempfile.mkdtemp(prefix="exitplane-serve-"))
    ee_file, full_file, info = calibrated_thresholds(args, workdir)
    os.environ.setdefault("OMP_NUM_THREADS", "2")
    ee = run_load(args, ee_file, "early exit")
    full = run_load(args, full_file, "full depth")
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    print(f"calibration: {info}")
    print(f"{'run':<12}{'tok/s':>8}{'TTFT p50':>10}{'TTFT p99':>10}{'ITL p50':>9}{'ITL p99':>9}")
    for run in (ee, full):
        print(f"{run['label']:<12}{run['tok_s']:>8.1f}{run['ttft_p50_ms']:>10.1f}"
              f"{run['ttft_p99_ms']:>10.1f}{run['itl_p50_ms']:>9.1f}{run['itl_p99_ms']:>9.1f}")
    print(json.dumps({
        "clients": args.clients, "max_tokens": args.max_tokens,
        "model": args.model or "SmolLM2-135M-Instruct", "heads": args.heads,
        "signal": info["signal"], "thresholds": info["thresholds"],
        "tok_s_ee": round(ee["tok_s"], 2), "tok_s_full": round(full["tok_s"], 2),
        "speedup": round(ee["tok_s"] / full["tok_s"], 3),
        "ttft_p99_ms_ee": round(ee["ttft_p99_ms"], 1),
        "ttft_p99_ms_full": round(full["ttft_p99_ms"], 1),
        "itl_p99_ms_ee": round(ee["itl_p99_ms"], 1),
        "itl_p99_ms_full": round(full["itl_p99_ms"], 1),
        "itl_p50_ms_ee": round(ee["itl_p50_ms"], 1),
        "itl_p50_ms_full": round(full["itl_p50_ms"], 1)}))


if __name__ == "__main__":
    main()
