"""Models shared by the benchmarks and the demo.

Two workloads, each built deterministically from a seed so that every
contender (and every rank) starts from bit-identical weights:

* ``GPT`` -- a GPT-2-like decoder (token + position embeddings, pre-LayerNorm
  ``Block``s with causal multi-head self-attention and a 4x GELU MLP, final
  LayerNorm, untied LM head).  Compute-bound at the default size.
* ``SmallStack`` -- many tiny ``SmallBlock`` units (Linear + ReLU + LayerNorm).
  Each unit has so little compute that the per-unit host-side work of a
  sharding wrapper (hooks, bookkeeping, small collectives) dominates a step.

Both models take integer inputs and return logits of shape
``(batch, seq, classes)``, so one training step (cross-entropy on the logits)
serves both; ``make_batch`` builds a matching synthetic batch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    """Size of the GPT-2-like model and of its per-rank batch."""

    vocab_size: int = 8192
    seq_len: int = 128
    n_layer: int = 8
    n_head: int = 8
    d_model: int = 512
    batch_size: int = 2  # per rank


@dataclass(frozen=True)
class SmallConfig:
    """Size of the overhead-bound stack and of its per-rank batch."""

    n_blocks: int = 64
    width: int = 64
    n_classes: int = 64
    seq_len: int = 8
    batch_size: int = 4  # per rank


ModelConfig = GPTConfig | SmallConfig


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention with a causal mask (fused QKV projection)."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"d_model={d_model} is not divisible by n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: the FSDP wrapping unit of ``GPT``."""

    def __init__(self, d_model: int, n_head: int) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.fc_proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.fc_proj(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    """GPT-2-like language model; ``forward(idx) -> logits (b, t, vocab)``."""

    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg.d_model, cfg.n_head) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class SmallBlock(nn.Module):
    """A tiny residual unit: LayerNorm(x + ReLU(Linear(x)))."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + F.relu(self.fc(x)))


class SmallStack(nn.Module):
    """Embedding, ``n_blocks`` ``SmallBlock``s, linear head; host-overhead bound."""

    def __init__(self, cfg: SmallConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.emb = nn.Embedding(cfg.n_classes, cfg.width)
        self.blocks = nn.ModuleList(SmallBlock(cfg.width) for _ in range(cfg.n_blocks))
        self.head = nn.Linear(cfg.width, cfg.n_classes)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _init_weights(model: nn.Module, generator: torch.Generator, n_layer: int) -> None:
    """GPT-2 style init: N(0, 0.02) weights, zero biases, unit LayerNorms,
    residual output projections scaled by 1/sqrt(2 * n_layer)."""
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02
            if name.endswith(("attn.proj", "fc_proj")):
                std /= math.sqrt(2 * n_layer)
            with torch.no_grad():
                module.weight.normal_(0.0, std, generator=generator)
                if getattr(module, "bias", None) is not None:
                    module.bias.zero_()
        elif isinstance(module, nn.LayerNorm):
            nn.init.ones_(module.weight)
            nn.init.zeros_(module.bias)


def build_model(cfg: ModelConfig, seed: int) -> nn.Module:
    """Build the model for ``cfg`` on the CPU with weights fixed by ``seed``.

    The init draws from a private generator, so the result does not depend on
    (and does not disturb) the global RNG state.
    """
    model: nn.Module
    if isinstance(cfg, GPTConfig):
        model = GPT(cfg)
        n_layer = cfg.n_layer
    elif isinstance(cfg, SmallConfig):
        model = SmallStack(cfg)
        n_layer = cfg.n_blocks
    else:
        raise TypeError(f"unknown model config {type(cfg).__name__}")
    _init_weights(model, torch.Generator().manual_seed(seed), n_layer)
    return model


def parallelize_tp(model: nn.Module, tp_mesh) -> nn.Module:
    """Tensor parallelism on ``tp_mesh`` (torch's ``parallelize_module``), the same plan for
    every contender of a ``--tp`` run.

    ``GPT``: each block's MLP column-wise (``fc``) then row-wise (``fc_proj``), the LM head
    column-wise with its logits gathered (attention stays replicated: its fused QKV
    projection does not split by heads); ``SmallStack``: each block's ``fc`` and the head
    column-wise with gathered outputs.  Every block so mixes TP and plain parameters (its
    LayerNorms, and the attention in ``GPT``).
    """
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        parallelize_module,
    )

    gathered = ColwiseParallel(output_layouts=Replicate())
    if isinstance(model, GPT):
        parallelize_module(model, tp_mesh, {"lm_head": gathered})
        block_plan = {"fc": ColwiseParallel(), "fc_proj": RowwiseParallel()}
    elif isinstance(model, SmallStack):
        parallelize_module(model, tp_mesh, {"head": gathered})
        block_plan = {"fc": gathered}
    else:
        raise TypeError(f"no tensor-parallel plan for {type(model).__name__}")
    for block in model.blocks:
        parallelize_module(block, tp_mesh, block_plan)
    return model


def wrap_unit_class(cfg: ModelConfig) -> type[nn.Module]:
    """The module class that forms one FSDP unit (for ``ModuleWrapPolicy``)."""
    return Block if isinstance(cfg, GPTConfig) else SmallBlock


def n_classes(cfg: ModelConfig) -> int:
    """Number of logits per position (vocabulary or class count)."""
    return cfg.vocab_size if isinstance(cfg, GPTConfig) else cfg.n_classes


def make_batch(
    cfg: ModelConfig, seed: int, rank: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic ``(inputs, targets)`` for one rank and step, both ``(batch, seq)``
    int64; different per rank and per step, identical across contenders."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + rank * 10_007 + step)
    high = n_classes(cfg)
    tokens = torch.randint(0, high, (cfg.batch_size, cfg.seq_len + 1), generator=g)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def config_dict(cfg: ModelConfig) -> dict[str, object]:
    """The config as a JSON-ready dict, tagged with its kind."""
    return {"kind": type(cfg).__name__, **asdict(cfg)}
