"""The LLaMA-style decoder and its pipeline-stage views.

One model definition (RMSNorm, rotary position embedding in the Hugging Face Llama
"rotate_half" form, SwiGLU feed-forward, untied LM head, no biases, causal
`F.scaled_dot_product_attention`). A pipeline stage is a *view* of the same definition that
owns a contiguous range of layers; stage 0 also owns the token embedding, the last stage the
final norm and the LM head (arXiv 2601.02360, §3: the model is split into S stages).

Token embedding: TE = T_S + T⊥ (paper §3.2). `Embedding.weight` is the trainable part T_S
(or the whole TE when subspace compression is off); the optional buffer `perp` holds T⊥, and
the embedding output is `weight[x] + perp[x]`.

Invariants:
- Parameter names are global (`layers.{i}....` with the global layer index), so a stage's
  state dict is a subset of the whole model's state dict, key for key.
- Every parameter is initialised from (seed, parameter name) only, by integer arithmetic
  (`peer.core.sparseloco.portable.canonical_normal`), so a stage view initialises exactly the values the
  whole model would, on any machine: chaining the stages of a split gives the whole model's
  logits and gradients bit for bit, and every holder of a stage starts from the same bytes.
- Math only: this module imports neither grpc, hivemind, asyncio nor the transport/DHT code.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import math
from dataclasses import dataclass, fields
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from peer.core.sparseloco.portable import canonical_normal
from peer.errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "ModelConfig",
    "PRESETS",
    "get_preset",
    "split_layers",
    "stage_layers",
    "RMSNorm",
    "Embedding",
    "Attention",
    "FeedForward",
    "Block",
    "Decoder",
    "build_stage",
    "build_model",
    "param_seed",
]


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


STAGE_SPLITS = ("even", "cost")  # ModelConfig.stage_split: see `stage_layers`


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the decoder. `n_heads * head_dim` may differ from `d_model` (the 1B preset)."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    head_dim: int
    ffn_hidden: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    init_std: float = 0.02
    stage_split: str = "even"  # layers per stage: "even" counts, or "cost" (the head's matmul counted)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "head_dim", "ffn_hidden", "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"model field {name} must be a positive integer, got {value!r}")
        if self.stage_split not in STAGE_SPLITS:
            raise ConfigError(
                f"model field stage_split must be one of {', '.join(STAGE_SPLITS)}, got {self.stage_split!r}"
            )
        if self.head_dim % 2:
            raise ConfigError(f"model field head_dim must be even for rotary embeddings, got {self.head_dim}")
        for name in ("rope_theta", "norm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ConfigError(f"model field {name} must be a positive number, got {value!r}")

    @property
    def attn_dim(self) -> int:
        """Inner width of attention, n_heads * head_dim."""
        return self.n_heads * self.head_dim

    @property
    def params_per_layer(self) -> int:
        d, a, f = self.d_model, self.attn_dim, self.ffn_hidden
        return 2 * d + 4 * d * a + 3 * d * f  # two norms, wq/wk/wv/wo, w1/w2/w3

    @property
    def n_params(self) -> int:
        """Parameter count of the whole model (embedding, layers, final norm, head)."""
        d, v = self.d_model, self.vocab_size
        return v * d + self.n_layers * self.params_per_layer + d + v * d

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        """Inverse of `to_dict`; unknown or missing fields raise ConfigError naming them."""
        if not isinstance(data, dict):
            raise ConfigError(f"model config must be a mapping, got {type(data).__name__}")
        valid = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if unknown:
            raise ConfigError(f"unknown model field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}")
        required = [f.name for f in fields(cls) if f.default is dataclasses.MISSING]
        missing = [n for n in required if n not in data]
        if missing:
            raise ConfigError(f"model config is missing field(s) {', '.join(missing)}")
        return cls(**data)


PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(
        vocab_size=1024, d_model=64, n_layers=4, n_heads=4, head_dim=16, ffn_hidden=176, max_seq_len=128
    ),
    "small": ModelConfig(
        vocab_size=4096, d_model=256, n_layers=8, n_heads=4, head_dim=64, ffn_hidden=688, max_seq_len=256
    ),
    # arXiv 2601.02360, Tables 6 and 9: the shapes, and the paper's context of 2048 tokens (a run's
    # train.seq_len may be anything up to it).
    "178M": ModelConfig(
        vocab_size=32000, d_model=1024, n_layers=9, n_heads=8, head_dim=128, ffn_hidden=2688, max_seq_len=2048
    ),
    "512M": ModelConfig(
        vocab_size=32000, d_model=1536, n_layers=12, n_heads=12, head_dim=128, ffn_hidden=3904, max_seq_len=2048
    ),
    "1B": ModelConfig(
        vocab_size=32000, d_model=2048, n_layers=16, n_heads=8, head_dim=128, ffn_hidden=8192, max_seq_len=2048
    ),
}


def get_preset(name: str, **overrides: Any) -> ModelConfig:
    """The preset `name` with `overrides` applied; ConfigError on an unknown preset or field."""
    if name not in PRESETS:
        raise ConfigError(f"unknown model preset {name!r}; choose one of: {', '.join(PRESETS)}")
    valid = [f.name for f in fields(ModelConfig)]
    unknown = sorted(set(overrides) - set(valid))
    if unknown:
        raise ConfigError(f"unknown model field(s) {', '.join(unknown)}; valid fields: {', '.join(valid)}")
    return dataclasses.replace(PRESETS[name], **overrides)


def split_layers(n_layers: int, n_stages: int) -> list[range]:
    """Split layers 0..n_layers-1 into n_stages contiguous ranges whose sizes differ by <= 1.

    The first `n_layers % n_stages` stages get the extra layer. ConfigError if a stage would
    be empty.
    """
    if n_stages < 1:
        raise ConfigError(f"number of stages must be >= 1, got {n_stages}")
    if n_stages > n_layers:
        raise ConfigError(
            f"cannot split {n_layers} layers into {n_stages} stages; use at most {n_layers} stages or a deeper model"
        )
    base, extra = divmod(n_layers, n_stages)
    ranges, start = [], 0
    for s in range(n_stages):
        size = base + (1 if s < extra else 0)
        ranges.append(range(start, start + size))
        start += size
    return ranges


def stage_layers(cfg: ModelConfig, n_stages: int) -> list[range]:
    """The layers of each stage under `cfg.stage_split`: "even" (`split_layers`) or "cost"
    (`split_layers_by_cost`)."""
    if cfg.stage_split == "cost":
        return split_layers_by_cost(cfg, n_stages)
    return split_layers(cfg.n_layers, n_stages)


def split_layers_by_cost(cfg: ModelConfig, n_stages: int) -> list[range]:
    """Contiguous ranges, each of >= 1 layer, that minimise the largest stage's compute: a layer
    costs its matrices (4·d·a + 3·d·f multiply-adds per token), the last stage also the head's
    V·d (the embedding is a lookup). The last stage then holds fewer layers: with the `small`
    preset's 8 layers at S = 2, 5 + 3 instead of 4 + 4. Ties go to the earliest cut."""
    split_layers(cfg.n_layers, n_stages)  # the same errors for impossible splits
    n = cfg.n_layers
    layer = 4 * cfg.d_model * cfg.attn_dim + 3 * cfg.d_model * cfg.ffn_hidden
    head = cfg.vocab_size * cfg.d_model
    inf = float("inf")
    # best[s][i]: the smallest largest cost of layers 0..i-1 in s stages; cut[s][i]: where stage s-1 starts
    best = [[inf] * (n + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for st in range(1, n_stages + 1):
        for i in range(st, n + 1):
            for j in range(st - 1, i):
                cost = (i - j) * layer + (head if st == n_stages and i == n else 0)
                value = max(best[st - 1][j], cost)
                if value < best[st][i]:
                    best[st][i], cut[st][i] = value, j
    ranges, end = [], n
    for st in range(n_stages, 0, -1):
        start = cut[st][end]
        ranges.append(range(start, end))
        end = start
    return ranges[::-1]


# --------------------------------------------------------------------------------------------
# Deterministic per-name initialisation
# --------------------------------------------------------------------------------------------


def param_seed(seed: int, name: str) -> int:
    """A 63-bit generator seed derived from (run seed, global parameter name) only."""
    digest = hashlib.sha256(f"{int(seed)}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _init_std(cfg: ModelConfig, name: str) -> float:
    # Residual output projections are scaled down with depth (GPT-2 style).
    if name.endswith(("attn.wo.weight", "ffn.w2.weight")):
        return cfg.init_std / math.sqrt(2 * cfg.n_layers)
    return cfg.init_std


@torch.no_grad()
def _init_parameters(module: nn.Module, cfg: ModelConfig, seed: int) -> None:
    """Norm gains 1; every other weight `canonical_normal` (integers only: the same bits on every
    machine, so every holder of a stage starts from one state, defined by bytes)."""
    for name, p in module.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
            continue
        p.copy_(canonical_normal(param_seed(seed, name), tuple(p.shape), _init_std(cfg, name)))


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """y = w * x / sqrt(mean(x^2) + eps), computed in float32 like HF Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class Embedding(nn.Module):
    """Token embedding TE = weight + perp, with `perp` (T⊥) an optional non-trainable buffer."""

    def __init__(self, vocab_size: int, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))  # (V, d)
        self.register_buffer("perp", None)  # (V, d) or None

    def enable_subspace(self, perp: Tensor) -> None:
        """Register (or replace) the T⊥ buffer; it is added to every looked-up row."""
        if tuple(perp.shape) != tuple(self.weight.shape):
            raise ValueError(f"perp must have shape {tuple(self.weight.shape)}, got {tuple(perp.shape)}")
        self.perp = perp.detach().to(device=self.weight.device, dtype=self.weight.dtype).clone()

    def full_weight(self) -> Tensor:
        """TE = weight + perp (a new tensor without grad), or a detached copy of weight."""
        w = self.weight.detach()
        return (w + self.perp) if self.perp is not None else w.clone()

    def forward(self, ids: Tensor) -> Tensor:
        out = F.embedding(ids, self.weight)  # (b, L, d)
        if self.perp is not None:
            out = out + F.embedding(ids, self.perp)
        return out


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_tables(head_dim: int, max_seq_len: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin tables of shape (max_seq_len, head_dim), float32, HF-Llama layout."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))  # (head_dim/2,)
    pos = torch.arange(max_seq_len, dtype=torch.float32)
    freqs = torch.outer(pos, inv_freq)  # (L, head_dim/2)
    emb = torch.cat((freqs, freqs), dim=-1)  # (L, head_dim)
    return emb.cos(), emb.sin()


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        d, a = cfg.d_model, cfg.attn_dim
        self.wq = nn.Linear(d, a, bias=False)
        self.wk = nn.Linear(d, a, bias=False)
        self.wv = nn.Linear(d, a, bias=False)
        self.wo = nn.Linear(a, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        b, L, _ = x.shape
        q = self.wq(x).view(b, L, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, L, hd)
        k = self.wk(x).view(b, L, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, L, hd)
        v = self.wv(x).view(b, L, self.n_heads, self.head_dim).transpose(1, 2)  # (b, h, L, hd)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # (L, hd)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, h, L, hd)
        y = y.transpose(1, 2).reshape(b, L, self.n_heads * self.head_dim)  # (b, L, h*hd)
        out: Tensor = self.wo(y)  # (b, L, d)
        return out


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x); w1 gate, w3 up, w2 down."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)
        self.w2 = nn.Linear(cfg.ffn_hidden, cfg.d_model, bias=False)
        self.w3 = nn.Linear(cfg.d_model, cfg.ffn_hidden, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        out: Tensor = self.w2(F.silu(self.w1(x)) * self.w3(x))
        return out


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        out: Tensor = x + self.ffn(self.ffn_norm(x))
        return out


# --------------------------------------------------------------------------------------------
# Decoder and stage views
# --------------------------------------------------------------------------------------------


class Decoder(nn.Module):
    """The whole decoder (defaults) or a stage view owning `layers` (global indices).

    forward(x): x is token ids (b, L) int64 when `has_embed`, else hidden states (b, L, d).
    Returns logits (b, L, V) when `has_head`, else hidden states (b, L, d).

    `activation_checkpointing`: with grad enabled, each block keeps only its input and recomputes
    its activations in backward (`torch.utils.checkpoint`, non-reentrant): memory for one block's
    activations instead of all of them, for about one more forward of compute. The recomputation
    runs the same ops on the same inputs, so gradients are the ones without it, bit for bit.
    """

    activation_checkpointing: bool = False

    def __init__(
        self,
        cfg: ModelConfig,
        layers: range | None = None,
        has_embed: bool = True,
        has_head: bool = True,
        seed: int = 0,
        init_weights: bool = True,
    ) -> None:
        super().__init__()
        layers = range(cfg.n_layers) if layers is None else layers
        if layers.step != 1 or layers.start < 0 or layers.stop > cfg.n_layers:
            raise ConfigError(f"layer range {layers} is not a contiguous part of 0..{cfg.n_layers - 1}")
        self.cfg, self.seed, self.layer_range = cfg, seed, layers
        self.has_embed, self.has_head = has_embed, has_head
        self.embed = Embedding(cfg.vocab_size, cfg.d_model) if has_embed else None
        self.layers = nn.ModuleDict({str(i): Block(cfg) for i in layers})
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if has_head else None
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if has_head else None
        # RoPE tables stay float32 (computed once on CPU) whatever dtype the module is cast to;
        # they are copied to each device on first use.
        self._rope: dict[torch.device, tuple[Tensor, Tensor]] = {
            torch.device("cpu"): rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        }
        if init_weights:  # off for shape-only builds on the meta device
            _init_parameters(self, cfg, seed)

    def _rope_tables(self, device: torch.device) -> tuple[Tensor, Tensor]:
        if device not in self._rope:
            cos, sin = self._rope[torch.device("cpu")]
            self._rope[device] = (cos.to(device), sin.to(device))
        return self._rope[device]  # (max_seq_len, hd) each, float32

    @property
    def is_whole(self) -> bool:
        return self.has_embed and self.has_head and len(self.layer_range) == self.cfg.n_layers

    def forward(self, x: Tensor) -> Tensor:
        L = x.shape[1]
        if self.cfg.max_seq_len < L:
            raise ValueError(f"sequence length {L} exceeds max_seq_len {self.cfg.max_seq_len}")
        if self.embed is not None:
            if x.dtype not in (torch.int64, torch.int32):
                raise TypeError(f"stage with the embedding expects token ids, got {x.dtype}")
            h: Tensor = self.embed(x)  # (b, L, d)
        else:
            h = x  # (b, L, d)
        cos, sin = self._rope_tables(h.device)
        cos, sin = cos[:L], sin[:L]  # (L, hd)
        recompute = self.activation_checkpointing and torch.is_grad_enabled()
        for block in self.layers.values():
            h = checkpoint(block, h, cos, sin, use_reentrant=False) if recompute else block(h, cos, sin)  # (b, L, d)
        if self.head is not None and self.norm is not None:  # both exist exactly when has_head
            logits: Tensor = self.head(self.norm(h))  # (b, L, V)
            return logits
        return h


def build_stage(cfg: ModelConfig, stage: int, n_stages: int, seed: int) -> Decoder:
    """Stage `stage` of an `n_stages`-way split: stage 0 embeds, the last one has the head."""
    ranges = stage_layers(cfg, n_stages)
    if not 0 <= stage < n_stages:
        raise ConfigError(f"stage {stage} does not exist; choose a stage in 0..{n_stages - 1}")
    return Decoder(cfg, layers=ranges[stage], has_embed=stage == 0, has_head=stage == n_stages - 1, seed=seed)


def build_model(cfg: ModelConfig, seed: int) -> Decoder:
    """The whole model (every layer, embedding and head)."""
    return Decoder(cfg, seed=seed)


def stage_shapes(cfg: ModelConfig, stage: int, n_stages: int) -> dict[str, tuple[int, ...]]:
    """Parameter shapes of one stage by global name, read off the real stage built on `meta`.

    Nothing is allocated, so this works for any size (the planner asks about 70B shapes).
    """
    with torch.device("meta"):
        module = Decoder(
            cfg,
            layers=stage_layers(cfg, n_stages)[stage],
            has_embed=stage == 0,
            has_head=stage == n_stages - 1,
            init_weights=False,
        )
    return {name: tuple(p.shape) for name, p in module.named_parameters()}
