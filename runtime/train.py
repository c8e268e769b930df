"""train-heads: fit exit adapters and learned confidence heads, post-hoc or jointly with LoRA.

post-hoc: the model is frozen. One teacher pass caches exit-layer hidden states and the final
layer's top-k distribution; adapters are distilled against it (soft cross-entropy over the
union of the batch's teacher top-k plus random negatives, so no step pays for the full
vocabulary), then confidence heads learn "exit top-1 == final top-1" from full-vocab labels.

joint: low-rank adapters on every decoder projection train with the exit adapters: loss =
final layer vs the original model + mean of exit losses (LayerSkip / EE-LLM). The served model
is the merged one, and labels and held-out agreement are taken against its own full depth.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from tqdm import tqdm

from runtime import corpus
from runtime.engine import Engine, EngineConfig, default_exit_layers
from runtime.heads import LORA_TARGETS, ExitHeads, merge_lora
from runtime.model import decoder_parts

TOP_K = 32


@dataclass
class TrainConfig:
    mode: str = "post-hoc"
    exit_layers: list[int] | None = None
    seq_len: int = 128
    stdlib_chars: int = 120_000
    generation_prompts: int = len(corpus.TRAIN_PROMPTS)
    generation_tokens: int = 96
    heldout_fraction: float = 0.1
    adapter_steps: int = 400
    joint_steps: int = 40
    batch_tokens: int = 512
    joint_batch_seqs: int = 4
    negatives: int = 2048
    lr: float = 2e-3
    lora_rank: int = 8
    lora_alpha: float = 16.0
    lora_lr: float = 5e-4
    label_tokens: int = 12_000
    confidence_epochs: int = 30
    time_budget_s: float = 900.0
    seed: int = 0
    model_name: str = "model"
    data: dict = field(default_factory=dict)


class LoRALinear(nn.Module):
    """y = W x + scale * B A x, with W frozen and B zero-initialised."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float):
        super().__init__()
        self.base = base
        self.scale = alpha / rank
        fan_in = base.in_features
        self.lora_a = nn.Parameter(torch.randn(rank, fan_in) / math.sqrt(fan_in))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.scale * F.linear(F.linear(x, self.lora_a), self.lora_b)


def build_corpus(model, tokenizer, config: TrainConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids (N, seq_len), valid (N, seq_len)) from model generations and stdlib text."""
    engine = Engine(model, config=EngineConfig(max_batch=8, max_seq_len=512))
    prompts = corpus.TRAIN_PROMPTS[: config.generation_prompts]
    generated = corpus.generations(engine, tokenizer, prompts,
                                   max_new_tokens=config.generation_tokens,
                                   model_name=config.model_name)
    texts = list(corpus.stdlib_texts(config.stdlib_chars))
    chunks = corpus.token_chunks(tokenizer, texts, config.seq_len)
    sequences = [s[: config.seq_len] for s in generated] + chunks
    ids = torch.zeros(len(sequences), config.seq_len, dtype=torch.long)
    valid = torch.zeros(len(sequences), config.seq_len, dtype=torch.bool)
    for row, seq in enumerate(sequences):
        ids[row, : len(seq)] = torch.tensor(seq)
        valid[row, : len(seq)] = True
    config.data = {"generations": len(generated), "generation_tokens": sum(map(len, generated)),
                   "stdlib_chunks": len(chunks), "tokens": int(valid.sum()),
                   "seq_len": config.seq_len, "sources": "model generations + python stdlib"}
    return ids, valid


@torch.no_grad()
def teacher_pass(model, ids: torch.Tensor, valid: torch.Tensor, exit_layers: list[int],
                 *, keep_hidden: bool, batch: int = 8, desc: str = "teacher") -> dict:
    """Run the model once: exit hidden states (bf16), final top-k ids/logprobs and top-1."""
    hidden, top_ids, top_logp, top1 = [], [], [], []
    for start in tqdm(range(0, len(ids), batch), desc=desc, unit="batch"):
        x, m = ids[start:start + batch], valid[start:start + batch]
        out = model(input_ids=x, attention_mask=m.long(), output_hidden_states=keep_hidden)
        logp = torch.log_softmax(out.logits.float(), dim=-1)[m]  # (n, V)
        values, indices = logp.topk(TOP_K, dim=-1)
        top_ids.append(indices)
        top_logp.append(values)
        top1.append(indices[:, 0])
        if keep_hidden:
            hidden.append(torch.stack([out.hidden_states[k][m] for k in exit_layers])
                          .to(torch.bfloat16))  # (E, n, hidden)
    result = {"top_ids": torch.cat(top_ids), "top_logp": torch.cat(top_logp),
              "top1": torch.cat(top1)}
    if keep_hidden:
        result["hidden"] = torch.cat(hidden, dim=1)
    return result


def distill_loss(z: torch.Tensor, embedding: torch.Tensor, top_ids: torch.Tensor,
                 top_logp: torch.Tensor, negatives: int) -> torch.Tensor:
    """Soft cross-entropy to the teacher's top-k over (batch top-k ids + random negatives)."""
    vocab = embedding.shape[0]
    extra = torch.randint(0, vocab, (negatives,), device=z.device)
    subset, inverse = torch.unique(torch.cat([top_ids.reshape(-1), extra]), return_inverse=True)
    logits = z @ embedding[subset].T  # (n, |subset|)
    target_cols = inverse[: top_ids.numel()].view_as(top_ids)  # (n, k)
    teacher = torch.softmax(top_logp, dim=-1)  # renormalised over the teacher's top-k
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -(teacher * logp.gather(1, target_cols)).sum(-1).mean()


def full_top1(z: torch.Tensor, lm_head: nn.Linear, chunk: int = 2048) -> torch.Tensor:
    """Full-vocabulary argmax, chunked to bound memory."""
    return torch.cat([lm_head(z[i:i + chunk]).argmax(-1) for i in range(0, len(z), chunk)])


def train_adapters(heads: ExitHeads, hidden: torch.Tensor, teacher: dict, embedding,
                   config: TrainConfig, deadline: float) -> int:
    """Post-hoc distillation of every exit adapter on cached hidden states; returns steps."""
    params = [p for name, p in heads.named_parameters() if name.startswith("adapters")]
    optim = torch.optim.AdamW(params, lr=config.lr, weight_decay=0.0)
    n = hidden.shape[1]
    steps = 0
    for _ in tqdm(range(config.adapter_steps), desc="adapters", unit="step"):
        if time.monotonic() > deadline:
            break
        idx = torch.randint(0, n, (config.batch_tokens,))
        loss = sum(distill_loss(heads.adapters[str(k)](hidden[e, idx].float()), embedding,
                                teacher["top_ids"][idx], teacher["top_logp"][idx],
                                config.negatives)
                   for e, k in enumerate(heads.exit_layers))
        optim.zero_grad()
        loss.backward()
        optim.step()
        steps += 1
    return steps


def train_confidence(heads: ExitHeads, hidden: torch.Tensor, labels: torch.Tensor,
                     config: TrainConfig) -> None:
    """Fit each exit's confidence head to its match labels with BCE."""
    for e, k in enumerate(heads.exit_layers):
        head = heads.confidence[str(k)]
        optim = torch.optim.AdamW(head.parameters(), lr=3e-3, weight_decay=1e-4)
        x, y = hidden[e].float(), labels[e].float()
        for _ in range(config.confidence_epochs):
            perm = torch.randperm(len(x))
            for start in range(0, len(x), 1024):
                batch = perm[start:start + 1024]
                loss = F.binary_cross_entropy_with_logits(head(x[batch]), y[batch])
                optim.zero_grad()
                loss.backward()
                optim.step()


@torch.no_grad()
def exit_labels(heads: ExitHeads, hidden: torch.Tensor, final_top1: torch.Tensor,
                lm_head: nn.Linear) -> torch.Tensor:
    """(E, n) bool: does exit k's top-1 equal the final top-1?"""
    return torch.stack([full_top1(heads.adapters[str(k)](hidden[e].float()), lm_head)
                        == final_top1 for e, k in enumerate(heads.exit_layers)])


@torch.no_grad()
def heldout_report(heads: ExitHeads, hidden: torch.Tensor, final_top1: torch.Tensor,
                   lm_head: nn.Linear) -> dict:
    """Per exit layer: top-1 agreement, and coverage of the learned head at 99% precision."""
    labels = exit_labels(heads, hidden, final_top1, lm_head)
    report = {}
    for e, k in enumerate(heads.exit_layers):
        conf = heads.match_probability(k, hidden[e].float())
        order = conf.argsort(descending=True)
        hits = labels[e][order].float().cumsum(0) / torch.arange(1, len(order) + 1)
        ok = (hits >= 0.99).nonzero()
        coverage = float(ok.max() + 1) / len(order) if len(ok) else 0.0
        report[str(k)] = {"agreement": round(float(labels[e].float().mean()), 4),
                          "coverage_at_99": round(coverage, 4)}
    return report


def split(ids, valid, fraction, seed):
    order = list(range(len(ids)))
    random.Random(seed).shuffle(order)
    cut = max(1, int(len(order) * fraction))
    held, train = torch.tensor(order[:cut]), torch.tensor(order[cut:])
    return (ids[train], valid[train]), (ids[held], valid[held])


def attach_lora(model, rank: int, alpha: float) -> list[tuple[str, LoRALinear]]:
    wrapped = []
    for i, block in enumerate(model.model.layers):
        for name in LORA_TARGETS:
            owner = block.self_attn if name in LORA_TARGETS[:4] else block.mlp
            module = LoRALinear(getattr(owner, name), rank, alpha)
            setattr(owner, name, module)
            wrapped.append((f"{i}.{name}", module))
    return wrapped


def detach_lora(model) -> None:
    for block in model.model.layers:
        for name in LORA_TARGETS:
            owner = block.self_attn if name in LORA_TARGETS[:4] else block.mlp
            module = getattr(owner, name)
            if isinstance(module, LoRALinear):
                setattr(owner, name, module.base)


def train_joint(model, heads: ExitHeads, ids, valid, teacher: dict, config: TrainConfig,
                deadline: float) -> tuple[dict[str, torch.Tensor], int]:
    """LoRA + adapters with early-exit losses and final-layer KL to the original model."""
    wrapped = attach_lora(model, config.lora_rank, config.lora_alpha)
    lora_params = [p for _, m in wrapped for p in (m.lora_a, m.lora_b)]
    adapter_params = [p for n, p in heads.named_parameters() if n.startswith("adapters")]
    optim = torch.optim.AdamW([{"params": lora_params, "lr": config.lora_lr},
                               {"params": adapter_params, "lr": config.lr}], weight_decay=0.0)
    embedding = model.lm_head.weight
    offsets = torch.cumsum(valid.sum(1), 0) - valid.sum(1)  # row -> first teacher index
    model.train()
    steps = 0
    order = torch.randperm(len(ids))
    for _ in tqdm(range(config.joint_steps), desc="joint", unit="step"):
        if time.monotonic() > deadline:
            break
        start = (steps * config.joint_batch_seqs) % len(ids)
        rows = order[start:start + config.joint_batch_seqs]
        x, m = ids[rows], valid[rows]
        out = model.model(input_ids=x, attention_mask=m.long(), output_hidden_states=True)
        tidx = torch.cat([offsets[r] + torch.arange(int(valid[r].sum())) for r in rows])
        top_ids, top_logp = teacher["top_ids"][tidx], teacher["top_logp"][tidx]
        final = out.last_hidden_state[m]  # the HF model returns it after the final norm
        loss = distill_loss(final, embedding, top_ids, top_logp, config.negatives)
        exit_losses = [distill_loss(heads.adapters[str(k)](out.hidden_states[k][m]), embedding,
                                    top_ids, top_logp, config.negatives)
                       for k in heads.exit_layers]
        loss = loss + sum(exit_losses) / len(exit_losses)
        optim.zero_grad()
        loss.backward()
        optim.step()
        steps += 1
    model.eval()
    lora = {}
    for name, module in wrapped:
        lora[f"{name}.A"] = module.lora_a.detach().clone()
        lora[f"{name}.B"] = module.lora_b.detach().clone()
    detach_lora(model)
    return lora, steps


def phase_deadline(started: float, now: float, budget_s: float, share: float) -> float:
    """When the training phase must stop: at `share` of the budget, leaving the rest for
    labels, confidence heads and the held-out report -- but never less than 40% of the budget
    from now, so slow text generation or a slow teacher pass cannot starve it of steps."""
    return max(started + share * budget_s, now + 0.4 * budget_s)


def train_heads(model, tokenizer, config: TrainConfig) -> ExitHeads:
    """Train exit heads for `model` per `config`; the model is left as it was given."""
    torch.manual_seed(config.seed)
    started = time.monotonic()
    parts = decoder_parts(model)
    exit_layers = config.exit_layers or default_exit_layers(parts.num_layers)
    ids, valid = build_corpus(model, tokenizer, config)
    (train_ids, train_valid), (held_ids, held_valid) = split(ids, valid, config.heldout_fraction,
                                                             config.seed)
    heads = ExitHeads(exit_layers=exit_layers, hidden_size=parts.hidden_size,
                      eps=float(parts.norm.variance_epsilon), norm_weight=parts.norm.weight)
    embedding = parts.lm_head.weight.detach()
    post_hoc = config.mode == "post-hoc"
    if not post_hoc:  # joint steps see at most this many sequences: label only those
        used = min(len(train_ids), config.joint_steps * config.joint_batch_seqs)
        train_ids, train_valid = train_ids[:used], train_valid[:used]
    teacher = teacher_pass(model, train_ids, train_valid, exit_layers, keep_hidden=post_hoc)
    steps = 0
    if post_hoc:
        deadline = phase_deadline(started, time.monotonic(), config.time_budget_s, 0.75)
        steps = train_adapters(heads, teacher["hidden"], teacher, embedding, config, deadline)
        hidden, final_top1 = teacher["hidden"], teacher["top1"]
    elif config.mode == "joint":
        deadline = phase_deadline(started, time.monotonic(), config.time_budget_s, 0.7)
        lora, steps = train_joint(model, heads, train_ids, train_valid, teacher, config,
                                  deadline)
        heads.lora = lora
    else:
        raise ValueError(f"mode must be 'post-hoc' or 'joint', not {config.mode!r}")
    scale = config.lora_alpha / config.lora_rank
    with _merged(model, heads.lora, scale):
        if not post_hoc:  # labels against the adapted model's own full depth
            n_rows = max(1, config.label_tokens // config.seq_len)
            own = teacher_pass(model, train_ids[:n_rows], train_valid[:n_rows], exit_layers,
                               keep_hidden=True, desc="labels")
            hidden, final_top1 = own["hidden"], own["top1"]
        n = min(config.label_tokens, hidden.shape[1])
        pick = torch.randperm(hidden.shape[1])[:n]
        labels = exit_labels(heads, hidden[:, pick], final_top1[pick], parts.lm_head)
        train_confidence(heads, hidden[:, pick], labels, config)
        held = teacher_pass(model, held_ids, held_valid, exit_layers, keep_hidden=True,
                            desc="held-out")
        report = heldout_report(heads, held["hidden"], held["top1"], parts.lm_head)
    heads.metadata = {"model": config.model_name, "mode": config.mode,
                      "exit_layers": exit_layers, "num_layers": parts.num_layers,
                      "data": config.data, "heldout": report, "train_steps": steps,
                      "lora_rank": config.lora_rank if heads.lora else 0, "lora_scale": scale,
                      "train_seconds": round(time.monotonic() - started, 1),
                      "config": {k: v for k, v in asdict(config).items() if k != "data"}}
    return heads.eval().requires_grad_(False)


class _merged:
    """Temporarily merge LoRA deltas into the model (no-op without any)."""

    def __init__(self, model, lora: dict[str, torch.Tensor], scale: float):
        self.model, self.lora, self.scale = model, lora, scale

    def __enter__(self):
        if self.lora:
            merge_lora(self.model, self.lora, self.scale)

    def __exit__(self, *exc):
        if self.lora:
            merge_lora(self.model, self.lora, -self.scale)
