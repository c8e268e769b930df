"""`exitplane demo --story segments`: one deployment, two traffic segments.

The same control plane and in-process runtime as the default story (`exitplane.demo`); the
operator declares both segments first, and every request carries its segment
(`Engine.add_request(..., segment=)`), chat and code rows share batches and each row applies its
own segment's thresholds. The story:

1. chat traffic (questions in the chat template) and code traffic (a code assistant's
   requests, "Write a Python function `name(args)`: ...", answered in code by the model), all
   shadow; one whole-deployment calibration certifies a map per segment (`calibrate_segments`,
   ε split across the segments) and publishes one version;
2. the mix shifts from mostly chat to mostly code: each segment keeps its δ on its own, so
   nothing falls back and the active version stays;
3. code's traffic drifts (`DRIFTING`): a sync plugin starts sending the open file's manifest
   of block checksums for completion (`corpus.checksum_manifests`); the workers see it on code
   alone, publish a version where only code's map falls back while chat (`STEADY`) keeps
   exiting, and recalibrate code on code's shadow tokens only;
4. the report gives, per phase and segment, exit rate, disagreement and versions, and says
   "loop closed" with the default story's judgement (one-sided Clopper-Pearson lower bound).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import click

from exitplane.demo import PhaseStats, _wait, _wait_job, hold_ui

SEGMENTS = ("chat", "code")
# The segment whose traffic drifts (checksum manifests, which exit often and alike across
# requests), and the one that must not notice. Why this drift: docs/concepts/segments.md.
DRIFTING, STEADY = "code", "chat"
# The share of code in the mix from the shift on (phases 3-6).
MIX_AFTER_SHIFT = 0.8
# Tokens of a request's prompt: the manifests are cut to this many (a file's first blocks).
PAYLOAD_TOKENS = 96
# Seconds each mix phase serves at least (their tokens too): the drift starts 2.5 minutes or
# more after activation (why: `segments_story`).
BASELINE_S = 75.0


@dataclass
class SegmentPhase:
    """One phase of the story: its own stats per segment, the share of code in its mix."""

    name: str
    code_share: float
    by_segment: dict[str, PhaseStats] = field(default_factory=dict)
    seconds: float = 0.0

    def stats(self, segment: str) -> PhaseStats:
        return self.by_segment.setdefault(segment, PhaseStats(f"{self.name} [{segment}]"))

    @property
    def tokens(self) -> int:
        return sum(s.tokens for s in self.by_segment.values())


def mix(chat: list, code: list, code_share: float, cursor: int, size: int = 4) -> list:
    """`size` (prompt, segment) pairs with about `code_share` of code, round robin; a batch
    mixes both segments, so each row applies its own segment's map."""
    items = []
    for i in range(size):
        n = cursor + i
        is_code = int((n + 1) * code_share) > int(n * code_share)
        # Each source's own count so far, so that every prompt of it comes round (indexing by
        # n served only every other payload at a half-and-half mix).
        codes_before = int(n * code_share)
        if is_code:
            items.append((code[codes_before % len(code)], "code"))
        else:
            items.append((chat[(n - codes_before) % len(chat)], "chat"))
    return items


def run_mixed(runtime, phase: SegmentPhase, items: list, max_new_tokens: int,
              thresholds_of) -> None:
    """Generate (prompt, segment) pairs in one batch; each record counts for its segment, and
    a shadow token disagrees when its version's map for its segment would have exited where
    top-1 differed (as `Runtime.run` judges the default story)."""
    engine = runtime.engine
    num_layers = engine.parts.num_layers
    before = len(runtime.records)
    started = time.perf_counter()
    for prompt, segment in items:
        engine.add_request(prompt, max_new_tokens=max_new_tokens, segment=segment)
    while engine.has_work:
        engine.step()
    elapsed = time.perf_counter() - started
    phase.seconds += elapsed
    for record in runtime.records[before:]:
        phase.stats(record.segment).count(
            record, thresholds_of(record.threshold_version, record.segment), num_layers)
    for segment in {segment for _, segment in items}:
        phase.stats(segment).seconds += elapsed  # the batch both segments shared


def segments_story(*, cp, api, runtime, tokenizer, corpus, timeline, quick, delta, epsilon,
                   min_samples, serve) -> int:
    """The segments story (module docstring); 0 when the loop closed."""
    chat, code, payloads = prompt_sources(tokenizer, corpus)
    new_tokens = 48 if quick else 64
    phase_tokens = 300 if quick else 600
    # The mix phases are the drift detectors' baseline, by tokens and by time: ADWIN cuts a
    # change only after it saw the version's rollups (one per minute) before it
    # (docs/concepts/segments.md).
    baseline_tokens, baseline_s = 2 * phase_tokens, BASELINE_S
    phases: list[SegmentPhase] = []
    checks: dict[str, tuple[bool, str]] = {}
    sets: dict[int, dict] = {}

    def threshold_set(version: int) -> dict:
        if version not in sets:
            body = api.get(f"/v1/deployments/demo/threshold-sets/{version}").json()
            sets[version] = {
                "origin": body.get("origin"),
                "default": {int(k): float(v) for k, v in body["thresholds"].items()},
                "segments": {name: {int(k): float(v) for k, v in layers.items()}
                             for name, layers in (body.get("segments") or {}).items()}}
        return sets[version]

    def thresholds_of(version: int, segment: str) -> dict[int, float]:
        if version == 0:
            return {}
        found = threshold_set(version)
        return found["segments"].get(segment, found["default"])

    def active_version() -> int:
        return api.get("/v1/deployments/demo").json()["aliases"]["active"]

    def serve_until(phase: SegmentPhase, code_prompts, done, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        cursor = 0
        while time.monotonic() < deadline:
            run_mixed(runtime, phase, mix(chat, code_prompts, phase.code_share, cursor),
                      new_tokens, thresholds_of)
            cursor += 4
            if done():
                return True
        return False

    def finish(ok_so_far: bool) -> int:
        runtime.shipper.flush(30)
        ok = _report(timeline, phases, checks, delta, epsilon) and ok_so_far
        if serve:
            hold_ui(cp)
        return 0 if ok else 1

    # The operator declares the two segments: the control plane stores a segment's traffic
    # under its name only when it is declared (any other goes to `default`).
    for name in SEGMENTS:
        declared = api.put(f"/v1/deployments/demo/declared-segments/{name}",
                           json={"reason": "the demo's traffic segments"})
        declared.raise_for_status()
    timeline.mark(f"segments {', '.join(SEGMENTS)} declared")

    # 1. Chat and code, all shadow, until one calibration certifies a map per segment.
    warmup = SegmentPhase("1 chat+code: shadow samples (never exit)", code_share=0.5)
    phases.append(warmup)
    version_a = None
    for attempt in range(1, 5):
        # Each segment's LTT runs at its share of ε (Šidák, ~ε/k): on one min_samples' worth it
        # (real run: 384 tokens each, nothing; 672 each, both maps), so start at two.
        need = (attempt + 1) * min_samples + 40
        serve_until(warmup, code, lambda n=need: all(
            warmup.stats(s).shadow >= n for s in SEGMENTS), 900)
        runtime.shipper.flush(30)
        job = api.post("/v1/deployments/demo/calibrations", json={
            "reason": f"whole-deployment calibration, chat + code (attempt {attempt})"}
        ).json()["job"]
        timeline.mark(f"calibration job {job['id']} requested on "
                      f"{warmup.stats('chat').shadow} chat + {warmup.stats('code').shadow} "
                      "code shadow tokens")
        done = _wait_job(api, job["id"], timeout=300)
        per_segment = (done.get("summary") or {}).get("segments") or {}
        for name, what in sorted(per_segment.items()):
            timeline.mark(f"  segment {name}: {_describe(what)}")
        own = all((per_segment.get(s) or {}).get("source") == "segment" for s in SEGMENTS)
        if done.get("result_version") is not None and own:
            version_a = done["result_version"]
            break
        if done.get("result_version") is not None:
            # A segment that got the pooled or never-exit set has nothing to tell in this story
            # (its drift could not cost quality); calibrate again on more of its tokens.
            timeline.mark(f"v{done['result_version']} does not give every segment a map of its "
                          "own; collecting more shadow samples")
            continue
        timeline.mark(f"job {job['id']} published nothing ({done.get('status_reason')}); "
                      "collecting more shadow samples")
    if version_a is None:
        return finish(False)
    maps = threshold_set(version_a)["segments"]
    checks["calibration published a map per segment"] = (
        all(s in maps for s in SEGMENTS), f"v{version_a} maps: {sorted(maps)}")
    _wait(lambda: runtime.client.applied_version == version_a, 60, lambda: time.sleep(0.5))
    timeline.mark(f"version {version_a} active and applied by the runtime (maps for "
                  f"{', '.join(sorted(maps))})")

    # 2. Serving: mostly chat, then the mix shifts to mostly code; nothing may fall back.
    runtime.engine.config.shadow_rate = 0.25
    chat_heavy = SegmentPhase("2 mostly chat (20% code)", code_share=0.2)
    phases.append(chat_heavy)
    started = time.monotonic()
    serve_until(chat_heavy, code, lambda: chat_heavy.tokens >= baseline_tokens
                and time.monotonic() - started >= baseline_s, 600)
    timeline.mark("the mix shifts to mostly code (80%)")
    code_heavy = SegmentPhase("3 mostly code (80% code)", code_share=MIX_AFTER_SHIFT)
    phases.append(code_heavy)
    started = time.monotonic()
    serve_until(code_heavy, code, lambda: code_heavy.tokens >= baseline_tokens
                and time.monotonic() - started >= baseline_s, 600)
    runtime.shipper.flush(30)
    time.sleep(12)  # two drift checks (every 5 s) over the shifted mix
    still = active_version()
    alerts = api.get("/v1/alerts", params={"deployment": "demo"}).json()
    checks["mix shift: no fallback, no alert"] = (
        still == version_a and not alerts,
        f"active v{still} (calibrated v{version_a}), {len(alerts)} alert(s)")
    timeline.mark(f"after the mix shift: active v{still}, {len(alerts)} alert(s)")

    # 3. Code's traffic drifts to checksum manifests; the mix stays mostly code, so the drift has
    # the tokens to be seen (a real run at 50/50 with base64 alone: 4.6% disagreement, 22.6%
    # exits, nothing fired in 7 minutes) and chat, a fifth of the traffic, goes on being judged.
    timeline.mark(f"{DRIFTING} traffic drifts: a sync plugin sends the open files' block "
                  "checksum manifests")
    drift = SegmentPhase(f"4 {DRIFTING} drifts (80% code)", code_share=MIX_AFTER_SHIFT)
    phases.append(drift)
    if not serve_until(drift, payloads, lambda: active_version() != version_a, 600):
        timeline.mark("no drift reaction within the time limit")
        return finish(False)
    version_f = active_version()
    alerts = api.get("/v1/alerts", params={"deployment": "demo"}).json()
    named = sorted({(a["kind"], a["segment"]) for a in alerts})
    timeline.mark(f"drift detected ({', '.join(f'{k} on {s}' for k, s in named)}); "
                  f"v{version_f} active ({threshold_set(version_f)['origin']})")
    before, after = threshold_set(version_a), threshold_set(version_f)
    checks[f"alert names segment {DRIFTING} (and only {DRIFTING})"] = (
        bool(named) and {s for _, s in named} == {DRIFTING}, str(named))
    checks[f"fallback changes {DRIFTING}'s map only"] = (
        after["segments"].get(DRIFTING) != before["segments"].get(DRIFTING)
        and after["default"] == before["default"]
        and {k: v for k, v in after["segments"].items() if k != DRIFTING}
        == {k: v for k, v in before["segments"].items() if k != DRIFTING},
        f"v{version_a} -> v{version_f}: {DRIFTING} {_short(before['segments'].get(DRIFTING))}"
        f" -> {_short(after['segments'].get(DRIFTING))}")

    # 4. Fallback: code collects shadow samples for its recalibration, chat keeps exiting (a
    # quarter of its tokens are still served).
    runtime.engine.config.shadow_rate = 0.75
    fallback = SegmentPhase(f"5 {DRIFTING} fallback (collecting samples)",
                            code_share=MIX_AFTER_SHIFT)
    phases.append(fallback)
    noted: set[int] = set()

    def recalibrated() -> bool:
        version = active_version()
        if version not in (version_a, version_f) and (
                threshold_set(version)["origin"] == "calibration"):
            return True
        jobs = api.get("/v1/deployments/demo/calibrations").json()
        if jobs and jobs[0]["status"] == "waiting_for_data" and jobs[0]["id"] not in noted:
            noted.add(jobs[0]["id"])
            timeline.mark(f"calibration job {jobs[0]['id']} (segment {jobs[0].get('segment')}) "
                          f"waits for more samples ({jobs[0]['status_reason'][:70]}...)")
        return False

    if not serve_until(fallback, payloads, recalibrated, 900):
        timeline.mark("recalibration did not publish within the time limit")
        return finish(False)
    version_b = active_version()
    recal = threshold_set(version_b)
    checks[f"recalibration replaces {DRIFTING}'s map only"] = (
        recal["default"] == before["default"]
        and {k: v for k, v in recal["segments"].items() if k != DRIFTING}
        == {k: v for k, v in before["segments"].items() if k != DRIFTING},
        f"v{version_b}: {DRIFTING} {_short(recal['segments'].get(DRIFTING))}, "
        f"{STEADY} unchanged")
    _wait(lambda: runtime.client.applied_version == version_b, 60, lambda: time.sleep(0.5))
    timeline.mark(f"recalibrated version {version_b} active and applied by the runtime")

    runtime.engine.config.shadow_rate = 0.25
    recovered = SegmentPhase(f"6 {DRIFTING} recalibrated", code_share=MIX_AFTER_SHIFT)
    phases.append(recovered)
    serve_until(recovered, payloads, lambda: recovered.tokens >= phase_tokens, 600)
    return finish(True)


def prompt_sources(tokenizer, corpus) -> tuple[list, list, list]:
    """Token ids of the story's three prompt sources: chat questions and code requests (both in
    the chat template), and the checksum manifests code drifts to (raw, for completion)."""
    from exitplane.demo import CODE_FILES
    from exitplane.demo_speed import held_out_chat

    # Held-out prompts only: a calibration on prompts the heads were trained on promises chat
    # more exits than unseen chat traffic gives (real run: map certified at risk bound 4.5%,
    # 8.6% disagreement once held-out prompts were served).
    chat = [corpus.chat_prompt_ids(tokenizer, p)
            for p in held_out_chat(corpus, len(corpus.TRAIN_PROMPTS))]
    code = [corpus.chat_prompt_ids(tokenizer, p)
            for p in corpus.code_requests(64, skip=CODE_FILES)]
    payloads = [tokenizer(p, add_special_tokens=False)["input_ids"][:PAYLOAD_TOKENS]
                for p in corpus.checksum_manifests(CODE_FILES)]
    return chat, code, payloads


def _describe(what) -> str:
    if isinstance(what, dict):
        return ", ".join(f"{k}={v}" for k, v in what.items()
                         if k in ("source", "reason", "tokens", "exit_rate"))
    return str(what)


def _short(layers: dict[int, float] | None) -> str:
    if not layers:
        return "(none)"
    return "{" + ", ".join(f"{k}: {v:.2f}" for k, v in sorted(layers.items())) + "}"


def judge(phases: list[SegmentPhase], delta: float, epsilon: float) -> dict[str, tuple[bool, str]]:
    """The statistical part of "loop closed": the drifting segment exits more after its
    recalibration than during its fallback, and no phase's served segment shows disagreement
    above δ at 1 - ε (one-sided Clopper-Pearson lower bound, as the default story judges its
    last phase; the drifting segment is not judged while it drifts or falls back); the steady
    segment exits during the fallback."""
    from controlplane.stats.clustered import clopper_pearson

    by_name = {p.name.split(" ")[0]: p for p in phases}
    out: dict[str, tuple[bool, str]] = {}
    fallback, recovered = by_name.get("5"), by_name.get("6")
    if fallback and recovered:
        before, after = fallback.stats(DRIFTING), recovered.stats(DRIFTING)
        out[f"{DRIFTING} exits again after recalibration"] = (
            after.exit_rate > before.exit_rate,
            f"{before.exit_rate:.1%} in fallback -> {after.exit_rate:.1%}")
        steady = fallback.stats(STEADY)
        out[f"{STEADY} keeps exiting during {DRIFTING}'s fallback"] = (
            steady.exit_rate > 0, f"{STEADY} exit rate {steady.exit_rate:.1%}")
    else:
        out["story reached the recalibrated phase"] = (False, "it stopped earlier")
    for phase in phases:
        step = phase.name.split(" ")[0]
        # Not judged: the never-exit warm-up, and the drifting segment while it drifts or falls
        # back (the loop judges those). The steady one is judged in every serving phase.
        judged = {"2": SEGMENTS, "3": SEGMENTS, "4": (STEADY,), "5": (STEADY,),
                  "6": SEGMENTS}.get(step, ())
        for segment in judged:
            stats = phase.stats(segment)
            if not stats.shadow:
                continue
            lower = clopper_pearson(stats.disagreement or 0.0, stats.shadow, epsilon)[0]
            out[f"{phase.name.split(' ')[0]} {segment} within δ"] = (
                lower <= delta, f"disagreement {stats.disagreement:.3f} on {stats.shadow} "
                f"shadow tokens, lower {1 - epsilon:.0%} bound {lower:.3f} vs δ {delta}")
    return out


def _report(timeline, phases: list[SegmentPhase], checks: dict[str, tuple[bool, str]],
            delta: float, epsilon: float) -> bool:
    """Print the timeline, the per-phase per-segment table and the checks; True when every
    check passed (the loop closed)."""
    click.echo("\nTimeline")
    for at, text in timeline.events:
        click.echo(f"  {at:7.1f}s  {text}")
    click.echo("\nSummary per phase and segment")
    click.echo(f"  {'phase':<40}{'segment':>8}{'tokens':>8}{'exit rate':>10}{'mean exit':>10}"
               f"{'shadow':>8}{'disagree':>9}  versions")
    for phase in phases:
        for segment in SEGMENTS:
            p = phase.stats(segment)
            disagreement = "-" if p.disagreement is None else f"{p.disagreement:.3f}"
            depth = f"{p.mean_exit_layer:.1f}" if p.served else "full"
            click.echo(f"  {phase.name:<40}{segment:>8}{p.tokens:>8}{p.exit_rate:>10.1%}"
                       f"{depth:>10}{p.shadow:>8}{disagreement:>9}  {sorted(p.versions)}")
    everything = {**checks, **judge(phases, delta, epsilon)}
    click.echo("\nChecks")
    for name, (passed, detail) in everything.items():
        click.echo(f"  [{'ok' if passed else 'FAIL'}] {name}: {detail}")
    ok = bool(everything) and all(passed for passed, _ in everything.values())
    click.echo(f"\nloop closed: {'yes' if ok else 'no'} (per segment; Clopper-Pearson lower "
               f"{1 - epsilon:.0%} bounds vs δ {delta})")
    return ok
