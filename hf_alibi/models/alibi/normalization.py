"""The normalisation of every block (`ln_1`, `ln_2`), of the final hidden states (`ln_f`) and of BLOOM's embedding
(`ln_embd`), chosen by `config.norm_type`: GPT-2's LayerNorm or the RMSNorm of Llama and Baichuan."""

import torch
from torch import nn


class AlibiRMSNorm(nn.Module):
    """`weight * x / sqrt(mean(x^2) + eps)`: no bias, no mean subtracted. The mean of squares and the division are
    taken in fp32 whatever the activations' dtype, then rounded back to it before the weight multiplies, as Llama's
    and Baichuan's RMSNorm do (torch's `nn.RMSNorm` rounds differently in bf16: one unit in the last place)."""

    def __init__(self, hidden_size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        upcast = hidden_states.float()
        variance = upcast.pow(2).mean(-1, keepdim=True)  # (..., 1), fp32
        return self.weight * (upcast * torch.rsqrt(variance + self.eps)).to(hidden_states.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


def norm_layer(config) -> nn.Module:
    """A norm over `n_embd` of `config.norm_type`, with `layer_norm_epsilon`; a LayerNorm's bias follows `bias`."""
    if config.norm_type == "rms_norm":
        return AlibiRMSNorm(config.n_embd, eps=config.layer_norm_epsilon)
    return nn.LayerNorm(config.n_embd, eps=config.layer_norm_epsilon, bias=config.bias)
