"""The checkpoint architectures the executor serves and how each departs from Llama's decoder;
anything else is refused naming the config field. Shared by both services (no torch)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "phi3", "gemma3_text")
# Rope types whose cos/sin tables transformers computes once (static); "dynamic" and
# "longrope" change only past a length that ``DecoderSpec.max_positions`` keeps us under.
SUPPORTED_ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn", "longrope")


@dataclass(frozen=True, slots=True)
class DecoderSpec:
    """One checkpoint's decoder: which optional parts its layers have."""

    qkv_bias: bool = False
    o_proj_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # RMSNorm over each head of q and k before rotary (Qwen3)
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj stored fused (Phi-3)
    sliding_windows: tuple[int, ...] = ()  # per layer: positions a token sees; 0: all
    attention_scale: float = 0.0  # softmax scale of q.k; 0: head_dim ** -0.5
    final_logit_softcapping: float = 0.0  # logits = cap * tanh(logits / cap); 0: none
    max_positions: int = 0  # positions at which our rope tables equal transformers'

    @property
    def kv_window(self) -> int:
        """The widest window when every layer slides: K/V wholly before it is read by no
        layer, so its blocks can go back to the pool. 0 when a layer sees all positions."""
        windows = self.sliding_windows
        return max(windows) if windows and min(windows) > 0 else 0


def decoder_spec(config: Any) -> DecoderSpec:
    """What ``config`` asks of the decoder; raises ValueError naming a field we do not serve."""
    model_type = config.model_type
    if model_type not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"model_type {model_type!r} is not supported; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if model_type == "gemma3_text":
        return _gemma3_spec(config)
    _check_value(config, "hidden_act", ("silu",))
    attention_bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(
        qkv_bias=attention_bias or model_type == "qwen2",
        o_proj_bias=attention_bias and model_type in ("llama", "qwen3"),
        mlp_bias=bool(getattr(config, "mlp_bias", False)) and model_type == "llama",
        qk_norm=model_type == "qwen3",
        fused_checkpoint=model_type == "phi3",
        sliding_windows=_sliding_windows(config),
        max_positions=_rope_max_positions(config, getattr(config, "rope_parameters", None) or {}),
    )


def _gemma3_spec(config: Any) -> DecoderSpec:
    """Gemma 3's text decoder: q/k norms, a scale from query_pre_attn_scalar, local and global
    layers (each with its own rope), optional final soft-capping."""
    _check_value(config, "hidden_activation", ("gelu_pytorch_tanh",))
    _check_value(config, "attn_logit_softcapping", (None,))
    _check_value(config, "use_bidirectional_attention", (False, None))
    attention_bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        qk_norm=True,
        sliding_windows=_sliding_windows(config),
        attention_scale=config.query_pre_attn_scalar**-0.5,
        final_logit_softcapping=config.final_logit_softcapping or 0.0,
        max_positions=min(_rope_max_positions(config, rope) for rope in _ropes(config)),
    )


def _ropes(config: Any) -> list[dict]:
    """Gemma 3 keeps one set of rope parameters per layer type."""
    rope = getattr(config, "rope_parameters", None) or {}
    return [rope[t] for t in sorted(set(config.layer_types))]


def _check_value(config: Any, field: str, allowed: tuple[Any, ...]) -> None:
    value = getattr(config, field, allowed[0])
    if value not in allowed:
        raise ValueError(
            f"{config.model_type}: {field} = {value!r} is not supported; supported: "
            f"{', '.join(map(repr, allowed))}"
        )


def _sliding_windows(config: Any) -> tuple[int, ...]:
    """Per layer, the window of a "sliding_attention" layer (every layer without
    ``layer_types``: Mistral, Phi-3), 0 for full attention."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    for layer_type in layer_types:
        if layer_type not in ("full_attention", "sliding_attention"):
            raise ValueError(f"{config.model_type}: layer_types {layer_type!r} is not supported")
    return tuple(window if t == "sliding_attention" else 0 for t in layer_types)


def _rope_max_positions(config: Any, rope: dict) -> int:
    """The longest context whose rope tables are transformers' own: past
    ``original_max_position_embeddings`` longrope switches to its long factors, and past
    ``max_position_embeddings`` dynamic NTK recomputes its frequencies per forward."""
    rope_type = rope.get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"{config.model_type}: rope_parameters.rope_type {rope_type!r} is not supported; "
            f"supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
        )
    partial = rope.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", None))
    if partial not in (None, 1, 1.0):
        raise ValueError(
            f"{config.model_type}: partial_rotary_factor {partial!r} is not supported (only 1.0)"
        )
    if rope_type == "longrope":
        return min(config.max_position_embeddings, rope["original_max_position_embeddings"])
    return config.max_position_embeddings
