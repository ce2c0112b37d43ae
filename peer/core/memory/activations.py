"""What autograd keeps of one micro-batch on a stage, op by op, and what its backward adds.

Counted from the ops of `peer.core.model.decoder.Block` (tokens N = b·L; widths d, a = heads·head_dim,
f = ffn_hidden; c = 2 bytes under bf16/fp16 autocast, 4 in fp32). Per block, in fp32 (4 bytes):

    RMSNorm ×2     x (pow), rsqrt (N), x·rsqrt (mul with the gain)     → 2·(2·N·d + N)
    wq, wk, wv     their shared input, the attention norm's output     → N·d
    rotary         only the cos/sin tables (shared, not per micro-batch)
    SDPA           q, k, v, output (wo reads it as a view), logsumexp  → 4·N·a + b·h·L
    residual       x + attn(…): the ffn norm's input, counted above    → N·d (x1)
    w1, w3         their shared input, the ffn norm's output           → N·d
    SwiGLU         w1 x, silu(w1 x), w3 x, their product (w2's input)  → 4·N·f

= 4·(6·N·d + 4·N·a + 4·N·f + 2·N + b·h·L) bytes. The block's input x is the previous block's
output: counted once, here. Under autocast (`torch.autocast`, bf16 or fp16) the residual stream
and RMSNorm stay float32 (x, x1 and both x·rsqrt), every linear saves its input cast to c bytes
(the attention norm's output three times, the ffn norm's twice: each cast is its own tensor) and
its weight in c bytes, the matmul outputs are c bytes, and the rotary tables are cast per
micro-batch. The weights' c-byte copy is not per micro-batch: `peer.core.model.precision.CastWeights`
casts a stage's matmul weights once per inner step and every micro-batch in flight saves that one
copy (`cast_bytes`, counted once per stage by `peer.core.memory.estimate`).
`tests/unit/test_memory_estimate.py` checks these counts against what autograd actually saves
in the real modules (`torch.autograd.graph.saved_tensors_hooks`), byte for byte.

With activation checkpointing (non-reentrant `torch.utils.checkpoint`, per block) a block keeps
only its input (float32, N·d); its backward first recomputes the block's forward, so one block's
full stash exists at a time on top (`recompute_bytes`); the recompute runs on the master weights
(outside `functional_call`), so autocast casts that block's weights again for it.

The backward's transient peak (`workspace_bytes`) is what exists beside the stash while one
micro-batch runs backward: the gradients flowing through a block, the temporary of a weight
gradient before it is added into `.grad`, the logits and their gradients at the head. These are
not saved tensors but temporaries, counted from the same ops and checked against measured peaks
(`peer.research.bench.memory`).
"""

from __future__ import annotations

from dataclasses import dataclass

from peer.core.model.decoder import ModelConfig

F32 = 4  # bytes of float32: parameters, optimizer state, the residual stream, RMSNorm, the loss
HALF_PRECISIONS = ("bf16", "fp16")
PRECISIONS = ("fp32", *HALF_PRECISIONS)


def compute_bytes(precision: str) -> int:
    """Bytes per element of what autocast computes matmuls in: 2 for bf16/fp16, 4 for fp32."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return 2 if precision in HALF_PRECISIONS else F32


@dataclass(frozen=True)
class MicroBatch:
    """The shape of one micro-batch through a model: b sequences of L tokens."""

    cfg: ModelConfig
    b: int
    L: int
    precision: str = "fp32"

    @property
    def N(self) -> int:
        return self.b * self.L

    @property
    def c(self) -> int:
        return compute_bytes(self.precision)


def block_bytes(mb: MicroBatch) -> int:
    """Bytes autograd saves in one Block's forward of one micro-batch (its input included)."""
    m, N, c = mb.cfg, mb.N, mb.c
    d, a, f = m.d_model, m.attn_dim, m.ffn_hidden
    lse = F32 * mb.b * m.n_heads * mb.L  # SDPA's logsumexp, float32 in every precision
    norms = F32 * 2 * N  # the two rsqrt(mean(x²) + eps), (b, L, 1) each
    if c == F32:
        return F32 * (6 * N * d + 4 * N * a + 4 * N * f) + norms + lse
    residual = F32 * 4 * N * d  # x, x·rsqrt, x1, x1·rsqrt stay float32
    casts = c * 5 * N * d  # the norms' outputs cast for wq, wk, wv and for w1, w3
    matmuls = c * (4 * N * a + 4 * N * f)  # q, k, v, attention output; w1 x, silu, w3 x, product
    rope = c * 2 * mb.L * m.head_dim  # cos, sin cast to the compute dtype
    return residual + casts + matmuls + rope + norms + lse  # the weights' copy: `cast_bytes`


def block_weights(cfg: ModelConfig) -> int:
    """Elements of one block's seven matrices (wq, wk, wv, wo; w1, w2, w3)."""
    d, a, f = cfg.d_model, cfg.attn_dim, cfg.ffn_hidden
    return 4 * d * a + 3 * d * f


def cast_bytes(cfg: ModelConfig, precision: str, n_layers: int, has_head: bool) -> int:
    """The compute-dtype copy of a stage's matmul weights (`CastWeights`): once per stage, shared
    by every micro-batch in flight; nothing in fp32."""
    c = compute_bytes(precision)
    if c == F32:
        return 0
    return c * (n_layers * block_weights(cfg) + (cfg.vocab_size * cfg.d_model if has_head else 0))


def head_bytes(mb: MicroBatch) -> int:
    """Bytes saved by the last stage's final norm, LM head and loss (float32 log-softmax)."""
    m, N, c = mb.cfg, mb.N, mb.c
    d, V = m.d_model, m.vocab_size
    norm = F32 * (2 * N * d + N)  # the last block's output, x·rsqrt, rsqrt
    head_in = (F32 if c == F32 else c) * N * d  # the head's input (its weight's copy: `cast_bytes`)
    loss = F32 * N * V + 8 * N + F32  # log_softmax's float32 output; nll_loss's int64 targets, total weight
    return norm + head_in + loss


def checkpointed_block_bytes(mb: MicroBatch) -> int:
    """What a checkpointed block keeps: its float32 input (the residual stream)."""
    return F32 * mb.N * mb.cfg.d_model


def stash_bytes(mb: MicroBatch, n_layers: int, has_head: bool, checkpointing: bool) -> int:
    """Bytes one micro-batch keeps for its backward on a stage of `n_layers` blocks."""
    per_block = checkpointed_block_bytes(mb) if checkpointing else block_bytes(mb)
    return n_layers * per_block + (head_bytes(mb) if has_head else 0)


def recompute_bytes(mb: MicroBatch, checkpointing: bool) -> int:
    """Checkpointing: one block's full stash, rebuilt in backward (one block at a time), and the
    block's weights cast again for the recompute (in bf16/fp16)."""
    if not checkpointing:
        return 0
    recast = cast_bytes(mb.cfg, mb.precision, 1, False)
    return block_bytes(mb) + recast - checkpointed_block_bytes(mb)


def workspace_bytes(
    mb: MicroBatch, has_embed: bool, has_head: bool, largest_param: int, checkpointing: bool = False
) -> int:
    """The transient peak of one micro-batch's backward (or of the optimizer step), beside the stash:
    the largest of its phases, which run one after another.

    - a block: the residual gradient and the gradient entering the block (N·d each), the
      gradients of the SwiGLU product's three inputs and output (N·f each, in the compute dtype:
      the product rule needs both factors' gradients at once) and one weight gradient's temporary (d·f) before it
      is added into `.grad`; with checkpointing, the block's recomputed stash on top;
    - the head: the logits (c bytes), the float32 copy the loss reads, the gradients of the
      log-softmax and of the logits (float32); the head weight's gradient comes after the
      logits' gradient is consumed, so it adds nothing to this phase;
    - the embedding: its dense weight gradient (V·d) and the incoming gradient (N·d);
    - AdamW: one temporary of the largest parameter (the denominator √v̂ + ε).
    """
    m, N, c = mb.cfg, mb.N, mb.c
    d, f, V = m.d_model, max(m.ffn_hidden, m.attn_dim), m.vocab_size
    block = F32 * (2 * N * d + d * f) + c * 4 * N * f + recompute_bytes(mb, checkpointing)
    parts = [block, F32 * largest_param]
    if has_head:
        upcast = F32 * N * V if c != F32 else 0  # token_loss reads the logits in float32
        parts.append(c * N * V + upcast + F32 * 2 * N * V)
    if has_embed:
        parts.append(F32 * (V * d + N * d))
    return max(parts)
