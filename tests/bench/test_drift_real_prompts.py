"""bench/drift_real.py's prompt lists with the real tokenizer and standard library: a longer
list keeps a shorter one as its prefix (cached records stay valid), each request names its
group, and no window comes from text the exit heads were trained on."""

from __future__ import annotations

from pathlib import Path

import pytest

from runtime import corpus
from tests.support.benches import load_bench

ROOT = Path(__file__).resolve().parents[2]
TRAINED_CHARS = 60_000  # the cached demo heads' `stdlib_chars` (exitplane.demo._heads, quick)


def _drift_real():
    return load_bench("drift_real")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    from runtime.model import smollm2_gguf_path

    path = smollm2_gguf_path()
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name,
                                         local_files_only=True)


def _head(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")[:4000]
    except UnicodeDecodeError:
        return ""


def test_trained_files_is_the_prefix_stdlib_texts_reads():
    bench = _drift_real()
    count = bench.trained_files(TRAINED_CHARS)
    files = corpus.stdlib_files()
    texts = list(corpus.stdlib_texts(TRAINED_CHARS))
    assert 0 < count < len(files)
    # the training text holds openings of files before `count`, none after; the last file
    # is read (its source, or only its docstrings when the budget ran out first)
    assert any(_head(path) in texts for path in files[:count - 1])
    assert not any(_head(path) in texts for path in files[count:])
    assert _head(files[count - 1]) in texts or texts[-1] not in map(_head, files)
    assert bench.trained_files(2 * TRAINED_CHARS) > count


@pytest.mark.slow  # tokenises the standard library: ~30 s
def test_prompt_lists_are_prefixes_with_groups_away_from_trained_text(tokenizer):
    bench = _drift_real()
    lists = {}
    for source in ("chat", "code"):
        short, _ = bench._prompts(source, tokenizer, 120, 48, trained_chars=TRAINED_CHARS)
        long, groups = bench._prompts(source, tokenizer, 960, 48, trained_chars=TRAINED_CHARS)
        assert len(long) == len(groups) == 960
        assert long[:120] == short
        # identical prompts (generated files open alike) share a group
        group_of: dict[tuple, int] = {}
        for prompt, group in zip(long, groups, strict=True):
            assert group_of.setdefault(tuple(prompt), group) == group
        lists[source] = long, groups
    # chat: every module name once, then the names again with the other ask
    long, groups = lists["chat"]
    names = len(bench._module_names(10_000))
    assert len(set(map(tuple, long))) == 960
    assert groups == list(range(names)) + list(range(960 - names))
    # code: one window per file past the trained ones, then a second window further in that
    # repeats no earlier prompt
    long, groups = lists["code"]
    files = corpus.stdlib_files()
    trained = bench.trained_files(TRAINED_CHARS)
    first_pass = len(files) - trained - sum(
        len(tokenizer(path.read_text(encoding="utf-8"), add_special_tokens=False)["input_ids"])
        < 48 for path in files[trained:])
    second = long[first_pass:]
    assert len(set(map(tuple, second))) == len(second)
    assert not set(map(tuple, second)) & set(map(tuple, long[:first_pass]))
    expected, seen = [], set(map(tuple, long[:first_pass]))
    for index in range(len(files) - 1, trained - 1, -1):
        ids = tokenizer(files[index].read_text(encoding="utf-8"),
                        add_special_tokens=False)["input_ids"]
        window = tuple(ids[bench.SECOND_WINDOW_AT:bench.SECOND_WINDOW_AT + 48])
        if len(window) == 48 and window not in seen and len(expected) < len(second):
            seen.add(window)
            expected.append((index, window))
    assert [list(window) for _, window in expected] == second
    # a group is named by the first file of its files: at most the prompt's own file
    assert all(groups[first_pass + k] <= index for k, (index, _) in enumerate(expected))
    assert min(groups) >= trained


def test_cached_prefix_is_the_largest_smaller_file_of_the_source(tmp_path, monkeypatch):
    import numpy as np

    bench = _drift_real()
    monkeypatch.setattr(bench, "RECORDS_DIR", tmp_path)
    for name in ("chat-120x32", "chat-480x32", "code-720x32", "chat-720x16"):
        count = int(name.split("-")[1].split("x")[0])
        np.savez_compressed(tmp_path / f"{name}.npz", request=np.arange(count))
    count, records = bench._cached_prefix("chat", 960, 32)
    assert count == 480 and records["request"].tolist() == list(range(480))
    assert bench._cached_prefix("chat", 480, 32)[0] == 120
    assert bench._cached_prefix("chat", 120, 32) == (0, None)
    assert bench._cached_prefix("docs", 960, 32) == (0, None)
