"""The split's floored bias: no fp32 denormals from `exp`, results equal to fp32 rounding (`bias_floors`).

Why. ALiBi puts a band of each row's keys 87-104 nats below the row's maximum, where `exp` lands in fp32's denormal
range (below e^-87.34): Intel x86 cores take a microcode assist on each denormal operand or result (~100x slower). The
CPU flash kernel's forward `exp` returns 0 below -87.34, but weights just above that make denormal products with
values, and its backward `exp` returns the denormals themselves. The split instead raises every bias value b of its calls to max(b, -C), C
per head and layer call; padding and the diagonal blocks' causal upper triangle keep the dtype's minimum.

No denormal in a call's forward. Let B >= |q_i . k_j| * scale over the call's rows and keys (Cauchy-Schwarz:
max |q| * max |k| * scale). A call's biases are <= 0 in its own frame (per-key: -m (p - j) <= -m; diagonal:
-m (a - b) <= 0), so its running maximum is <= B, and every visible logit, floored, is >= -B - C: every argument
`exp(s - running max)` of the kernel's online softmax (its rescales included) is >= -(2B + C).

Exact to fp32 rounding. Row a of a call sits at i = p + a and its true logits are the call's less m * a (per-key
calls; none for diagonal calls). A floored key's true logit is <= B - C - m * a <= B - C, and the row's true
log-sum-exp is >= its own diagonal logit q_i . k_i * scale >= -B_self (B_self = max_i |q_i| |k_i| * scale), so each
floored key's weight, floored or not, is <= e^(B + B_self - C) of the row's normalizer: over K keys the weights move
by at most K e^(B + B_self - C) in total, and the output by at most twice that times max |v|. With
C = B + B_self + ln K + `ROUNDING_NATS` that is <= 2 e^-18 max |v| < 2^-24 max |v|: below fp32 rounding (17 nats
would not do: 2 e^-17 > 2^-24). A head is floored only where then 2B + C <= `EXP_LIMIT`; any other head keeps its
exact bias (denormals possible, as before).

Backward. The autograd function differentiates each call with the same floored masks, so its gradients are the exact
gradients of the floored attention, whose softmax weights moved by at most 2 e^-18 of each row's mass in all. The
backward's `exp(s - l)` is taken at the row's final log-sum-exp l, in the true frame, which the floor alone does not
bound: on a per-key call the row shift m * a enters, and rows far into a chunk meet their far keys 87-104 nats down.
Those rows' weights over the call's keys are tiny: where a bound (|q_a| max |k| * scale, plus the call's largest
bias, less l) puts each below e^-18 / K, the row's l is +inf there, so the kernel's weights are exactly 0 and none is
computed (`backward_lse`): at most e^-18 more of a row's mass. With G_i = |dO_i| max |v| (dO the output's gradient),
the logits' gradients dS_ij = p_ij (dO_i . v_j - dO_i . o_i) then move by at most 8 e^-18 G_i per row in all (6 from
the weights, 2 from o_i), so dq_i by at most 8 e^-18 G_i max |k| * scale: the size of fp32's rounding of the sum
dq_i is made of (2^-24 sum_j |dS_ij| |k_j| * scale, with sum_j |dS_ij| up to 2 G_i), not 2^-24 of |dq_i| itself,
which is far smaller where a row's weights sit on one key. What the rows left at their l meet is not bounded by a
proof (l is the whole row's, not the call's); the float64 simulation of every call (`benchmarks/measure_denormals.py`)
counts it on real weights.

Check: `HF_HUB_OFFLINE=1 python -m pytest -q tests/models/alibi/test_attention_sdpa_split_floor.py`
"""

import math

import torch

from .attention_skip import upper_norms

# Every exp argument of a floored forward call stays >= -EXP_LIMIT. fp32's smallest normal is e^-87.34; the 7 nats
# between keep a weight's products with values of magnitude >= 1e-3 normal as well.
EXP_LIMIT = 80.0
# Floored keys' weights move by at most e^-ROUNDING_NATS of their row's normalizer in all, the output by twice that
# times max |v|: 2 e^-18 < 2^-24, fp32's rounding
ROUNDING_NATS = 18.0


def bias_floors(query, key, scaling: float, query_offset: int, keys: int, norms=None) -> torch.Tensor | None:
    """C per head (H,) float64 for the split's calls of `query` (B, H, q, D) over `key` (B, H, kv, D), +inf for a head
    that keeps its exact bias; None when no head is floored. Row r sits at `query_offset + r` (its own key there); `keys`
    is the most keys a row sees (K). `norms`: the `upper_norms` of `query` and `key` ((B, H, q), (B, H, kv)) where the
    caller has them already (None: computed here). Costs a norm of each query and key, no (q, kv) work."""
    visible = query_offset + query.shape[2]  # the keys the rows see
    with torch.no_grad():
        if norms is None:
            norms = upper_norms(query.detach()), upper_norms(key.detach()[:, :, :visible])
        query_norms, key_norms = norms[0].amax(0), norms[1][..., :visible].amax(0)  # (H, q), (H, kv) over the batch
        bound = query_norms.amax(-1) * key_norms.amax(-1) * scaling  # (H,) B >= |q_i . k_j| * scale
        own = (query_norms * key_norms[:, query_offset:]).amax(-1) * scaling  # (H,) B_self >= -(diagonal logit)
        floors = bound + own + math.log(max(keys, 1)) + ROUNDING_NATS  # (H,) C
        floors = floors.masked_fill(2 * bound + floors > EXP_LIMIT, torch.inf)
    return None if bool(floors.isinf().all()) else floors


def floored(mask: torch.Tensor, floors: torch.Tensor) -> torch.Tensor:
    """`mask` (1, h, n|1, keys) raised to -floors (h,) per head, its minimum entries (the causal upper triangle) kept."""
    raised = torch.maximum(mask, -floors.to(mask.dtype)[:, None, None])  # (1, h, n|1, keys)
    return raised.masked_fill_(mask == torch.finfo(mask.dtype).min, torch.finfo(mask.dtype).min)


def backward_lse(lse, query, key, mask, scaling: float, keys: int) -> torch.Tensor:
    """The log-sum-exp (c, h, n) a per-key call's backward takes, in its frame: +inf (weights exactly 0) on the rows
    whose weights over this call's keys are provably below e^-ROUNDING_NATS / K each, so the kernel computes none of
    their tiny weights. `query` (c, h, n, D) and `key` (c, h, keys, D) are the call's, `mask` its floored mask."""
    with torch.no_grad():
        bound = upper_norms(query) * upper_norms(key).amax(-1)[..., None] * scaling  # (c, h, n) >= q_a . k_j * scale
        largest = bound + mask.amax(-1).to(bound.dtype) - lse  # (c, h, n) >= every exp argument of the row
        negligible = largest < -(math.log(max(keys, 1)) + ROUNDING_NATS)
    return lse.masked_fill(negligible, math.inf)
