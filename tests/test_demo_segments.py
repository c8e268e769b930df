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


def _story(recovered_code: tuple[int, int, int, int]) -> list[SegmentPhase]:
    return [_phase("2 mostly chat", chat=(300, 150, 100, 3), code=(75, 40, 25, 0)),
            _phase("3 mostly code", chat=(75, 38, 25, 1), code=(300, 160, 100, 2)),
            _phase("4 code drifts", chat=(75, 38, 25, 1), code=(300, 160, 100, 30)),
            _phase("5 code fallback", chat=(75, 30, 75, 2), code=(300, 0, 300, 0)),
            _phase("6 code recalibrated", chat=(75, 38, 25, 1), code=recovered_code)]


def test_judge_closes_the_loop_per_segment():
    checks = judge(_story((300, 120, 100, 4)), delta=0.05, epsilon=0.1)
    assert all(passed for passed, _ in checks.values()), checks
    assert checks["chat keeps exiting during code's fallback"][0]
    assert "6 code within δ" in checks and "3 chat within δ" in checks
    assert "4 code within δ" not in checks  # the drift itself is judged by the loop
    assert "4 chat within δ" in checks and "5 chat within δ" in checks


def test_judge_fails_when_chat_pays_for_codes_drift():
    story = _story((300, 120, 100, 4))
    story[2] = _phase("4 code drifts", chat=(300, 160, 89, 14), code=(300, 160, 100, 30))
    checks = judge(story, delta=0.05, epsilon=0.1)
    assert not checks["4 chat within δ"][0]
    assert checks["6 code within δ"][0]


def test_judge_fails_when_code_disagrees_after_recalibration():
    checks = judge(_story((300, 120, 100, 20)), delta=0.05, epsilon=0.1)
    assert not checks["6 code within δ"][0]
    assert checks["code exits again after recalibration"][0]


def test_judge_fails_when_code_does_not_exit_again_or_the_story_stopped():
    assert not judge(_story((300, 0, 100, 0)), delta=0.05,
                     epsilon=0.1)["code exits again after recalibration"][0]
    stopped = judge(_story((300, 120, 100, 4))[:3], delta=0.05, epsilon=0.1)
    assert not stopped["story reached the recalibrated phase"][0]


def test_programming_questions_are_the_code_segment_and_the_rest_chat():
    from exitplane.demo_segments import CODE_QUESTION
    from runtime import corpus

    prompts = corpus.TRAIN_PROMPTS + corpus.HELD_OUT_PROMPTS
    code = [p for p in prompts if CODE_QUESTION.search(p)]
    assert "How do I read a CSV file in Python?" in code
    assert "Write a haiku about autumn leaves." not in code
    assert "What is the capital of Japan, and what is it known for?" not in code  # not 'api'
    assert 20 <= len(code) <= len(prompts) - 20  # both segments get enough distinct prompts
