"""The demo's speed check: does early exit pay on this machine?

The same held-out chat prompts run three ways on a separate engine over the demo's model and
heads (nothing is shipped to the control plane): at full depth with no checks, with the
calibrated version's thresholds, and with those thresholds plus the serving phase's shadow
tokens; one prompt at a time, the three ways in turn, so a machine whose load changes slows
each way alike. The measured speed-ups, the cost model fitted on the runs' own token records
(`controlplane.stats.cost_model`) and the net saving after checks and shadow tokens go into
the demo's summary, whatever their sign. The answer check serves the same prompts as shadow
requests and says how many whole answers the version leaves identical to full depth.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import click


def held_out_chat(corpus, trained_prompts: int) -> list[str]:
    """The chat prompts the demo serves: held-out prompts, none of those the exit heads'
    training answered (`trained_prompts`: the heads' `generation_prompts`)."""
    trained = {_normalised(p) for p in corpus.TRAIN_PROMPTS[:trained_prompts]}
    return [p for p in corpus.HELD_OUT_PROMPTS if _normalised(p) not in trained]


def _normalised(text: str) -> str:
    return " ".join("".join(c for c in text.lower() if c.isalnum() or c.isspace()).split())


@dataclass
class SpeedCheck:
    """What the check measured (`runtime.benchmark.savings`' figures) and on what."""

    prompts: int
    new_tokens: int
    batch: int
    version: int
    shadow_rate: float
    figures: dict
    load: float = 0.0  # the highest 1-minute load average seen during the check
    cpus: int = 1

    def lines(self, ui_url: str) -> list[str]:
        """The summary's lines: speed-ups, cost model, net saving, where the panel is."""
        f = self.figures
        lines = [f"Speed against full depth ({self.prompts} held-out chat prompts x "
                 f"{self.new_tokens} tokens, batch {self.batch}, v{self.version}, same prompts "
                 "each way)",
                 f"  measured speed-up: early exit {f['measured_speedup']:.2f}x; with "
                 f"{self.shadow_rate:.0%} shadow tokens {f['watched_speedup']:.2f}x"]
        model = f.get("cost_model")
        net = f["measured_net_saving"]
        if model is None:
            lines.append("  cost model: not identified on these tokens")
        else:
            net = f["model_net_saving"]
            lines.append(f"  cost model ({model['tokens']} timed tokens): "
                         f"{model['overhead_us'] / 1e3:.2f} ms + {model['layer_us'] / 1e3:.2f} ms"
                         f" per layer + {model['check_us'] / 1e3:.3f} ms per exit check; full "
                         f"depth {model['full_depth_us'] / 1e3:.1f} ms a token")
        verdict = ("early exit pays on this machine" if net > 0
                   else "early exit does not pay on this machine")
        lines.append(f"  net saving after checks and shadow tokens: {net:+.1%} (measured "
                     f"{f['measured_net_saving']:+.1%}): {verdict}")
        if self.load > self.cpus:
            lines.append(f"  load average {self.load:.1f} on {self.cpus} CPUs during the check: "
                         "other work skews these timings; rerun on a quiet machine")
        lines.append(f"  savings panel: {ui_url} (the API: GET /v1/deployments/demo/savings)")
        return lines


def speed_check(model, heads, tokenizer, corpus, prompts: list[str], *, version: int,
                thresholds: dict[int, float], shadow_rate: float, new_tokens: int,
                batch: int = 1) -> SpeedCheck:
    """Run each of `prompts` at full depth, with `thresholds`, and with them plus
    `shadow_rate` shadow tokens, in turn (`batch` > 1: that many prompts at a time)."""
    from controlplane.stats.cost_model import fit_cost_model
    from exitplane.wire import Signal
    from runtime.benchmark import Tally, run_engine, savings
    from runtime.engine import ExitPolicy

    ids = [corpus.chat_prompt_ids(tokenizer, p) for p in prompts]
    layers = list(heads.exit_layers)
    early = ExitPolicy(version=version, signal=Signal.learned,
                       thresholds={k: thresholds.get(k, 1.0) for k in layers})
    configs = {"full": {"policy": ExitPolicy.never_exit(layers, Signal.learned)},
               "early": {"policy": early},
               "watched": {"policy": early, "shadow_rate": shadow_rate}}
    tallies = {name: Tally() for name in configs}
    load = os.getloadavg()[0]
    for start in range(0, len(ids), batch):
        for name, options in configs.items():
            tallies[name].add(*run_engine(model, heads, ids[start:start + batch], new_tokens,
                                          batch=batch, seed=start, **options))
            load = max(load, os.getloadavg()[0])
    figures = savings(tallies["full"], tallies["early"], tallies["watched"], fit_cost_model,
                      model.config.num_hidden_layers)
    return SpeedCheck(prompts=len(ids), new_tokens=new_tokens, batch=batch, version=version,
                      shadow_rate=shadow_rate, figures=figures, load=load,
                      cpus=min(os.cpu_count() or 1, torch_threads()))


@dataclass
class AnswerCheck:
    """Whole answers under a version against full depth (`answer_check`)."""

    prompts: int
    new_tokens: int
    version: int
    divergence: list[int]  # per prompt: the first position that differs, -1 when none

    @property
    def identical(self) -> int:
        return sum(1 for position in self.divergence if position < 0)

    def lines(self) -> list[str]:
        differing = sorted(position for position in self.divergence if position >= 0)
        where = (f"; the differing ones first differ at token {differing[len(differing) // 2]} "
                 "(median)") if differing else ""
        return [f"Answers against full depth ({self.prompts} held-out chat prompts served as "
                f"shadow requests, {self.new_tokens} tokens each, v{self.version})",
                f"  identical to the full model's answer: {self.identical} of {self.prompts}"
                f"{where} (the exact answer loss: docs/concepts/statistics.md, \"The answer "
                "guarantee\")"]


def answer_check(model, heads, tokenizer, corpus, prompts: list[str], *, version: int,
                 thresholds: dict[int, float], new_tokens: int) -> AnswerCheck:
    """Serve each of `prompts` as a shadow request (full depth, every exit layer's signal and
    match recorded, greedy) and compute, exactly, whether `thresholds` would have changed its
    answer and where (`controlplane.stats.answers`): what the control plane certifies with an
    answer target, on the demo's own prompts. Nothing is shipped."""
    import numpy as np

    from controlplane.stats.answers import first_divergence, request_evidence
    from runtime.engine import Engine, EngineConfig

    layers = sorted(heads.exit_layers)
    engine = Engine(model, heads=heads, config=EngineConfig(
        max_batch=1, max_seq_len=1024, shadow_request_rate=1.0, seed=0))
    engine.generate([corpus.chat_prompt_ids(tokenizer, p) for p in prompts],
                    max_new_tokens=new_tokens, stop_token_ids=[])
    requests: dict[str, list] = {}
    for record in engine.drain_records():
        requests.setdefault(record.request_id, []).append(record)
    chosen = np.array([[thresholds.get(layer, 1.0) for layer in layers]])
    divergence = [int(first_divergence(*request_evidence(records, layers), chosen)[0])
                  for records in requests.values()]
    return AnswerCheck(prompts=len(divergence), new_tokens=new_tokens, version=version,
                       divergence=divergence)


def torch_threads() -> int:
    """The CPU threads the runtime's decoding uses."""
    import torch

    return torch.get_num_threads()


def echo_speed(check: SpeedCheck | None, ui_url: str,
               answers: AnswerCheck | None = None) -> None:
    """Print the checks' lines (or why there are none)."""
    click.echo("")
    if check is None:
        click.echo("Speed against full depth: not measured (the story stopped before it)")
        return
    for line in check.lines(ui_url):
        click.echo(line)
    for line in answers.lines() if answers is not None else ():
        click.echo(line)
