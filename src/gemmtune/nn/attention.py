"""``nn.MultiheadAttention`` with its two projections served by gemmtune.

``nn.MultiheadAttention`` computes its input projection (one (3E, E) GEMM for self-attention)
and its output projection inside ``F.multi_head_attention_forward``, from its own weights: no
module call that ``optimize`` could take over performs them. ``optimize`` makes such a module
this class, which serves the calls it can as they are: self-attention (query, key and value the
same tensor) with one embedding size, no attention weights asked for (``need_weights=False``,
as ``nn.TransformerEncoderLayer`` and torchvision's ViT ask), no masks, no ``bias_k``/``bias_v``
or zero attention, no dropout while training. There it runs the input projection through
``gemmtune.linear``, attention through ``F.scaled_dot_product_attention`` and the output
projection through ``gemmtune.linear``; any other call runs torch's own forward, as do calls
while torch.compile traces it (the compiler chooses those GEMMs) or torch.autocast is on (it
casts torch's operands) and, where ``optimize``'s check found torch's faster there, calls
captured in a CUDA graph.

Where torch runs an inference call as one fused op (``torch._native_multi_head_attention``: eval
mode, batch first, gradients off), that op costs the host less than the served forward's five
calls: torchvision's ViT-B's attention served cost 1.16-1.24x its fused call's host time on an
H200, 11-16 us more a call (31-38 us while that host ran slow), for the same GPU time
(eager-layers-h200-vit_b_16-torchvision-mha-20261129.json). ``optimize`` then keeps the layer's
eager calls on torch's forward unless its GEMMs save more than that on the GPU
(``keep.served``).
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from gemmtune import api
from gemmtune.nn import keep, refused

_is_compiling, _capturing, _autocast = keep.is_compiling, keep.capturing, keep.any_autocast

# what a served eager call costs the host over torch's fused inference call, beyond its GEMMs (us)
FUSED_CALL_HOST_US = 15.0


class MultiheadAttention(keep.TakenOver, nn.MultiheadAttention):
    torch_class = nn.MultiheadAttention  # nothing is fused into it: optimize fuses into FUSABLE layers only

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        if _is_compiling() or self.torch_when_capturing is not None and self.torch_when_capturing == _capturing() \
                or _autocast() or not self._serves(query, key, value, key_padding_mask, need_weights, attn_mask,
                                                   is_causal):
            return nn.MultiheadAttention.forward(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                                                 average_attn_weights, is_causal)
        return self.served_forward(query), None

    def eager_host_us(self) -> float:
        """FUSED_CALL_HOST_US where torch's forward runs this layer's self-attention calls as one
        fused op (in eval mode with its inputs batch first: torch's condition that gradients be off
        is the caller's, and a model in eval mode is run for inference), else none."""
        fused = torch.backends.mha.get_fastpath_enabled() and self.batch_first and not self.training \
            and self.num_heads % 2 == 0 and self.in_proj_bias is not None
        return FUSED_CALL_HOST_US if fused else 0.0

    def _serves(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal) -> bool:
        """Whether this call is one ``served_forward`` computes as torch's forward does."""
        return (query is key and key is value and not need_weights and key_padding_mask is None
                and attn_mask is None and not is_causal and query.dim() in (2, 3) and not query.is_nested
                and not (self.training and self.dropout > 0.0))

    def served_forward(self, query: torch.Tensor) -> torch.Tensor:
        """Self-attention of ``query``: (L, E) unbatched; (B, L, E) batch first, else (L, B, E),
        whose order the projections keep (no copy of the input)."""
        seq_first = query.dim() == 2 or not self.batch_first
        x = query.unsqueeze(1) if query.dim() == 2 else query
        heads, embed = self.num_heads, self.embed_dim
        qkv = api.linear(x, self.in_proj_weight, self.in_proj_bias)
        q, k, v = qkv.view(*x.shape[:2], 3, heads, embed // heads).permute(
            (2, 1, 3, 0, 4) if seq_first else (2, 0, 3, 1, 4))  # each (B, heads, L, head size)
        attended = F.scaled_dot_product_attention(q, k, v)
        attended = attended.permute((2, 0, 1, 3) if seq_first else (0, 2, 1, 3)).reshape(*x.shape[:2], embed)
        out = api.linear(attended, self.out_proj.weight, self.out_proj.bias)
        return out.squeeze(1) if query.dim() == 2 else out


def reason(module: nn.MultiheadAttention, held: Counter) -> str | None:
    """Why ``module`` is left to torch, or None where ``optimize`` can take it over."""
    if not module._qkv_same_embed_dim:
        return "attention whose key or value size differs from its embedding size"
    if module.bias_k is not None or module.add_zero_attn:
        return "attention with bias_k/bias_v or add_zero_attn"
    if module.embed_dim % module.num_heads:
        return "attention whose embedding size does not divide into its heads"
    return refused.reason(module, held, weight=module.in_proj_weight) or \
        refused.reason(module.out_proj, held)


def take_over(module: nn.MultiheadAttention) -> None:
    module.__class__ = MultiheadAttention
