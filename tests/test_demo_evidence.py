"""The demo's phases advance on the evidence the control plane's statistics need, with a safety
limit that scales with the measured speed (`exitplane.demo`'s pure parts)."""

import io
import math

import pytest

from controlplane.calibration.service import CalibrationPolicy
from controlplane.drift.window_checks import DriftOptions
from controlplane.settings import Settings
from controlplane.stats.clustered import clopper_pearson
from exitplane.demo import (
    SHADOW_DRIFT,
    Evidence,
    Pace,
    PhaseStats,
    Progress,
    Timeline,
    _report,
    control_plane_settings,
    first_sentence,
    held_bound,
    paced_step,
    phase_line,
    progress_step,
    safety_limit_s,
    serve_stream,
    settings_env,
    throttle_pause,
    tokens_to_show,
)


def test_evidence_is_read_from_the_control_planes_settings(tmp_path):
    settings = Settings(var_dir=tmp_path, calibration_min_samples=450,
                        fallback_min_shadow_tokens=150, drift_interval_s=10.0,
                        drift_recent_s=600.0, drift_quality_windows_s=[60.0, 600.0])
    evidence = Evidence.from_settings(settings, served_tokens=321)
    assert evidence.calibration_shadow == 450 == CalibrationPolicy.from_settings(
        settings).min_samples_per_layer
    assert evidence.last_good_shadow == 150
    assert evidence.quality_shadow == DriftOptions.from_settings(settings).min_shadow_tokens
    assert evidence.quality_alpha == pytest.approx(1e-2 * 10.0 / 3600 / 2)
    assert evidence.served_tokens == 321


@pytest.mark.parametrize("quick", [True, False])
def test_the_control_plane_runs_with_the_values_the_targets_come_from(monkeypatch, tmp_path,
                                                                      quick):
    """The env the demo gives its control plane parses to the settings its targets use."""
    values = control_plane_settings(quick=quick)
    for name, value in settings_env(values).items():
        monkeypatch.setenv(name, value)
    from_env = Settings(var_dir=tmp_path)
    for name, value in values.items():
        assert getattr(from_env, name) == value, name
    direct = Evidence.from_settings(Settings(**values, var_dir=tmp_path), served_tokens=1)
    assert direct == Evidence.from_settings(from_env, served_tokens=1)
    assert direct.calibration_shadow == (300 if quick else 600)


def test_the_longest_quality_window_holds_the_drift_phase_at_two_tokens_a_second(tmp_path):
    """At the speeds the story promises (a fifth of this 2-core machine's is about 3 tokens/s),
    the quality test's longest window holds every code shadow token the drift phase waits for."""
    values = control_plane_settings(quick=False)
    settings = Settings(**values, var_dir=tmp_path)
    evidence = Evidence.from_settings(settings, served_tokens=400)
    longest = min(max(settings.drift_quality_windows_s), settings.drift_recent_s)
    assert longest * 2.0 * SHADOW_DRIFT >= evidence.drift_cap()
    assert evidence.drift_cap() >= evidence.quality_shadow


def test_each_calibration_attempt_waits_for_another_minimum():
    evidence = Evidence(calibration_shadow=600, quality_shadow=100, quality_alpha=1e-5,
                        last_good_shadow=200, served_tokens=400)
    assert [evidence.calibration_target(n) for n in (1, 2, 3)] == [600, 1200, 1800]
    assert evidence.planned_tokens() > evidence.calibration_target(2) + evidence.drift_cap()


@pytest.mark.parametrize("rate", [0.08, 0.12, 0.3])
def test_tokens_to_show_is_the_fewest_with_a_lower_bound_above_delta(rate):
    alpha, delta = 4.6e-6, 0.05
    n = tokens_to_show(rate, delta, alpha)
    assert clopper_pearson(rate, n, alpha)[0] > delta
    assert clopper_pearson(rate, n - 1, alpha)[0] <= delta


def test_tokens_to_show_falls_with_the_disagreement_and_respects_the_minimum():
    alpha, delta = 4.6e-6, 0.05
    counts = [tokens_to_show(rate, delta, alpha) for rate in (0.07, 0.1, 0.2, 0.5)]
    assert counts == sorted(counts, reverse=True) and counts[0] > counts[-1]
    assert tokens_to_show(0.9, delta, alpha, minimum=100) == 100
    assert tokens_to_show(0.05, delta, alpha) is None
    assert tokens_to_show(0.01, delta, alpha) is None
    assert tokens_to_show(0.0501, delta, alpha, limit=1000) is None


def test_the_safety_limit_scales_with_the_measured_speed():
    assert safety_limit_s(5000, 0.0) == math.inf  # nothing measured yet: no limit
    fast, slow = safety_limit_s(5000, 15.0), safety_limit_s(5000, 3.0)
    assert slow - 600 == pytest.approx(5 * (fast - 600))
    # never shorter than the planned tokens take at the measured speed, whatever the speed
    for speed in (0.5, 3.0, 15.0, 200.0):
        assert safety_limit_s(5000, speed) >= 5000 / speed + 600


def test_a_throttle_of_f_runs_at_one_fth_of_the_speed():
    assert throttle_pause(2.0, 1.0) == 0.0
    assert throttle_pause(2.0, 5.0) == pytest.approx(8.0)
    now = [0.0]
    slept = []

    def step():
        now[0] += 0.25  # the work of one step
        return ["token"] * 4

    def sleep(seconds):
        slept.append(seconds)
        now[0] += seconds

    pace = Pace()
    paced = paced_step(step, pace, 5.0, sleep=sleep, clock=lambda: now[0])
    for _ in range(3):
        assert paced() == ["token"] * 4
    assert slept == [pytest.approx(1.0)] * 3
    assert pace.tokens == 12 and pace.seconds == pytest.approx(3.75)
    assert pace.tokens_per_s == pytest.approx(16 / 5)  # 16 tokens/s of work, at a fifth


def test_phase_line_says_what_the_phase_waits_for():
    assert phase_line(3, "drift", 412, 1000, "shadow tokens on code traffic") == (
        "phase 3/5 drift: 412/1000 shadow tokens on code traffic")
    assert phase_line(4, "recalibrate", 12, None, "shadow tokens", "job 3 queued") == (
        "phase 4/5 recalibrate: 12 shadow tokens (job 3 queued)")


def test_a_log_gets_a_phase_line_at_its_quarters_or_each_doubling():
    assert not progress_step(0, 200, 1000)
    assert progress_step(200, 260, 1000)
    assert progress_step(900, 1100, 1000)
    assert not progress_step(1100, 1300, 1000)  # past the target: nothing more to tell
    assert progress_step(0, 5, None) and progress_step(100, 130, None)
    assert not progress_step(130, 250, None)


class _Stream(io.StringIO):
    def __init__(self, tty: bool) -> None:
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_on_a_log_and_on_a_terminal():
    log = _Stream(tty=False)
    progress = Progress(log)
    for have in range(0, 1001, 50):
        progress.show(1, "calibrate", have, 1000, "shadow tokens on chat traffic")
    progress.show(2, "serve chat", 10, 400, "served tokens under v2")
    lines = log.getvalue().splitlines()
    # the first line, one per quarter, then the next phase's first line
    assert len(lines) == 6, lines
    assert lines[0].endswith("] phase 1/5 calibrate: 0/1000 shadow tokens on chat traffic")
    assert lines[0].startswith("[") and "phase 2/5 serve chat: 10/400" in lines[-1]

    terminal = _Stream(tty=True)
    progress = Progress(terminal)
    for have in (10, 20, 30):
        progress.show(1, "calibrate", have, 1000, "shadow tokens")
    progress.done()
    text = terminal.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1
    assert text.rstrip().endswith("30/1000 shadow tokens")


def test_serving_keeps_the_batch_full_and_ends_where_the_evidence_is_complete():
    """The tiny Llama, no exits: the batch stays full across requests, the phase stops at the
    first check past its target and the requests still running are cancelled."""
    from runtime.engine import Engine, EngineConfig
    from runtime.model import tiny_llama

    engine = Engine(tiny_llama(), config=EngineConfig(max_batch=3, shadow_rate=0.5))
    records: list = []
    engine.on_record = records.append
    stats = PhaseStats("tiny")
    prompts = iter([[1, 2, 3], [4, 5], [6, 7, 8, 9]] * 50)
    checks: list[int] = []

    def stop() -> bool:
        checks.append(stats.tokens)
        return stats.tokens >= 40

    serve_stream(engine, records, stats, prompts, 5, lambda version: {}, stop=stop,
                 check_every=2)
    assert stats.tokens == len(records) == checks[-1] >= 40
    assert all(before < 40 for before in checks[:-1])
    assert checks[-1] - 40 < 2 * 3  # at most one check's steps past the target
    assert stats.tokens > 3 * 5  # finished requests were replaced: more than one batch ran
    assert stats.shadow + stats.served == stats.tokens and stats.shadow > 0
    assert not engine.has_work  # nothing left running


def _phase(name: str, *, served: int, exits: int, shadow: int, disagreements: int) -> PhaseStats:
    return PhaseStats(name, tokens=served + shadow, seconds=10.0, exits=exits,
                      depth_sum=exits * 20 + (served - exits) * 30, served=served,
                      shadow=shadow, disagreements=disagreements, versions={1})


def test_the_summary_says_whether_the_loop_closed_with_rates_to_three_decimals(capsys):
    fallback = _phase("B code: conservative fallback (collecting samples)", served=0, exits=0,
                      shadow=1000, disagreements=0)
    closed = _phase("B code: recalibrated", served=500, exits=40, shadow=111, disagreements=3)
    assert _report(Timeline(), [fallback, closed], delta=0.05, epsilon=0.1)
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("loop closed: yes") and "disagreement 0.027," in line, line

    # Disagreement whose lower bound is above δ leaves the loop open, whatever the exit rate.
    unsafe = _phase("B code: recalibrated", served=500, exits=400, shadow=111, disagreements=30)
    assert not _report(Timeline(), [fallback, unsafe], delta=0.05, epsilon=0.1)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("loop closed: no")


def test_a_version_that_holds_on_the_new_traffic_closes_the_loop_without_a_fallback(capsys):
    """When code traffic stays within δ under the chat version (a 90% bound), nothing falls
    back: the samples are collected under that version, and the loop closes on the
    recalibrated phase all the same."""
    held = _phase("B code: after the shift", served=0, exits=0, shadow=400, disagreements=8)
    assert held_bound(held) < 0.05 < held_bound(
        _phase("B code: after the shift", served=0, exits=0, shadow=400, disagreements=18))
    collecting = _phase("B code: collecting samples (v2 stays)", served=0, exits=0,
                        shadow=700, disagreements=10)
    closed = _phase("B code: recalibrated", served=500, exits=40, shadow=111, disagreements=3)
    assert _report(Timeline(), [held, collecting, closed], delta=0.05, epsilon=0.1)
    assert capsys.readouterr().out.strip().splitlines()[-1].startswith("loop closed: yes")


def test_a_jobs_reason_shows_as_its_first_sentence_cut_at_a_word():
    reason = ("no exit step could be certified at δ=0.05, ε=0.1 on these samples; the current "
              "active set stays. Widen the window, collect more")
    assert first_sentence(reason) == ("no exit step could be certified at δ=0.05, ε=0.1 on "
                                      "these samples; the current active set stays")
    cut = first_sentence("word " * 40, limit=30)
    assert cut.endswith("...") and len(cut) <= 33 and " wor..." not in cut
    assert first_sentence(None) == ""
