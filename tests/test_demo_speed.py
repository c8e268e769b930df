"""The demo's chat traffic is held out from the exit heads' training, and its summary says
what early exit saves against full depth on the same prompts, a loss as a loss."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from exitplane.demo import DEMO_HEADS, Timeline, _DefaultStory, _report
from exitplane.demo_speed import SpeedCheck, held_out_chat, speed_check
from runtime import corpus


def shingles(text: str, n: int = 8) -> set[tuple[str, ...]]:
    words = re.findall(r"[a-z0-9']+", text.lower())
    return {tuple(words[i:i + n]) for i in range(len(words) - n + 1)}


@pytest.fixture(scope="module")
def trained_prompts() -> int:
    """How many of corpus.TRAIN_PROMPTS the shipped heads' training answered."""
    from runtime.heads import ExitHeads

    return int(ExitHeads.load(DEMO_HEADS).metadata["config"]["generation_prompts"])


def test_the_chat_prompts_share_no_text_with_the_heads_training(trained_prompts):
    served = held_out_chat(corpus, trained_prompts)
    assert len(served) >= 16
    training = corpus.TRAIN_PROMPTS[:trained_prompts]
    seen = set().union(*(shingles(p) for p in training))
    for prompt in served:
        assert prompt not in training
        # nor eight words in a row (a reworded training prompt would share them; the openings
        # instructions share, "Write a function that checks whether a", are seven)
        assert not shingles(prompt) & seen, prompt


def test_a_training_prompt_is_never_served_even_if_listed_as_held_out(monkeypatch):
    leaked = corpus.TRAIN_PROMPTS[3].upper()
    monkeypatch.setattr(corpus, "HELD_OUT_PROMPTS", [*corpus.HELD_OUT_PROMPTS[:2], leaked])
    assert held_out_chat(corpus, 48) == corpus.HELD_OUT_PROMPTS[:2]


def test_the_default_story_serves_the_held_out_prompts(trained_prompts):
    heads = SimpleNamespace(metadata={"config": {"generation_prompts": trained_prompts}})
    runtime = SimpleNamespace(engine=SimpleNamespace(heads=heads))

    def tokenizer(text: str, **_) -> dict:  # no chat template: the text's characters
        return {"input_ids": [ord(c) for c in text]}

    story = _DefaultStory(api=None, runtime=runtime, corpus=corpus, timeline=Timeline(),
                          tokenizer=tokenizer, quick=True, delta=0.05, epsilon=0.1,
                          evidence=None, progress=None)
    assert story.chat_prompts == held_out_chat(corpus, trained_prompts)
    assert not set(story.chat_prompts) & set(corpus.TRAIN_PROMPTS)


def figures(net: float, *, speedup: float) -> dict:
    return {"measured_speedup": speedup, "watched_speedup": speedup - 0.05,
            "measured_net_saving": net - 0.01, "watched_shadow_tokens": 12,
            "cost_model": {"overhead_us": 2500.0, "layer_us": 1100.0, "check_us": 9.0,
                           "num_layers": 30, "tokens": 576, "full_depth_us": 35500.0},
            "model_net_saving": net, "model_net_saved_us_per_token": net * 35500,
            "check_cost_share": 0.001, "shadow_tokens_measured_us": 60000.0}


def check(net: float, speedup: float) -> SpeedCheck:
    return SpeedCheck(prompts=8, new_tokens=24, batch=8, version=1, shadow_rate=0.25,
                      figures=figures(net, speedup=speedup))


def test_the_summary_reports_a_loss_as_a_loss_and_points_to_the_savings_panel():
    url = "http://127.0.0.1:8010/ui/deployments/demo"
    lost = "\n".join(check(-0.031, 0.98).lines(url))
    assert "early exit 0.98x; with 25% shadow tokens 0.93x" in lost
    assert "2.50 ms + 1.10 ms per layer + 0.009 ms per exit check" in lost
    assert "net saving after checks and shadow tokens: -3.1% (measured -4.1%)" in lost
    assert "early exit does not pay on this machine" in lost
    assert f"savings panel: {url}" in lost
    assert "load average" not in lost  # a quiet machine: nothing to warn about
    busy = SpeedCheck(prompts=8, new_tokens=24, batch=8, version=1, shadow_rate=0.25,
                      figures=figures(0.1, speedup=1.1), load=7.5, cpus=2)
    assert "load average 7.5 on 2 CPUs during the check" in "\n".join(busy.lines(url))
    gained = "\n".join(check(0.12, 1.2).lines(url))
    assert "+12.0%" in gained and "early exit pays on this machine" in gained


def test_the_speed_lines_come_before_the_verdict_on_the_loop(capsys):
    _report(Timeline(), [], delta=0.05, epsilon=0.1, speed=check(-0.031, 0.98),
            ui_url="http://x/ui/deployments/demo")
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("loop closed: no")
    assert any(line.startswith("Speed against full depth (8 held-out chat prompts")
               for line in out)


def test_the_speed_check_runs_the_same_prompts_three_ways():
    import torch

    from runtime.heads import ExitHeads
    from runtime.model import decoder_parts, tiny_llama
    from runtime.testing import ascii_tokenizer

    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    parts = decoder_parts(model)
    heads = ExitHeads(exit_layers=[2, 4], hidden_size=parts.hidden_size, eps=1e-5,
                      norm_weight=parts.norm.weight)
    with torch.no_grad():
        heads.confidence["2"].fc2.bias.fill_(5.0)  # every served token leaves at layer 2
    found = speed_check(model, heads, ascii_tokenizer(), corpus, corpus.HELD_OUT_PROMPTS[:4],
                        version=3, thresholds={2: 0.5, 4: 0.5}, shadow_rate=0.5,
                        new_tokens=8)
    assert (found.prompts, found.new_tokens, found.version) == (4, 8, 3)
    assert found.figures["watched_shadow_tokens"] > 0
    assert found.figures["measured_speedup"] > 0
    assert any("savings panel" in line for line in found.lines("u"))


def test_the_segments_story_serves_held_out_chat_too():
    from exitplane.demo_segments import prompt_sources

    def tokenizer(text: str, **_) -> dict:
        return {"input_ids": [ord(c) for c in text]}

    chat, _, _ = prompt_sources(tokenizer, corpus)
    served = {"".join(map(chr, ids)) for ids in chat}
    assert served == set(held_out_chat(corpus, len(corpus.TRAIN_PROMPTS)))
    assert not served & set(corpus.TRAIN_PROMPTS)


def test_the_answer_check_says_which_answers_the_version_changes_and_where():
    import torch

    from exitplane.demo_speed import answer_check
    from exitplane.wire import Signal
    from runtime.benchmark import run_engine
    from runtime.engine import ExitPolicy
    from runtime.heads import ExitHeads
    from runtime.model import decoder_parts, tiny_llama
    from runtime.testing import ascii_tokenizer

    torch.manual_seed(0)
    model = tiny_llama(seed=0)
    parts = decoder_parts(model)
    heads = ExitHeads(exit_layers=[2, 4], hidden_size=parts.hidden_size, eps=1e-5,
                      norm_weight=parts.norm.weight)
    with torch.no_grad():
        heads.confidence["2"].fc2.bias.fill_(5.0)  # every token may leave at layer 2
    tokenizer, prompts = ascii_tokenizer(), corpus.HELD_OUT_PROMPTS[:4]
    kept = answer_check(model, heads, tokenizer, corpus, prompts, version=1,
                        thresholds={2: 1.0, 4: 1.0}, new_tokens=8)
    assert kept.divergence == [-1, -1, -1, -1] and kept.identical == 4

    early = {2: 0.5, 4: 0.5}
    found = answer_check(model, heads, tokenizer, corpus, prompts, version=2,
                         thresholds=early, new_tokens=8)
    ids = [corpus.chat_prompt_ids(tokenizer, p) for p in prompts]
    full, _, _ = run_engine(model, heads, ids, 8,
                            policy=ExitPolicy.never_exit([2, 4], Signal.learned))
    exited, _, _ = run_engine(model, heads, ids, 8, policy=ExitPolicy(
        version=2, signal=Signal.learned, thresholds=early))
    actual = [next((k for k, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), -1)
              for x, y in zip(full, exited, strict=True)]
    assert found.divergence == actual  # exact: the lazy cache keeps the full-depth cache
    assert found.identical < 4  # random weights: early exit changes some answers
    text = "\n".join(found.lines())
    assert f"identical to the full model's answer: {found.identical} of 4" in text
