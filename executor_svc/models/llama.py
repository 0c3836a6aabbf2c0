"""A Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2 shapes) over the paged cache."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from executor_svc.attention import AttentionMetadata, PagedAttention
from kernels import layer_ops
from kernels.ops import cpu_extension

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class Linear(nn.Linear):
    """nn.Linear through kernels.layer_ops, whose CPU kernel wants the weight packed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, in_features]
        return layer_ops.linear(x, self.weight, self.bias, self.out_features)

    def pack(self, dtype: torch.dtype) -> None:
        """Repack the loaded weight into layer_ops' panels in ``dtype`` (CPU)."""
        self.weight = nn.Parameter(layer_ops.pack_linear_weight(self.weight.data, dtype), False)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return layer_ops.rms_norm(x, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, computed from the checkpoint's rope parameters
    (default, linear, dynamic, yarn, llama3 ...) by transformers' own initialiser."""

    def __init__(self, config: PretrainedConfig, max_positions: int) -> None:
        super().__init__()
        hf = LlamaRotaryEmbedding(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * hf.inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * hf.attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * hf.attention_scaling, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated query and key; on CPU the same tensors, rotated in place."""
        return layer_ops.rotary_embedding(positions, query, key, self.cos, self.sin)


class LlamaAttention(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = getattr(config, "attention_bias", False)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.split = [q_size, kv_size, kv_size]
        self.qkv_proj = Linear(config.hidden_size, q_size + 2 * kv_size, bias=bias)
        self.o_proj = Linear(q_size, config.hidden_size, bias=False)
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim)

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
        q, k = rotary(positions, q, k)
        out = self.attn(q, k, v, kv_cache[0], kv_cache[1], meta)
        return self.o_proj(out.reshape(out.shape[0], -1))


class LlamaMLP(nn.Module):
    """SwiGLU with the gate and up projections fused into one matmul."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.intermediate = config.intermediate_size
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=bias)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [num_tokens, hidden]
        return self.down_proj(layer_ops.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
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


class LlamaForCausalLM(nn.Module):
    """Parameter names follow transformers' Llama, so its state dict loads after fusing
    q/k/v and gate/up (``load_hf_state_dict``)."""

    def __init__(self, config: PretrainedConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions or config.max_position_embeddings)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)
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
        )

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [num_seqs, hidden]
        weight = self.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight
        return layer_ops.linear(hidden, weight, None, self.config.vocab_size).float()

    def pack_linears(
        self, weight_dtype: torch.dtype = torch.float32, fuse_layers: bool = True
    ) -> None:
        """Repack every projection and the logits' weight for layer_ops' CPU kernel, once the
        checkpoint is in, rounded to ``weight_dtype`` (fp32, bf16 or fp16; the activations stay
        fp32). A tied embedding is packed too (one copy of it, not two); lookups then gather
        its columns from the panels. An untied one is only rounded to ``weight_dtype``.

        ``fuse_layers`` runs the decoder layers in one C++ call from then on: the same kernels
        in the same order, without Python between them. No
        module hook runs inside that call, so tensor parallelism's all-reduces need False.
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(weight_dtype)
        weight = self.embed_tokens.weight.data
        if self.tie_word_embeddings:
            weight = layer_ops.pack_linear_weight(weight, weight_dtype)
        self.embed_tokens.weight = nn.Parameter(weight.to(weight_dtype), False)
        if fuse_layers:
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
                ]
                for layer in self.layers
            ]

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [num_tokens] -> [.., hidden]
        """The tokens' embeddings in the activations' dtype (the norms'): packed or 16-bit
        tables on CPU are widened to fp32."""
        weight = self.embed_tokens.weight
        if layer_ops.is_packed(weight):  # token t is column t % 32 of panel t // 32
            panel = layer_ops.LINEAR_PANEL
            rows = weight[input_ids // panel, :, input_ids % panel]
        else:
            rows = self.embed_tokens(input_ids)
        return rows.to(self.norm.weight.dtype)

    def load_hf_state_dict(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy transformers-named weights in, fusing q/k/v and gate/up as they arrive."""
        params = dict(self.named_parameters())
        q_size, kv_size, _ = self.layers[0].self_attn.split
        inter = self.config.intermediate_size
        fused = {  # name in the checkpoint -> (our fused parameter, row offset)
            "q_proj": ("qkv_proj", 0),
            "k_proj": ("qkv_proj", q_size),
            "v_proj": ("qkv_proj", q_size + kv_size),
            "gate_proj": ("gate_up_proj", 0),
            "up_proj": ("gate_up_proj", inter),
        }
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name or (name == "lm_head.weight" and self.tie_word_embeddings):
                continue
            parts = name.split(".")
            if len(parts) > 3 and parts[-2] in fused:
                target, offset = fused[parts[-2]]
                param = params[".".join([*parts[:-2], target, parts[-1]])]
                param.data[offset : offset + tensor.shape[0]].copy_(tensor)
            else:
                params[name].data.copy_(tensor)
