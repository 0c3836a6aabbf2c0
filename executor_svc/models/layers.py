"""Layers every model family shares: projections and norms through
pagedserve_kernels.layer_ops, rotary tables, and the causal-LM shell (embedding, logits,
packing, loading a transformers state dict)."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from pagedserve_kernels import layer_ops

KVCache = tuple[torch.Tensor, torch.Tensor]  # each [num_blocks, block_size, num_kv_heads, head_dim]


class Linear(nn.Linear):
    """nn.Linear through pagedserve_kernels.layer_ops, whose CPU kernel wants the weight packed."""

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


def rope_frequencies(
    config: PretrainedConfig, layer_type: str | None = None
) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling as transformers' rope initialisers compute
    them, for the whole model or one ``layer_type`` (Gemma 3's sliding and global layers).
    Taken from its rope utilities, not from a family's modeling file: importing one of
    those costs seconds at every executor start."""
    params = config.rope_parameters if layer_type is None else config.rope_parameters[layer_type]
    if params["rope_type"] != "default":
        kwargs = {} if layer_type is None else {"layer_type": layer_type}
        return ROPE_INIT_FUNCTIONS[params["rope_type"]](config, **kwargs)
    dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    inv_freq = 1.0 / (params["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return inv_freq, 1.0


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position, from inverse frequencies that transformers' own rope
    initialisers computed (default, linear, dynamic, yarn, llama3, longrope ...)."""

    def __init__(
        self, inv_freq: torch.Tensor, attention_scaling: float, max_positions: int
    ) -> None:
        super().__init__()
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq.float()[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * attention_scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * attention_scaling, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,  # [num_tokens]
        query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotated query and key; on CPU the same tensors, rotated in place."""
        return layer_ops.rotary_embedding(positions, query, key, self.cos, self.sin)


class CausalLM(nn.Module):
    """What every family's model shares: the embedding, the logits and the loading of a
    transformers state dict, whose names our parameters keep (q/k/v and gate/up fused)."""

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.tie_word_embeddings = getattr(config, "tie_word_embeddings", False)
        if not self.tie_word_embeddings:
            self.lm_head = Linear(config.hidden_size, config.vocab_size, bias=False)

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

        ``fuse_layers``: run the decoder layers in one C++ call from then on, where the family
        has one (``_fuse_layers``).
        """
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack(weight_dtype)
        weight = self.embed_tokens.weight.data
        if self.tie_word_embeddings:
            weight = layer_ops.pack_linear_weight(weight, weight_dtype)
        self.embed_tokens.weight = nn.Parameter(weight.to(weight_dtype), False)
        if fuse_layers:
            self._fuse_layers()

    def _fuse_layers(self) -> None:
        """Run the decoder layers in one C++ call from now on, where the family has one."""

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
