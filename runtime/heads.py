"""Exit heads: per-exit adapters feeding the model's tied LM head, and learned confidence heads.

An artifact is one safetensors file (tensors + string metadata in its header) and a sidecar
`<file>.sha256` in `sha256sum` format; loading refuses a file whose digest does not match.
Joint-mode artifacts also carry low-rank (LoRA) deltas for the decoder layers, merged into the
served model by `merge_lora`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

FORMAT = "exitplane-heads/1"
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama RMSNorm (computed in fp32, like the HF module)."""
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


class ExitAdapter(nn.Module):
    """norm(h + W h): a residual linear map (zero-initialised) and its own RMSNorm weight."""

    def __init__(self, hidden_size: int, eps: float, norm_weight: torch.Tensor | None = None):
        super().__init__()
        self.eps = eps
        self.proj = nn.Linear(hidden_size, hidden_size, bias=False)
        nn.init.zeros_(self.proj.weight)
        init = norm_weight.detach().clone().float() if norm_weight is not None else None
        self.norm_weight = nn.Parameter(init if init is not None else torch.ones(hidden_size))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return rms_norm(hidden + self.proj(hidden), self.norm_weight, self.eps)


class ConfidenceHead(nn.Module):
    """Predicts P(this exit's top-1 == the final layer's top-1) from the hidden state."""

    def __init__(self, hidden_size: int, eps: float, width: int = 64):
        super().__init__()
        self.eps = eps
        self.norm_weight = nn.Parameter(torch.ones(hidden_size))
        self.fc1 = nn.Linear(hidden_size, width)
        self.fc2 = nn.Linear(width, 1)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logit of the match probability, shape (...,)."""
        z = rms_norm(hidden, self.norm_weight, self.eps)
        return self.fc2(torch.nn.functional.gelu(self.fc1(z))).squeeze(-1)


class ExitHeads(nn.Module):
    """The adapters and confidence heads of every exit layer, plus optional LoRA deltas."""

    def __init__(self, *, exit_layers: list[int], hidden_size: int, eps: float,
                 norm_weight: torch.Tensor | None = None, metadata: dict[str, Any] | None = None,
                 confidence_width: int = 64):
        super().__init__()
        self.exit_layers = sorted(exit_layers)
        self.hidden_size = hidden_size
        self.eps = eps
        self.confidence_width = confidence_width
        self.adapters = nn.ModuleDict(
            {str(k): ExitAdapter(hidden_size, eps, norm_weight) for k in self.exit_layers})
        self.confidence = nn.ModuleDict(
            {str(k): ConfidenceHead(hidden_size, eps, confidence_width)
             for k in self.exit_layers})
        self.lora: dict[str, torch.Tensor] = {}
        self.metadata: dict[str, Any] = dict(metadata or {})
        self.digest: str | None = None

    def exit_logits(self, layer: int, hidden: torch.Tensor, lm_head: nn.Linear) -> torch.Tensor:
        """Vocabulary logits of exit `layer` through the shared LM head."""
        return lm_head(self.adapters[str(layer)](hidden))

    def match_probability(self, layer: int, hidden: torch.Tensor) -> torch.Tensor:
        """The learned confidence in [0, 1] at exit `layer`, shape (B,)."""
        return torch.sigmoid(self.confidence[str(layer)](hidden))

    def state_tensors(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        tensors = {name: t.detach().to(dtype).contiguous().cpu()
                   for name, t in self.state_dict().items()}
        tensors.update({f"lora.{name}": t.to(dtype).contiguous().cpu()
                        for name, t in self.lora.items()})
        return tensors

    def save(self, path: str | Path, *, dtype: torch.dtype = torch.float32) -> str:
        """Write the safetensors file and its `.sha256` sidecar; return the digest. The tensors
        are stored as `dtype` (float16 halves the file) and loaded back as float32."""
        from safetensors.torch import save_file

        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        header = {"format": FORMAT, "exit_layers": json.dumps(self.exit_layers),
                  "hidden_size": str(self.hidden_size), "eps": repr(self.eps),
                  "confidence_width": str(self.confidence_width),
                  "metadata": json.dumps(self.metadata, sort_keys=True)}
        save_file(self.state_tensors(dtype), str(path), metadata=header)
        digest = file_sha256(path)
        path.with_name(path.name + ".sha256").write_text(f"{digest}  {path.name}\n")
        self.digest = digest
        return digest

    @classmethod
    def load(cls, path: str | Path, *, expected_digest: str | None = None,
             device: str | torch.device = "cpu") -> ExitHeads:
        """Load an artifact, verifying its sha256 against `expected_digest` or the sidecar."""
        from safetensors import safe_open

        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"exit heads {path} not found; train them with "
                                    "`exitplane runtime train-heads`")
        digest = file_sha256(path)
        sidecar = path.with_name(path.name + ".sha256")
        if expected_digest is None and sidecar.exists():
            expected_digest = sidecar.read_text().split()[0]
        if expected_digest is not None and digest != expected_digest:
            raise ValueError(f"exit heads {path} have sha256 {digest}, expected "
                             f"{expected_digest}: the file is corrupt or was replaced")
        with safe_open(str(path), framework="pt") as handle:
            header = handle.metadata() or {}
            if header.get("format") != FORMAT:
                raise ValueError(f"{path} is not an exitplane heads artifact ({FORMAT})")
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
        heads = cls(exit_layers=json.loads(header["exit_layers"]),
                    hidden_size=int(header["hidden_size"]), eps=float(header["eps"]),
                    metadata=json.loads(header["metadata"]),
                    confidence_width=int(header["confidence_width"]))
        heads.lora = {name[len("lora."):]: t for name, t in tensors.items()
                      if name.startswith("lora.")}
        heads.load_state_dict({n: t for n, t in tensors.items() if not n.startswith("lora.")})
        heads.digest = digest
        return heads.to(device).eval().requires_grad_(False)


def file_sha256(path: str | Path) -> str:
    """sha256 hex digest of a file's bytes."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_metadata(path: str | Path) -> dict[str, Any]:
    """The training metadata of an artifact without loading its tensors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as handle:
        header = handle.metadata() or {}
    meta = json.loads(header.get("metadata", "{}"))
    meta["exit_layers"] = json.loads(header.get("exit_layers", "[]"))
    return meta


@torch.no_grad()
def merge_lora(model: nn.Module, lora: dict[str, torch.Tensor], scale: float) -> int:
    """Add scale * B @ A to each targeted decoder weight (`{layer}.{proj}.A/B`); return count.

    Merging once at load time keeps the served model's forward free of adapter work.
    """
    layers = model.model.layers
    merged = 0
    for name, a in lora.items():
        if not name.endswith(".A"):
            continue
        layer_idx, proj = name[:-2].split(".")
        b = lora[f"{layer_idx}.{proj}.B"]
        block = layers[int(layer_idx)]
        linear = getattr(block.self_attn if proj in LORA_TARGETS[:4] else block.mlp, proj)
        linear.weight += (scale * (b.float() @ a.float())).to(linear.weight)
        merged += 1
    return merged
