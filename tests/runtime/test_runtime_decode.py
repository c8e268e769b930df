"""The decode loop keeps the device busy: no hidden host reads, sampling on the device.

On CUDA a boolean-mask index, `.item()`, `.tolist()` or `.cpu()` each wait for the device
queue to drain. There is no GPU in CI, so these tests watch the same operations on CPU
through torch's own interposition points (a function mode sees every host read a tensor
method makes, a dispatch mode sees every aten op) while the real engine decodes.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from exitplane.wire import Signal
from runtime.engine import Engine, EngineConfig, ExitPolicy
from runtime.heads import ExitHeads
from runtime.model import decoder_parts, tiny_llama
from runtime.step import sample

PROMPTS = [[1, 5, 9, 33, 7], [1, 17, 3], [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [1]]
RAGGED = ExitPolicy(version=2, signal=Signal.maxprob, thresholds={2: 0.12, 4: 0.1})
HOST_READS = frozenset({"cpu", "tolist", "item", "numpy", "__bool__", "__int__", "__float__",
                        "__index__"})
# aten ops that need the device's answer on the host (a boolean index becomes `nonzero`)
SYNC_OPS = frozenset({"aten.nonzero.default", "aten.masked_select.default",
                      "aten._local_scalar_dense.default", "aten.is_nonzero.default"})


@pytest.fixture(scope="module")
def model():
    return tiny_llama(seed=0)


class HostReads(TorchFunctionMode):
    """Counts tensor methods that read values back to the host (`.cpu().numpy()` is one)."""

    def __init__(self):
        super().__init__()
        self.reads = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS and not (name == "numpy" and self._after_cpu):
            self.reads += 1
        self._after_cpu = name == "cpu"
        return func(*args, **(kwargs or {}))

    _after_cpu = False


class SyncOps(TorchDispatchMode):
    """Counts aten ops that would wait on a CUDA device, boolean-mask indexing included."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if name in SYNC_OPS:
            self.ops[name] += 1
        elif name.startswith(("aten.index.", "aten.index_put")) and any(
                isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1]
                if i is not None):
            self.ops[f"{name} (boolean mask)"] += 1
        return func(*args, **(kwargs or {}))


def confident_heads(model) -> ExitHeads:
    """Learned heads that exit about half the rows at layer 2 and some of the rest at 4."""
    parts = decoder_parts(model)
    torch.manual_seed(1)
    heads = ExitHeads(exit_layers=[2, 4], hidden_size=parts.hidden_size, eps=1e-5,
                      norm_weight=parts.norm.weight)
    with torch.no_grad():
        for head in heads.confidence.values():
            head.fc2.weight.normal_(0, 3.0)
    return heads


@pytest.mark.parametrize(("kv_policy", "batching", "signal"), [
    ("lazy", "compact", Signal.maxprob), ("propagate", "compact", Signal.maxprob),
    ("lazy", "mask", Signal.maxprob), ("lazy", "compact", Signal.learned),
    ("lazy", "compact", Signal.saturation)])
def test_a_step_reads_the_device_once_per_live_exit_layer_and_once_at_the_end(
        model, kv_policy, batching, signal):
    heads = confident_heads(model) if signal == Signal.learned else None
    eng = Engine(model, heads=heads, exit_layers=[2, 4],
                 config=EngineConfig(max_batch=4, max_seq_len=64, kv_policy=kv_policy,
                                     batching=batching, shadow_rate=0.5, seed=5))
    thresholds = {Signal.maxprob: RAGGED.thresholds, Signal.learned: {2: 0.6, 4: 0.5},
                  Signal.saturation: {2: 0.9, 4: 0.4}}[signal]
    eng.set_thresholds(ExitPolicy(version=2, signal=signal, thresholds=thresholds))
    for index, prompt in enumerate(PROMPTS):
        eng.add_request(prompt, max_new_tokens=10, stop_token_ids=[],
                        temperature=0.8 if index == 1 else 0.0, top_p=0.9, seed=index)
    eng.step()  # admission: prefill runs outside the decode loop
    exit_layers: set[int] = set()
    while eng.has_work:
        with HostReads() as host, SyncOps() as device:
            outputs = eng.step()
        exit_layers |= {o.record.exit_layer for o in outputs}
        assert host.reads <= len(thresholds) + 1, f"{host.reads} host reads in one step"
        assert not device.ops, dict(device.ops)
    assert len(exit_layers) >= 2, "the thresholds should give ragged exits"


def test_seeded_sampling_repeats_whatever_shares_the_batch(model):
    def run(neighbours: list[list[int]], seed: int) -> list[int]:
        eng = Engine(model, exit_layers=[2, 4], config=EngineConfig(max_batch=4, max_seq_len=64))
        eng.set_thresholds(RAGGED)
        rid = eng.add_request(PROMPTS[0], max_new_tokens=12, stop_token_ids=[],
                              temperature=1.0, top_p=0.9, seed=seed)
        for prompt in neighbours:
            eng.add_request(prompt, max_new_tokens=12, stop_token_ids=[])
        tokens: list[int] = []
        while eng.has_work:
            tokens += [o.token for o in eng.step() if o.request_id == rid]
        return tokens

    alone = run([], seed=7)
    assert run(PROMPTS[1:], seed=7) == alone
    assert run([], seed=8) != alone
    greedy = Engine(model, exit_layers=[2, 4], config=EngineConfig(max_seq_len=64))
    greedy.set_thresholds(RAGGED)
    assert greedy.generate([PROMPTS[0]], max_new_tokens=12, stop_token_ids=[])[0] != alone


def test_nucleus_sampling_draws_from_the_nucleus_in_proportion():
    probs = torch.tensor([0.05, 0.5, 0.15, 0.3])
    logits = probs.log()[None].expand(4000, 4)  # (N, V): one draw per row
    greedy = logits.argmax(-1)
    generators = [torch.Generator().manual_seed(3)] * len(logits)  # one stream of draws
    nucleus = sample(logits, greedy, [1.0] * len(logits), [0.7] * len(logits), generators)
    counts = torch.bincount(nucleus, minlength=4)
    assert counts[0] == counts[2] == 0  # outside the 0.7 nucleus {1, 3}
    assert counts[1] / len(logits) == pytest.approx(0.5 / 0.8, abs=0.03)
    full = sample(logits, greedy, [1.0] * len(logits), [1.0] * len(logits), generators)
    assert (torch.bincount(full, minlength=4) / len(logits)).tolist() == pytest.approx(
        probs.tolist(), abs=0.03)
    mixed = sample(logits[:3], greedy[:3], [0.0, 1.0, 0.0], [1.0] * 3, generators[:3])
    assert mixed[0] == mixed[2] == 1


def test_rows_of_different_segments_add_no_host_read(model):
    # Each row's thresholds come from its segment's map (a (B, E) table made on the host at
    # the start of the step, compacted with the rows): still one read per live exit layer.
    eng = Engine(model, exit_layers=[2, 4],
                 config=EngineConfig(max_batch=4, max_seq_len=64, shadow_rate=0.5, seed=5))
    eng.set_thresholds(ExitPolicy(version=2, signal=Signal.maxprob, thresholds={2: 0.12, 4: 0.1},
                                  segments={"code": {2: 1.0, 4: 0.1}, "chat": {2: 0.0, 4: 1.0}}))
    for prompt, segment in zip(PROMPTS, ["code", "default", "chat", "code"], strict=True):
        eng.add_request(prompt, max_new_tokens=10, stop_token_ids=[], segment=segment)
    eng.step()
    exits: dict[str, set[int]] = {}
    while eng.has_work:
        with HostReads() as host, SyncOps() as device:
            outputs = eng.step()
        for output in outputs:
            exits.setdefault(output.record.segment, set()).add(output.record.exit_layer)
        assert host.reads <= 3, f"{host.reads} host reads in one step"
        assert not device.ops, dict(device.ops)
    assert 2 not in exits["code"] and 4 not in exits["chat"]
    assert {2, 4} <= exits["default"] | exits["code"] | exits["chat"]
