"""The segments story's pure parts: the traffic mix and the "loop closed" judgement."""

from exitplane.demo import PhaseStats
from exitplane.demo_segments import SegmentPhase, judge, mix


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


def _story(recovered_chat: tuple[int, int, int, int]) -> list[SegmentPhase]:
    """Phases as the story names them; chat drifts in phase 4 (served, exits, shadow, bad)."""
    return [_phase("2 mostly chat", chat=(300, 150, 100, 3), code=(75, 10, 25, 0)),
            _phase("3 mostly code", chat=(75, 38, 25, 1), code=(300, 30, 100, 2)),
            _phase("4 chat drifts", chat=(150, 90, 50, 15), code=(150, 15, 50, 1)),
            _phase("5 chat fallback", chat=(75, 0, 225, 0), code=(75, 8, 225, 3)),
            _phase("6 chat recalibrated", chat=recovered_chat, code=(150, 15, 50, 1))]


def test_judge_closes_the_loop_per_segment():
    checks = judge(_story((300, 120, 100, 4)), delta=0.05, epsilon=0.1)
    assert all(passed for passed, _ in checks.values()), checks
    assert checks["code keeps exiting during chat's fallback"][0]
    assert "6 chat within δ" in checks and "3 code within δ" in checks
    assert "4 chat within δ" not in checks  # the drift itself is judged by the loop
    assert "4 code within δ" in checks and "5 code within δ" in checks


def test_judge_fails_when_the_steady_segment_pays_for_the_drift():
    story = _story((300, 120, 100, 4))
    story[2] = _phase("4 chat drifts", chat=(150, 90, 50, 15), code=(300, 160, 89, 14))
    checks = judge(story, delta=0.05, epsilon=0.1)
    assert not checks["4 code within δ"][0]
    assert checks["6 chat within δ"][0]


def test_judge_fails_when_chat_disagrees_after_recalibration():
    checks = judge(_story((300, 120, 100, 20)), delta=0.05, epsilon=0.1)
    assert not checks["6 chat within δ"][0]
    assert checks["chat exits again after recalibration"][0]


def test_judge_fails_when_chat_does_not_exit_again_or_the_story_stopped():
    assert not judge(_story((300, 0, 100, 0)), delta=0.05,
                     epsilon=0.1)["chat exits again after recalibration"][0]
    stopped = judge(_story((300, 120, 100, 4))[:3], delta=0.05, epsilon=0.1)
    assert not stopped["story reached the recalibrated phase"][0]
