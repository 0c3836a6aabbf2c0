"""The Llama-family decoder over the paged cache: Llama 2/3, SmolLM2, Mistral, Qwen2, Qwen3 and
Phi-3, whose differences (biases, q/k norms, sliding windows) ``DecoderSpec`` names."""

from __future__ import annotations

import torch
from torch import nn
from transformers import PretrainedConfig

from executor_svc.attention import AttentionMetadata, PagedAttention
from executor_svc.models.layers import (
    CausalLM,
    KVCache,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    rope_frequencies,
)
from pagedserve.architectures import DecoderSpec, decoder_spec
from pagedserve_kernels import layer_ops
from pagedserve_kernels.ops import cpu_extension


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, sliding_window: int) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=spec.o_proj_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if spec.qk_norm else None
        self.attn = PagedAttention(
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            sliding_window,
            spec.attention_scale or self.head_dim**-0.5,
        )

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split(self.split, dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # each head on its own, into contiguous copies
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(out.shape[0], -1))


class LlamaMLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one matmul."""

    def __init__(self, config: PretrainedConfig, spec: DecoderSpec) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        bias = spec.mlp_bias
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, spec: DecoderSpec, sliding_window: int) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, spec, sliding_window)
        self.mlp = LlamaMLP(config, spec)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        rotary: RotaryEmbedding,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(
            positions, self.input_layernorm(hidden), kv_cache, meta, rotary
        )
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(CausalLM):
    """Parameter names follow transformers' Llama, so its state dict loads after fusing
    q/k/v and gate/up (``load_hf_state_dict``)."""

    def __init__(self, config: PretrainedConfig, max_positions: int | None = None) -> None:
        super().__init__(config)
        self.spec = decoder_spec(config)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.spec, window) for window in self.spec.sliding_windows
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(
            *rope_frequencies(config), max_positions or config.max_position_embeddings
        )
        self._fused_layers: list[list[torch.Tensor | None]] | None = None

    def forward(
        self,
        input_ids: torch.Tensor,  # [num_tokens]
        positions: torch.Tensor,  # [num_tokens]
        kv_caches: list[KVCache],  # one per layer
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [num_tokens, hidden]
        hidden = self._embed(input_ids)
        if self._fused_layers is not None:
            hidden = self._decoder_layers_in_cpp(hidden, positions, kv_caches, meta)
        else:
            for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
                hidden = layer(positions, hidden, kv_cache, meta, self.rotary)
        return self.norm(hidden)

    def _decoder_layers_in_cpp(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """The layers' forward in one call to the CPU extension (see ``pack_linears``)."""
        attn = self.layers[0].self_attn
        return cpu_extension().decoder_layers(
            hidden,
            positions,
            self._fused_layers,
            kv_caches,
            meta.slot_mapping,
            meta.num_prefill_tokens,
            meta.prefill_query_start_loc,
            meta.prefill_context_lens,
            meta.prefill_block_tables,
            meta.decode_context_lens,
            meta.decode_block_tables,
            self.rotary.cos,
            self.rotary.sin,
            attn.num_heads,
            attn.num_kv_heads,
            attn.head_dim,
            self.config.intermediate_size,
            self.norm.eps,
            attn.attn.scale,
            list(self.spec.sliding_windows),
        )

    def _fuse_layers(self) -> None:
        """The same kernels in the same order, without Python between them. No module hook
        runs inside that call, so tensor parallelism's all-reduces need ``fuse_layers`` False."""
        self._fused_layers = [
            [
                layer.input_layernorm.weight,
                layer.self_attn.qkv_proj.weight,
                layer.self_attn.qkv_proj.bias,
                layer.self_attn.o_proj.weight,
                layer.post_attention_layernorm.weight,
                layer.mlp.gate_up_proj.weight,
                layer.mlp.gate_up_proj.bias,
                layer.mlp.down_proj.weight,
                layer.mlp.down_proj.bias,
                layer.self_attn.o_proj.bias,
                None if layer.self_attn.q_norm is None else layer.self_attn.q_norm.weight,
                None if layer.self_attn.k_norm is None else layer.self_attn.k_norm.weight,
            ]
            for layer in self.layers
        ]
