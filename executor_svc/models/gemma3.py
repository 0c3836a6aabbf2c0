"""Gemma 3's text decoder over the paged cache: Llama's attention (q/k norms, its own scale)
with local (sliding-window) and global layers, each kind with its own rope, four norms a
layer, a GELU-gated MLP and a scaled embedding."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig

from executor_svc.attention import AttentionMetadata
from executor_svc.models.layers import (
    CausalLM,
    KVCache,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    rope_frequencies,
)
from executor_svc.models.llama import LlamaAttention
from pagedserve.architectures import DecoderSpec, decoder_spec


class Gemma3MLP(nn.Module):
    """gelu_tanh(gate) * up, the gate and up projections fused into one matmul."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, sliding_window: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, spec, sliding_window)
        self.mlp = Gemma3MLP(config)
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        attn = self.self_attn(positions, self.input_layernorm(hidden), kv_cache, meta, rotary)
        hidden = hidden + self.post_attention_layernorm(attn)
        mlp = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp)


class Gemma3ForCausalLM(CausalLM):
    """Parameter names follow transformers' Gemma3ForCausalLM. Its norms scale by (1 + w):
    the 1 is added as the weights load, so our RMSNorm serves them."""

    def __init__(self, config: PretrainedConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.spec = decoder_spec(config)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, self.spec, window) for window in self.spec.sliding_windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        num_positions = max_positions or config.max_position_embeddings
        self.rotaries = nn.ModuleDict(
            {
                kind: RotaryEmbedding(*rope_frequencies(config, kind), num_positions)
                for kind in set(config.layer_types)
            }
        )
        self.embed_scale = torch.tensor(config.hidden_size**0.5)  # rounded as transformers does

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self._embed(input_ids)
        hidden = hidden * self.embed_scale.to(hidden.dtype)
        layer_types = self.config.layer_types
        for layer, kv_cache, kind in zip(self.layers, kv_caches, layer_types, strict=True):
            hidden = layer(positions, hidden, kv_cache, meta, self.rotaries[kind])
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden]
        logits = super().compute_logits(hidden)
        cap = self.spec.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

    def load_hf_state_dict(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_hf_state_dict(
            (name, tensor + 1.0 if name.endswith("norm.weight") else tensor)
            for name, tensor in weights
        )
