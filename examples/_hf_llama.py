"""A tiny Hugging Face Llama for the RL demo and the tests: built from a config, nothing downloaded.

Needs ``transformers`` (``pip install -e ".[hf]"``); nothing else in the project imports it.

* :func:`tiny_config` / :func:`build_llama`: a ``LlamaForCausalLM`` with tied embeddings
  (``lm_head.weight`` *is* ``model.embed_tokens.weight``), grouped-query attention (4 query heads,
  2 key/value heads), hidden size 64, 2 layers, a vocabulary of 256.
* :func:`fuse_qkv`: the generator-side layout of an inference engine such as vLLM: each layer's
  ``q_proj``, ``k_proj`` and ``v_proj`` become one ``qkv_proj`` (their weights stacked by rows), and
  the attention computes q, k and v with one matmul.
* :func:`fused_receive_state` and :func:`to_fused_name`: what a generator with fused weights hands to
  ``rl_sync.WeightSubscriber`` (each ``qkv_proj.weight`` as three row views of itself) and the
  ``name_map`` a trainer with the unfused model passes to ``rl_sync.WeightPublisher``.
* :class:`LlamaPolicy`: the demo's policy (``examples/rl_loop.py --model hf-llama``): tokens -> the
  logits of the 10 digits, for the digit-copy task of ``_toy_rl.py``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama as ml

__all__ = ["FusedQKVAttention", "LlamaPolicy", "build_llama", "build_policy", "fuse_qkv", "fused_receive_state",
           "qkv_rows", "tiny_config", "to_fused_name", "unfused_state"]

QKV = ("q", "k", "v")


def tiny_config(vocab_size: int = 256, hidden_size: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                intermediate_size: int = 128, max_positions: int = 64) -> LlamaConfig:
    """A Llama config small enough to train on one CPU thread, with tied input/output embeddings.

    ``initializer_range=0.1`` (Llama's default is 0.02): at this size the demo's policy learns faster
    from the wider initialisation."""
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       max_position_embeddings=max_positions, tie_word_embeddings=True, use_cache=False,
                       attn_implementation="sdpa", initializer_range=0.1)


def build_llama(seed: int = 0, config: LlamaConfig | None = None) -> LlamaForCausalLM:
    """``LlamaForCausalLM(config)`` on the CPU in float32, initialised from ``seed`` (the global RNG is left
    as it was)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config if config is not None else tiny_config())
    if model.lm_head.weight is not model.model.embed_tokens.weight:  # (tie_word_embeddings=True must tie them)
        raise RuntimeError("the config asks for tied embeddings and transformers did not tie them")
    return model.float()


def qkv_rows(config: LlamaConfig) -> tuple[int, int, int]:
    """How many rows of the fused ``qkv_proj.weight`` belong to q, k and v."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return (config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim,
            config.num_key_value_heads * head_dim)


class FusedQKVAttention(ml.LlamaAttention):
    """``LlamaAttention`` with one ``qkv_proj`` (rows: q, then k, then v) in place of three projections.

    Served without a KV cache (``use_cache=False``: the demo and the tests run whole sequences).
    """

    def __init__(self, config: LlamaConfig, layer_idx: int) -> None:
        super().__init__(config, layer_idx)
        bias = self.q_proj.bias is not None
        del self.q_proj, self.k_proj, self.v_proj
        self.rows = qkv_rows(config)
        self.qkv_proj = nn.Linear(config.hidden_size, sum(self.rows), bias=bias)

    def forward(self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> tuple[torch.Tensor, Any]:
        for key in ("cache", "past_key_values", "past_key_value"):
            if kwargs.pop(key, None) is not None:
                raise NotImplementedError("FusedQKVAttention runs without a KV cache (use_cache=False)")
        kwargs.pop("cache_position", None)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, k, v = self.qkv_proj(hidden_states).split(self.rows, dim=-1)  # one matmul for the three
        q, k, v = (t.reshape(hidden_shape).transpose(1, 2) for t in (q, k, v))
        cos, sin = position_embeddings
        q, k = ml.apply_rotary_pos_emb(q, k, cos, sin)
        attend = ml.ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, ml.eager_attention_forward)
        out, weights = attend(self, q, k, v, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
                              scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def fuse_qkv(model: LlamaForCausalLM) -> LlamaForCausalLM:
    """Give every decoder layer of ``model`` a :class:`FusedQKVAttention` holding the same weights (in place;
    returns ``model``): its forward computes what the unfused one does."""
    with torch.no_grad():
        for i, layer in enumerate(model.model.layers):
            old = layer.self_attn
            new = FusedQKVAttention(model.config, i).to(old.o_proj.weight.dtype)
            new.qkv_proj.weight.copy_(torch.cat([old.q_proj.weight, old.k_proj.weight, old.v_proj.weight]))
            if old.q_proj.bias is not None:
                new.qkv_proj.bias.copy_(torch.cat([old.q_proj.bias, old.k_proj.bias, old.v_proj.bias]))
            new.o_proj.load_state_dict(old.o_proj.state_dict())
            new.train(old.training)
            layer.self_attn = new
    return model


_FUSED = re.compile(r"\.qkv_proj\.(weight|bias)$")
_UNFUSED = re.compile(r"\.([qkv])_proj\.(weight|bias)$")
_VIEW = re.compile(r"\.qkv_proj\.(weight|bias)\.([qkv])$")


def fused_receive_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a generator with :func:`fuse_qkv`'s layout receives into: its state dict, with every
    ``...qkv_proj.weight`` (and bias) given as three row views of itself, named ``...qkv_proj.weight.q``,
    ``.k``, ``.v``. The views share the fused tensor's memory, so a push that writes them writes it;
    ``rl_sync.WeightSubscriber(ep, fused_receive_state(model), mode="staged")`` (the modes that re-point
    tensors cannot re-point a view's base, and refuse views)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if _FUSED.search(name):
            attn = model.get_submodule(name.rsplit(".", 2)[0])
            for part, view in zip(QKV, t.split(attn.rows, dim=0), strict=True):
                out[f"{name}.{part}"] = view
        else:
            out[name] = t
    return out


def to_fused_name(name: str) -> str:
    """The ``name_map`` for the trainer: ``...self_attn.q_proj.weight`` -> ``...self_attn.qkv_proj.weight.q``
    (and k, v, biases); every other name stays."""
    return _UNFUSED.sub(lambda m: f".qkv_proj.{m.group(2)}.{m.group(1)}", name)


def unfused_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """A fused model's weights under the unfused model's names (views, no copies): for comparisons."""
    out: dict[str, torch.Tensor] = {}
    for name, t in fused_receive_state(model).items():
        m = _VIEW.search(name)
        out[f"{name[:m.start()]}.{m.group(2)}_proj.{m.group(1)}" if m else name] = t
    return out


# ---------------------------------------------------------------------------- the demo's policy
class LlamaPolicy(nn.Module):
    """The digit-copy task's policy (``_toy_rl``) on a Llama: tokens [B, L] -> logits of the digits [B, L, 10].

    The task's 11 input tokens are the first ids of the Llama's vocabulary; its output is the logits of the
    first 10 (the tied ``lm_head`` reads the same rows of the embedding the digits are fed through)."""

    def __init__(self, lm: LlamaForCausalLM, digits: int) -> None:
        super().__init__()
        self.lm = lm
        self.digits = digits

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=tokens, use_cache=False).logits[..., :self.digits]


def build_policy(seed: int, digits: int) -> LlamaPolicy:
    return LlamaPolicy(build_llama(seed), digits)
