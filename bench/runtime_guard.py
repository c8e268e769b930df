"""Runtime server hardening, measured on the tiny model: how long a huge
prompt stalls the server's event loop, and what a long stop string costs per token.

    .venv/bin/python bench/runtime_guard.py                                  # this checkout
    /work/main/.venv/bin/python bench/runtime_guard.py --code-root /work/main  # before

1. Event-loop stall: `exitplane runtime serve --model tiny` runs as a process; while one
   client posts a 2 MB prompt, another polls /healthz back to back; the slowest poll during
   the big request is the stall every other stream saw. Run with the default limits and, where
   the server has them, with limits raised so that the prompt is read and tokenized (in the
   prompt pool, off the event loop) before its 422.
2. Per-token cost of the detokenizer (text delta + stop check) with a 100,000-character stop
   string and with a 256-character one, over 400 generated tokens.

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def serve(code_root: Path, workdir: Path, extra: list[str]) -> tuple[subprocess.Popen, str]:
    thresholds = workdir / "never.json"
    thresholds.write_text(json.dumps({"signal": "maxprob", "thresholds": {"2": 1.0, "4": 1.0}}))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(code_root)}
    process = subprocess.Popen(
        [sys.executable, "-m", "exitplane.cli", "runtime", "serve", "--model", "tiny",
         "--thresholds", str(thresholds), "--port", str(port), "--state-dir",
         str(workdir / "state"), *extra], cwd=code_root, env=env,
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/healthz").status_code == 200:
                return process, url
        except httpx.TransportError:
            time.sleep(0.2)
    process.kill()
    raise RuntimeError("the runtime server did not start")


def stall(url: str, prompt_bytes: int) -> dict:
    """Post a prompt of prompt_bytes characters; the slowest /healthz poll meanwhile."""
    polls: list[tuple[float, float]] = []
    stop = threading.Event()

    def poll() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            while not stop.is_set():
                started = time.perf_counter()
                client.get("/healthz")
                polls.append((started, time.perf_counter()))
                time.sleep(0.002)

    prober = threading.Thread(target=poll, daemon=True)
    prober.start()
    time.sleep(0.3)
    started = time.perf_counter()
    response = httpx.post(f"{url}/v1/completions", timeout=120,
                          json={"prompt": "z" * prompt_bytes, "max_tokens": 2})
    ended = time.perf_counter()
    time.sleep(0.1)
    stop.set()
    prober.join(60)
    overlapping = [end - begin for begin, end in polls if end >= started and begin <= ended]
    return {"status": response.status_code, "answer_s": round(ended - started, 3),
            "max_healthz_s": round(max(overlapping, default=0.0), 3),
            "message": response.json().get("error", {}).get("message", "")[:90]}


def detok_cost(stop_chars: int, tokens: int = 400) -> float:
    """Seconds per token of Detokenizer.push with one stop string of stop_chars characters."""
    try:
        from runtime.serving.detokenize import Detokenizer
    except ImportError:  # a --code-root from before the server was split
        from runtime.server import _Detokenizer as Detokenizer
    from runtime.testing import ascii_tokenizer

    detok = Detokenizer(ascii_tokenizer(), ["q" * (stop_chars - 1) + "!"])
    ids = [ord("a") + i % 26 for i in range(tokens)]
    started = time.perf_counter()
    for token in ids:
        detok.push(token)
    return (time.perf_counter() - started) / tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--code-root", type=Path, default=Path(__file__).resolve().parent.parent,
                        help="checkout whose runtime/ to measure (e.g. /work/main for before)")
    parser.add_argument("--prompt-bytes", type=int, default=2_000_000)
    args = parser.parse_args()
    sys.path.insert(0, str(args.code_root))
    print(f"command: {Path(sys.executable).name} {' '.join(sys.argv)}")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(tmp)
        help_text = subprocess.run(
            [sys.executable, "-m", "exitplane.cli", "runtime", "serve", "--help"],
            cwd=args.code_root, env={**os.environ, "PYTHONPATH": str(args.code_root)},
            capture_output=True, text=True).stdout
        configs = {"default limits": []}
        if "--max-body-bytes" in help_text:
            configs["limits raised"] = ["--max-body-bytes", str(4 * args.prompt_bytes),
                                        "--max-prompt-chars", str(4 * args.prompt_bytes)]
        for label, extra in configs.items():
            process, url = serve(args.code_root, workdir, extra)
            try:
                stall(url, 1000)  # warm up
                runs[label] = stall(url, args.prompt_bytes)
            finally:
                process.terminate()
                process.wait(30)
    detok = {f"stop_{n}_chars_ms_per_token": round(detok_cost(n) * 1000, 4)
             for n in (100_000, 256)}
    print(f"{'run':<16}{'status':>7}{'answer s':>10}{'max stall s':>13}  message")
    for label, run in runs.items():
        print(f"{label:<16}{run['status']:>7}{run['answer_s']:>10.3f}{run['max_healthz_s']:>13.3f}"
              f"  {run['message']}")
    for name, value in detok.items():
        print(f"detokenizer {name}: {value}")
    print(json.dumps({"bench": "runtime_guard", "code_root": str(args.code_root),
                      "prompt_bytes": args.prompt_bytes, "stall": runs, "detokenizer": detok}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
