"""The segments story's pure parts: the traffic mix, its prompt sources and the "loop closed"
judgement."""

import hashlib
import re
import sysconfig
from pathlib import Path

from exitplane.demo import CODE_FILES, PhaseStats
from exitplane.demo_segments import DRIFTING, STEADY, SegmentPhase, judge, mix
from runtime import corpus


def test_mix_gives_each_phase_its_share_of_code_in_shared_batches():
    chat, code = [[1], [2], [3]], [[10], [11]]
    for share, expected in ((0.2, 4), (0.5, 10), (0.8, 16)):
        items = [item for cursor in range(0, 20, 4) for item in mix(chat, code, share, cursor)]
        assert sum(segment == "code" for _, segment in items) == expected
        assert all((prompt in code) == (segment == "code") for prompt, segment in items)
    assert {segment for _, segment in mix(chat, code, 0.5, 0)} == {"chat", "code"}


def _phase(name: str, **segments: tuple[int, int, int, int]) -> SegmentPhase:
    phase = SegmentPhase(name, code_share=0.8)
    for segment, (served, exits, shadow, disagreements) in segments.items():
        phase.by_segment[segment] = PhaseStats(name, tokens=served + shadow, served=served,
                                               exits=exits, shadow=shadow,
                                               disagreements=disagreements)
    return phase


def _story(recovered_code: tuple[int, int, int, int]) -> list[SegmentPhase]:
    """Phases as the story names them; code drifts in phase 4 (served, exits, shadow, bad)."""
    return [_phase("2 mostly chat", chat=(300, 150, 100, 3), code=(75, 10, 25, 0)),
            _phase("3 mostly code", chat=(75, 38, 25, 1), code=(300, 30, 100, 2)),
            _phase("4 code drifts", chat=(150, 75, 50, 1), code=(150, 90, 50, 15)),
            _phase("5 code fallback", chat=(75, 38, 225, 3), code=(75, 0, 225, 0)),
            _phase("6 code recalibrated", chat=(150, 75, 50, 1), code=recovered_code)]


def test_the_drift_is_within_code_and_chat_must_not_notice():
    assert (DRIFTING, STEADY) == ("code", "chat")  # drifting, steady: the story's names


def test_judge_closes_the_loop_per_segment():
    checks = judge(_story((300, 120, 100, 4)), delta=0.05, epsilon=0.1)
    assert all(passed for passed, _ in checks.values()), checks
    assert checks["chat keeps exiting during code's fallback"][0]
    assert "6 code within δ" in checks and "3 chat within δ" in checks
    assert "4 code within δ" not in checks  # the drift itself is judged by the loop
    assert "4 chat within δ" in checks and "5 chat within δ" in checks


def test_judge_fails_when_the_steady_segment_pays_for_the_drift():
    story = _story((300, 120, 100, 4))
    story[2] = _phase("4 code drifts", chat=(300, 160, 89, 14), code=(150, 90, 50, 15))
    checks = judge(story, delta=0.05, epsilon=0.1)
    assert not checks["4 chat within δ"][0]
    assert checks["6 code within δ"][0]


def test_judge_fails_when_chat_stops_exiting_during_codes_fallback():
    story = _story((300, 120, 100, 4))
    story[3] = _phase("5 code fallback", chat=(75, 0, 225, 3), code=(75, 0, 225, 0))
    assert not judge(story, delta=0.05, epsilon=0.1)["chat keeps exiting during code's fallback"][0]


def test_judge_fails_when_code_disagrees_after_recalibration():
    checks = judge(_story((300, 120, 100, 20)), delta=0.05, epsilon=0.1)
    assert not checks["6 code within δ"][0]
    assert checks["code exits again after recalibration"][0]


def test_judge_fails_when_code_does_not_exit_again_or_the_story_stopped():
    assert not judge(_story((300, 0, 100, 0)), delta=0.05,
                     epsilon=0.1)["code exits again after recalibration"][0]
    stopped = judge(_story((300, 120, 100, 4))[:3], delta=0.05, epsilon=0.1)
    assert not stopped["story reached the recalibrated phase"][0]


def test_code_requests_ask_for_stdlib_functions_in_one_sentence():
    requests = corpus.code_requests(64, skip=CODE_FILES)
    assert len(requests) == 64 and len(set(requests)) == 64
    for request in requests:
        name = re.fullmatch(r"Write a Python function `(\w+)\(.*?\)`: ([A-Z].{29,199})", request)
        assert name, request
        assert ">" not in name.group(2)
    # Leaving a file out drops its functions (list_public_methods is xmlrpc/server.py's).
    assert "`list_public_methods(obj)`" in requests[0]
    without = corpus.code_requests(64, skip=("server.py",))
    assert not any("list_public_methods" in r for r in without)


def test_checksum_manifests_are_block_checksums_of_stdlib_sources():
    manifests = corpus.checksum_manifests(CODE_FILES)
    assert len(manifests) == 2 * len(CODE_FILES)  # every listed file exists in any CPython
    assert len(set(manifests)) == len(manifests)  # two offsets per file: distinct prompts
    root = Path(sysconfig.get_paths()["stdlib"])
    text = (root / CODE_FILES[0]).read_text(encoding="utf-8")
    for manifest, data in zip(manifests[:2], (text[2000:6000].encode(), text[:4000].encode()),
                              strict=True):
        checksums = manifest.split(",")
        assert len(checksums) == -(-len(data) // 64)
        assert checksums[0] == hashlib.sha256(data[:64]).hexdigest()[:8]
        assert all(re.fullmatch("[0-9a-f]{8}", c) for c in checksums)
    assert corpus.checksum_manifests(("no_such_module.py",)) == []


def test_mix_serves_every_prompt_of_each_source():
    chat, code = [[i] for i in range(80)], [[100 + i] for i in range(32)]
    for share in (0.2, 0.5, 0.8):
        items = [item for cursor in range(0, 400, 4) for item in mix(chat, code, share, cursor)]
        assert {p[0] for p, s in items if s == "code"} == set(range(100, 132))
        assert {p[0] for p, s in items if s == "chat"} == set(range(80))


def _record(exit_layer: int, shadow=None, segment: str = "code"):
    from exitplane.wire import ShadowPoint, TokenRecord

    points = None if shadow is None else [ShadowPoint(layer=k, signal=s, matched=m)
                                         for k, s, m in shadow]
    return TokenRecord(threshold_version=3, request_id="r", position=0, exit_layer=exit_layer,
                       signal_value=None, latency_us=1, ts=1.0, shadow=points, segment=segment)


def test_phase_stats_count_served_and_shadow_tokens_as_both_stories_do():
    stats = PhaseStats("x")
    thresholds = {6: 0.9, 12: 0.5}
    stats.count(_record(6), thresholds, 30)     # served, exited at 6
    stats.count(_record(30), thresholds, 30)    # served, full depth
    # shadow: layer 6 stays (0.8 <= 0.9), layer 12 would exit (0.6 > 0.5) and its top-1 differs
    stats.count(_record(30, [(6, 0.8, True), (12, 0.6, False)]), thresholds, 30)
    # shadow: the first layer that would exit matched, a later mismatch does not count
    stats.count(_record(30, [(6, 0.95, True), (12, 0.99, False)]), thresholds, 30)
    assert (stats.tokens, stats.served, stats.exits, stats.depth_sum) == (4, 2, 1, 36)
    assert (stats.shadow, stats.disagreements, stats.versions) == (2, 1, {3})
    assert stats.exit_rate == 0.5 and stats.disagreement == 0.5
