"""The MLP's activation: transformers' `ACT2FN`, except that the tanh GELU always runs as torch's fused kernel.

GELU's tanh approximation, 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), is GPT-2's default (`gelu_new`) and the
function BLOOM's `bloom_gelu_forward` computes (the BLOOM import names it `gelu_new`: BLOOM's 8-digit 0.79788456 and
sqrt(2/pi) are the same fp32 number). transformers' `NewGELUActivation` computes it as 8 elementwise ops, each one
a pass over the (B, L, 4d) hidden activation, and autograd keeps their intermediates for the backward;
`F.gelu(approximate="tanh")` (`ACT2FN["gelu_pytorch_tanh"]`) is one fused kernel with an analytic backward, the same
function up to fp32 rounding (tests/models/alibi/test_activations.py measures it). Only the kernel changes:
`config.activation_function` keeps the name it was given, so saved configs, the BLOOM/MPT/GGUF exports and the
remote code name, and compute, the same function as before. The erf GELU (`gelu`: MPT, Falcon) stays as it is.
"""

from torch import nn
from transformers.activations import ACT2FN

# Every ACT2FN name whose forward is this formula with these constants. Not `gelu_fast`: its 0.7978845608 is sqrt(2/pi)
# cut at 10 digits, another function (by ~1e-12 in fp64), so a checkpoint naming it keeps transformers' kernel.
TANH_GELUS = frozenset({"gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh", "gelu_accurate"})


def mlp_activation(name: str) -> nn.Module:
    """`ACT2FN[name]` (a fresh module), with the tanh GELU under any of its names (`TANH_GELUS`) fused."""
    return ACT2FN["gelu_pytorch_tanh" if name in TANH_GELUS else name]
