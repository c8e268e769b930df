"""Exit signals: how confident an exit point is, always as a value in [0, 1].

`learned` reads a tiny confidence head off the hidden state and touches the vocabulary only
once a token actually exits. The others need the exit's full-vocabulary logits at every check,
which on CPU costs as much as several decoder layers (measured in bench/runtime.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from exitplane.wire import Signal
from runtime.heads import ExitHeads
from runtime.model import DecoderParts

LOGIT_SIGNALS = frozenset({Signal.maxprob, Signal.margin, Signal.entropy, Signal.saturation})


@dataclass
class ExitReadout:
    """Maps an exit layer's hidden state to logits (adapter or logit lens) and confidence."""

    parts: DecoderParts
    heads: ExitHeads | None = None

    def head_input(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """(B, hidden) what the shared LM head projects: exit adapter output, or the model's
        own final norm for the last layer and for head-less exits (logit lens)."""
        if layer >= self.parts.num_layers or self.heads is None:
            return self.parts.norm(hidden)
        return self.heads.adapters[str(layer)](hidden)

    def logits(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """(B, V) vocabulary logits of exit `layer`."""
        return self.parts.lm_head(self.head_input(layer, hidden))

    def confidence(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        if self.heads is None:
            raise ValueError("the learned signal needs exit heads: pass --heads FILE "
                             "(train them with `exitplane runtime train-heads`) or choose "
                             "maxprob, margin, entropy or saturation")
        return self.heads.match_probability(layer, hidden)


def maxprob(logits: torch.Tensor) -> torch.Tensor:
    """Probability of the top-1 token, (B,)."""
    top = logits.max(dim=-1).values
    return torch.exp(top - torch.logsumexp(logits, dim=-1))


def margin(logits: torch.Tensor) -> torch.Tensor:
    """p1 - p2 of the two most likely tokens, (B,)."""
    top2 = logits.topk(2, dim=-1).values
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    probs = torch.exp(top2 - lse)
    return probs[:, 0] - probs[:, 1]


def entropy_confidence(logits: torch.Tensor) -> torch.Tensor:
    """1 - H / ln V: 1 for a one-hot distribution, 0 for a uniform one, (B,)."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    entropy = -(logp.exp() * logp).sum(dim=-1)
    return (1.0 - entropy / math.log(logits.shape[-1])).clamp(0.0, 1.0)


def saturation(top1: torch.Tensor, prev_top1: torch.Tensor,
               run: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """run / (run + 1), where run counts consecutive earlier exits agreeing with this top-1.

    Returns (signal, new_run). Never reaches 1.0, so a threshold of 1.0 still never exits.
    """
    new_run = torch.where(top1 == prev_top1, run + 1, torch.zeros_like(run))
    return new_run / (new_run + 1.0), new_run


def from_logits(signal: Signal, logits: torch.Tensor) -> torch.Tensor:
    """maxprob / margin / entropy from logits (saturation needs state: see `saturation`)."""
    if signal == Signal.maxprob:
        return maxprob(logits)
    if signal == Signal.margin:
        return margin(logits)
    if signal == Signal.entropy:
        return entropy_confidence(logits)
    raise ValueError(f"signal {signal} is not a function of one exit's logits")


class SignalState:
    """Per-step signal state for the active rows (saturation's previous top-1 and run)."""

    def __init__(self, batch: int, device: torch.device):
        self.prev_top1 = torch.full((batch,), -1, dtype=torch.long, device=device)
        self.run = torch.zeros(batch, device=device)

    def keep(self, index: torch.Tensor) -> None:
        """Compaction: keep only the rows at `index`."""
        self.prev_top1 = self.prev_top1[index]
        self.run = self.run[index]


def check(signal: Signal, readout: ExitReadout, layer: int, hidden: torch.Tensor,
          state: SignalState) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """One exit check: (signal (B,), top1 (B,) or None, logits or None) without host syncs."""
    if signal == Signal.learned:
        return readout.confidence(layer, hidden).float(), None, None
    logits = readout.logits(layer, hidden).float()  # bf16 softmax statistics are too coarse
    top1 = logits.argmax(dim=-1)
    if signal == Signal.saturation:
        value, state.run = saturation(top1, state.prev_top1, state.run)
        state.prev_top1 = top1
        return value, top1, logits
    return from_logits(signal, logits).float(), top1, logits
