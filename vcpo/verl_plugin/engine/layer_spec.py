"""mbridge made to follow megatron's own ``TransformerConfig.transformer_impl``: the local layer spec when it says "local".

mbridge 0.15.1 builds every GPT with Transformer Engine's layer spec (``LLMBridge._get_transformer_layer_spec`` asks
``get_gpt_decoder_block_spec(..., use_transformer_engine=True)``), whatever ``transformer_impl`` says. OPOB on Megatron
needs megatron's local spec (``recipes/megatron.yaml``, ``local_layers``): its ColumnParallelLinear / RowParallelLinear,
torch norms and unfused attention are what `MegatronSequenceNorms` watches; TE's fused norm + linear hides the norm's
output gradient. `honour_transformer_impl` patches mbridge's class (no file is edited) so that a config with
``transformer_impl="local"`` (``override_transformer_config``, which mbridge passes into the TransformerConfig) gets the
local spec, and every other config mbridge's own. mbridge's weight-name maps know TE's fused norms
(``linear_qkv.layer_norm_weight``, ``linear_fc1.layer_norm_weight``); the local spec keeps the same weights in separate
``input_layernorm`` / ``pre_mlp_layernorm`` modules, so their names are mapped to TE's before mbridge's maps (loading the
Hugging Face checkpoint and exporting weights to the rollout alike). verl's padded (bshd) path hands the model a
[b, s] mask, True at real tokens, which is what Transformer Engine's attention takes; megatron's local attention
wants [b, 1, sq, sk], True where a score is masked, so `honour_transformer_impl` also makes it take verl's mask
(`square_attention_mask`); a mask already square is left alone.

Applied when a Megatron engine is built (the vcpo Megatron engine's construction, and the CPU shims'), never at import:
an FSDP worker imports the engine package too, and keeps megatron's attention as it is.
"""

from __future__ import annotations

import functools

from vcpo.upstream import require

LOCAL = "local"
PATCHED = "__vcpo_honours_transformer_impl__"  # on each patched function (each is patched once, whatever else restores)

# local-spec parameter names -> Transformer Engine spec names (the fused norm of linear_qkv / linear_fc1)
LOCAL_TO_TE_NAMES = (
    (".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight"),
    (".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight"),
    (".input_layernorm.bias", ".self_attention.linear_qkv.layer_norm_bias"),
    (".pre_mlp_layernorm.bias", ".mlp.linear_fc1.layer_norm_bias"),
)


def uses_local_spec(config) -> bool:
    """A megatron TransformerConfig (or anything with its ``transformer_impl``) that asks for the local layer spec."""
    return getattr(config, "transformer_impl", None) == LOCAL


def te_name(name: str) -> str:
    """A local-spec parameter name as the Transformer Engine spec names the same weight (others unchanged)."""
    for local, te in LOCAL_TO_TE_NAMES:
        if name.endswith(local):
            return name[: -len(local)] + te
    return name


def square_attention_mask(mask, queries: int, keys: int):
    """verl's [b, s] padding mask (True at real tokens) as megatron's local attention's [b, 1, sq, sk] (True where
    masked: a padded key, or a key after the query)."""
    import torch

    causal = torch.ones(queries, keys, dtype=torch.bool, device=mask.device).triu(1 + keys - queries)
    return causal[None, None] | ~mask.bool()[:, None, None, :]


def honour_transformer_impl() -> None:
    """Patch mbridge's LLMBridge and megatron's local attention (idempotent; nothing where mbridge is not installed):
    module doc."""
    try:
        from mbridge.core.bridge import Bridge
        from mbridge.core.llm_bridge import LLMBridge
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec
        from megatron.core.transformer.dot_product_attention import DotProductAttention
    except ImportError:
        return
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    require("megatron_local_layers")

    spec = LLMBridge._get_transformer_layer_spec
    if not getattr(spec, PATCHED, False):

        @functools.wraps(spec)
        def layer_spec(self, vp_stage=None):
            if not uses_local_spec(self.config):
                return spec(self, vp_stage)
            self.has_vp_stage = True
            block: TransformerBlockSubmodules = get_gpt_decoder_block_spec(self.config, use_transformer_engine=False, normalization=self.config.normalization,
                                               vp_stage=vp_stage)
            # the final norm is megatron's LNImpl, apex's FusedLayerNorm where apex is installed, which refuses RMSNorm;
            # the layers' own norms are torch's (the local spec's provider), and so is this one
            block.layer_norm = WrappedTorchNorm
            return block

        setattr(layer_spec, PATCHED, True)
        LLMBridge._get_transformer_layer_spec = layer_spec
    to_hf = Bridge._weight_name_mapping_mcore_to_hf
    if not getattr(to_hf, PATCHED, False):

        @functools.wraps(to_hf)
        def to_hf_names(self, mcore_weights_name):
            return to_hf(self, te_name(mcore_weights_name) if uses_local_spec(self.config) else mcore_weights_name)

        setattr(to_hf_names, PATCHED, True)
        Bridge._weight_name_mapping_mcore_to_hf = to_hf_names
    attention = DotProductAttention.forward
    if not getattr(attention, PATCHED, False):

        @functools.wraps(attention)
        def attention_with_verls_mask(self, query, key, value, attention_mask, *args, **kwargs):
            if attention_mask is not None and attention_mask.dim() == 2:
                attention_mask = square_attention_mask(attention_mask, query.size(0), key.size(0))
            return attention(self, query, key, value, attention_mask, *args, **kwargs)

        setattr(attention_with_verls_mask, PATCHED, True)
        DotProductAttention.forward = attention_with_verls_mask


__all__ = ["LOCAL", "LOCAL_TO_TE_NAMES", "honour_transformer_impl", "square_attention_mask", "te_name", "uses_local_spec"]
