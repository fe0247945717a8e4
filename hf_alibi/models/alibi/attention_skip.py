"""Certified key skipping for causal ALiBi: which far keys a query row may drop with softmax mass <= eps, proven.

Setting. Query row i (absolute position), head h with slope m >= 0, scale s: the logit of a visible key j <= i is
z_ij = s q_i.k_j - m (i - j), and the row's softmax weight is p_ij = exp(z_ij - LSE_i), LSE_i = log sum_j exp(z_ij)
over the row's visible keys V_i (causal, not padding, same document). Dropping the keys j < t changes the row.

Theorem 1 (what dropping costs). Let d = sum_{j in V_i, j < t} p_ij be the dropped mass and o' the softmax output over
the kept keys. Then o = (1 - d) o' + d o_d, o_d the dropped keys' weighted mean value, so o - o' = d (o_d - o') and
every coordinate moves by at most d (max v - min v) <= 2 d max|v|. Certifying d <= eps is therefore enough.

Theorem 2 (a lower bound on LSE_i). For any subset N of V_i, LSE_i >= log sum_{j in N} exp(z_ij), since every term is
positive. The diagonal j = i is visible to every real row (its own token is real and in its own document), so
N = {i} gives LSE_i >= s q_i.k_i (`diagonal_lse`; the `near` nearest keys are tighter and cost O(L near D): a research
variant, measured in `benchmarks/skip_research.py`, not shipped).
Padded keys are left out of N: they are not in V_i, and Theorem 3 does not count them either.

Theorem 3 (an upper bound on a key block's mass). Let K = [a, e] be keys that all lie before t <= i, and
U_iK >= s q_i.k_j for every real j in K. Since i - j >= i - e for j <= e and m >= 0,
    sum_{j in K, j real} exp(z_ij) <= exp(U_iK - m (i - e)) sum_{d=0}^{|K|-1} exp(-m d) = exp(U_iK - m (i - e)) G,
G = (1 - e^{-m |K|}) / (1 - e^{-m}) (|K| when m = 0), the geometric sum: it replaces the crude |K| by ~1/m for
steep heads. The shipped U_iK is Cauchy-Schwarz, s q.k_j <= |s| |q_i| N_K with N_K = max_j |k_j| (a centred bound
about each block's mean key changes little on the checkpoints measured in results/skip/kept_fraction.md; it lives in
`benchmarks/skip_research.py`). A block without real keys has mass 0.

Together: d_i(t) <= sum_{K before t} exp(U_iK - m (i - e_K) + log G - LB_i) =: B_i(t), LB_i from Theorem 2. B_i(t) is
nondecreasing in t, so the largest block boundary t with B_i(t) <= eps is found by a cumulative log-sum-exp over
blocks. Dropped keys are a subset of those bounded: masks (padding, documents) only remove visible keys, so ignoring
them in the upper bound (summing over a superset) stays valid; padded keys are left out of the block summaries,
which is also valid because their true mass is 0. A query row block's start is the minimum over its real rows (and
the batch): padded query rows have no real diagonal and a meaningless output, so they are ignored.

The far blocks at once (linear cost). For the blocks K < lo, all of width B and ending at e_K = (K + 1) B - 1, every
N_K <= N* = max_{K < lo} N_K, so their terms sum to at most exp(|s| |q_i| N* - m i + log G - LB_i) sum_{K < lo}
e^{m e_K} = exp(|s| |q_i| N* - m (i - e_{lo-1}) + log G - LB_i) (1 - e^{-m B lo}) / (1 - e^{-m B}) (lo times the
first factor when m = 0). So B_i(t) <= T_i + sum_{lo <= K < t} (term_K) for t >= lo, with T_i that tail bound: a start
certified with it is certified. Each head picks lo = (row block's first key block) - w with w its reach, the fewest
blocks that make T_i < eps 2^-20 for every row with the largest key norm of the input (`attention_skip_terms._reach`):
w depends on the slope and the norms, not on the length, so the work is O(L w) per head, and the start differs from
the all-blocks sum's only where that sum lies within eps 2^-20 of eps.

Packed documents need no mask at all, even in N. Row i of the document starting at s sees V_i = [s, i] (less padding).
Let A be the part of sum_{j in N} exp(z_ij) from other documents' keys, all at j < s. If t <= s, no visible key is
dropped. If t > s, those keys lie before t and are real, so the certified sum over [0, t) counts them: with D_v the
visible dropped sum, D_v + A <= eps (sum_{N visible} exp(z_ij) + A) <= eps (e^{LSE_i} + A), hence D_v <= eps e^{LSE_i}
- (1 - eps) A <= eps e^{LSE_i}. Ignoring documents is thus valid and tighter than masking them (a larger LB_i). This
uses that documents are contiguous spans (packing by restarting positions or cu_seq_lens); padding is different:
padded keys are left out of Theorem 3's sums, so they must be left out of N too.

Theorem 4 (a kernel's log-sum-exp as LB_i). Theorem 2 holds for any subset N of V_i, e.g. the keys of row i's own
diagonal block, whose exact LSE l_i an attention kernel computes anyway. A float32 kernel returns an approximation
l^_i; with unit roundoff u = 2^-24 and gamma_n = n u / (1 - n u) (Higham), each logit of N is computed within
gamma_{D+2} (|s| |q_i| |k_j| + m n) of the exact one (a length-D dot product, the scale and the bias add; |bias| <=
m n on n keys), and the max-shifted exps (relative error <= rho for a vectorised exp), their sum over n keys and the
log add at most 2 (gamma_{n+2} + rho). So |l^_i - l_i| <= delta_i := gamma_{D+2} (|s| |q_i| N + m n) + 2 (gamma_{n+2}
+ rho), N the largest key norm, and LB_i = l^_i - 4 delta_i <= l_i <= LSE_i (`kernel_lse_lower_bound`: a factor of 4
for what the analysis misses, ~1e-4 nats in all). Padded keys enter the kernel at the dtype's minimum and add
exactly 0. When N is several calls' keys (a block's diagonal and the keys right before it), l^_i is their
log-sum-exps shifted to the true frame and merged by fp32 `logaddexp`s: each of those roundings is within a few u |l|,
which `kernel_lse_lower_bound` adds to delta_i as 4 u |l^_i| (n then counts all of N's keys). On the demo checkpoint
at 8k this LB (256-row diagonal blocks) certifies 0.382 of causal work against 0.399 with the diagonal logit alone,
and costs nothing: the split computes those blocks first (`certified_split`), and the 256 keys before each block for
the heads that keep them anyway, which brings it near the exact log-sum-exp's bound.

Cost. Norms O(L H D); per (group of rows, key block within the head's reach) one bound, the blocks further back
bounded at once by a geometric tail (`attention_skip_terms._grouped_starts`): O(L (reach / block) H) exps, linear in
L. Norms are computed in the inputs' precision (at least float32) and rounded up by their error bound
(`upper_norms`); everything else is float64, so the certificate holds for exact arithmetic on the inputs as given;
`attention_skip_terms._ROUNDING_MARGIN` absorbs float64's own rounding. (The max shift of Theorem 4's
exps adds at most u |z_j - max z| <= u (2 |s| |q_i| N + m n) per logit, inside its gamma_{D+2} term for D >= 1.)

Bidirectional rows (an encoder's -m |i - j| over every key). Reversed, the keys right of row i are the keys left of
its mirror at the same distances, so the causal bound of the reversed queries and keys certifies them
(`attention_certified.certified_key_ends`); with eps / 2 on each side the dropped mass is <= eps, and Theorem 1 holds.

Decoding. A full cache block never changes, so its summary (max norm) is computed once; the block
being filled always contains the current position and is never dropped, so a running maximum of its norms (what a
cache extends step by step: `torch.maximum(old, new_norm)`) is all it needs before it completes.
"""

import math
from dataclasses import dataclass

import torch

from .attention_skip_terms import _block_decay, _grouped_starts, _passing_blocks


@dataclass(frozen=True, eq=False)
class KeyRanges:
    """The first key each (head, block of `rows` queries) attends to: keys before it are skipped (and for an
    encoder's bidirectional rows the end key: keys from it on are skipped too).

    `first_key` is (H, ceil(q / rows)) int64 of absolute key indices; block `b` covers query rows
    [b * rows, (b + 1) * rows). A block's first key never lies past the block's first query position, so every row
    keeps at least its own diagonal block. All-zero ranges are dense attention.
    """

    rows: int
    first_key: torch.Tensor  # (H, blocks) int64
    end_key: torch.Tensor | None = None  # (H, blocks) int64: a bidirectional block's keys from it on are skipped


def _check_eps(eps: float) -> None:
    if not 0.0 <= eps < 1.0:
        raise ValueError(f"eps must lie in [0, 1), got {eps!r}")


def _check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_slopes(slopes: torch.Tensor, heads: int) -> None:
    if slopes.shape != (heads,):
        raise ValueError(f"slopes must have shape ({heads},), got {tuple(slopes.shape)}")
    if bool((slopes < 0).any()):
        raise ValueError(f"slopes must be >= 0 (the bound uses -m (i - j) <= -m (i - e)), got {slopes.tolist()}")


def _real_keys(key: torch.Tensor, key_padding: torch.Tensor | None) -> torch.Tensor:
    """(B|1, 1, kv) bool: which keys are real."""
    if key_padding is None:
        return torch.ones(1, 1, key.shape[2], dtype=torch.bool, device=key.device)
    if key_padding.shape != (key.shape[0], key.shape[2]):
        raise ValueError(f"key_padding must have shape {(key.shape[0], key.shape[2])}, got {tuple(key_padding.shape)}")
    return key_padding[:, None, :].bool()


def _blocked(tensor: torch.Tensor, block: int, fill) -> torch.Tensor:
    """(B, H, n, ...) -> (B, H, ceil(n / block), block, ...), the last block filled up with `fill`."""
    pad = -tensor.shape[2] % block
    if pad:
        tail = tensor.new_full((*tensor.shape[:2], pad, *tensor.shape[3:]), fill)
        tensor = torch.cat([tensor, tail], dim=2)
    return tensor.unflatten(2, (tensor.shape[2] // block, block))


def upper_norms(tensor: torch.Tensor) -> torch.Tensor:
    """Float64 upper bounds on the Euclidean norms along the last dim of `tensor` (..., D): computed in its own
    precision (at least float32), whose relative error is at most gamma_{D+2} (a sum of D squares and a square root,
    in any order), then multiplied by 1 + 2 gamma_{D+2}. A float32 norm costs a sixth of a float64 copy and norm."""
    dtype = torch.promote_types(tensor.dtype, torch.float32)
    return tensor.to(dtype).norm(dim=-1).double() * (1 + 2 * _gamma(tensor.shape[-1] + 2, torch.finfo(dtype).eps / 2))


def _gamma(n: int, unit: float) -> float:
    """Higham's gamma_n = n u / (1 - n u): the relative error bound of n roundings with unit roundoff u."""
    return n * unit / (1 - n * unit)


def key_block_norms(
    key: torch.Tensor, block: int, key_padding: torch.Tensor | None = None, norms: torch.Tensor | None = None
) -> torch.Tensor:
    """N_K >= max |k_j| over the real keys of each `block` of `key` (B, H, kv, D): float64 (B, H, ceil(kv / block)).

    -inf for a block without real keys (its mass is 0). A cache extends the last block with a running maximum.
    `norms` (B, H, >= kv): `upper_norms(key)` (or of a longer key tensor) when the caller has them already.
    """
    _check_positive("block", block)
    norms = upper_norms(key) if norms is None else norms[:, :, : key.shape[2]]  # (B, H, kv)
    norms = norms.masked_fill(~_real_keys(key, key_padding), -math.inf)  # (B, H, kv)
    return _blocked(norms, block, -math.inf).amax(-1)  # (B, H, nb)


def diagonal_lse(
    query: torch.Tensor,
    key: torch.Tensor,
    scaling: float,
    query_offset: int,
    key_padding: torch.Tensor | None = None,
) -> torch.Tensor:
    """LB_i of Theorem 2 with N = {i}: each row's diagonal logit s q_i.k_i in float64, (B, H, q).

    `query` (B, H, q, D) row r at absolute position `query_offset + r`; `key` (B, H, kv, D); `key_padding` (B, kv)
    True = real. -inf on padded rows (their own token is padding: no certificate). The diagonal's bias is 0.
    """
    q_len = query.shape[2]
    keys = slice(query_offset, query_offset + q_len)
    lse = (query.double() * scaling * key[:, :, keys].double()).sum(-1)  # (B, H, q)
    return lse.masked_fill(~_real_keys(key, key_padding)[:, 0, None, keys], -math.inf)


def key_starts_inputs(query, key, slopes, query_offset, eps, row_block, key_block, row_group, key_padding, lse_lower):
    """`certified_key_starts`' inputs checked: (the number of row blocks, the number of key blocks that may be
    dropped: those wholly before the last row block)."""
    _check_eps(eps)
    _check_positive("row_block", row_block)
    _check_positive("key_block", key_block)
    _check_positive("row_group", row_group)
    batch, heads, q_len, dim = query.shape
    if key.dim() != 4 or key.shape[:2] != (batch, heads) or key.shape[3] != dim:
        raise ValueError(f"key {tuple(key.shape)} does not fit query {tuple(query.shape)}")
    if not 0 <= query_offset <= key.shape[2] - q_len:
        raise ValueError(f"query_offset={query_offset} must lie in [0, kv - q] = [0, {key.shape[2] - q_len}]")
    _check_slopes(slopes, heads)
    _real_keys(key, key_padding)  # checks its shape
    if lse_lower is not None and lse_lower.shape != (batch, heads, q_len):
        raise ValueError(f"lse_lower must have shape {(batch, heads, q_len)}, got {tuple(lse_lower.shape)}")
    n_row_blocks = -(-q_len // row_block)
    return n_row_blocks, (query_offset + (n_row_blocks - 1) * row_block) // key_block


def certified_key_starts(
    query: torch.Tensor,
    key: torch.Tensor,
    slopes: torch.Tensor,
    scaling: float,
    query_offset: int,
    eps: float,
    row_block: int,
    key_block: int,
    key_padding: torch.Tensor | None = None,
    row_group: int = 1,
    lse_lower: torch.Tensor | None = None,
    query_norms: torch.Tensor | None = None,
    key_norms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per (head, block of `row_block` query rows): the first key a kernel must compute, int64 (H, n_row_blocks).

    `query` (B, H, q, D), row r at absolute position `query_offset + r`; `key` (B, H, kv, D) (keys from
    `query_offset + q` on are never read); `slopes` (H,) >= 0; `key_padding` (B, kv) True = real. Packed rows need no
    document mask: the starts hold for them as they are (module docstring). The start is a multiple of `key_block`
    and never past the row block's first position, so the diagonal is always computed; for every batch element and
    every real row of the block the softmax mass of the visible keys before it is <= `eps` (0 = dense).
    `lse_lower` (B, H, q) is any valid lower bound on each real row's LSE (`kernel_lse_lower_bound`); None: the
    diagonal logit (`diagonal_lse`). `query_norms` (B, H, q) and `key_norms` (B, H, >= kv'): `upper_norms` of
    `query` and `key`, if already computed. The bound (Cauchy-Schwarz) is computed for groups of `row_group` rows at
    once (`_grouped_starts`): valid, a little looser, and `row_group` times less work; 1 is every row on its own.
    """
    n_row_blocks, usable = key_starts_inputs(
        query, key, slopes, query_offset, eps, row_block, key_block, row_group, key_padding, lse_lower
    )
    if eps == 0.0 or usable == 0:
        return torch.zeros(query.shape[1], n_row_blocks, dtype=torch.long, device=query.device)
    padding = None if key_padding is None else key_padding[:, : usable * key_block]
    norms = key_block_norms(key[:, :, : usable * key_block], key_block, padding, key_norms)  # (B, H, nb)
    lse = diagonal_lse(query, key, scaling, query_offset, key_padding) if lse_lower is None else lse_lower.double()
    a = (upper_norms(query) if query_norms is None else query_norms) * abs(scaling)  # (B, H, q)
    return _grouped_starts(a, lse, norms, slopes, query_offset, eps, row_block, key_block, key_padding, row_group)


# rho of Theorem 4: the relative error of a kernel's vectorised exp (PyTorch's CPU flash kernel uses a few-ULP one)
_KERNEL_EXP_ERROR = 2.0**-20


def kernel_lse_lower_bound(
    lse: torch.Tensor,
    query_norms: torch.Tensor,
    key_norm_max: torch.Tensor,
    slopes: torch.Tensor,
    scaling: float,
    keys: int,
    dim: int,
) -> torch.Tensor:
    """Theorem 4: LB_i = l^_i - 4 delta_i from a float32 kernel's log-sum-exp `lse` (B, H, q) of each row over at most
    `keys` of its visible keys, one call's or several calls' merged (with the ALiBi bias; padded keys at the dtype's
    minimum), head dim `dim`.
    `query_norms` (B, H, q) bound the norms of the queries the kernel was given (`upper_norms`), `key_norm_max`
    (B|1, H) those of its keys. Returns float64 (B, H, q)."""
    _check_positive("keys", keys)
    unit = 2.0**-24  # the kernel's arithmetic is float32 whatever its inputs (bf16 and fp16 inputs are exact in it)
    m = slopes.double().to(lse.device)[:, None]  # (H, 1)
    logits = query_norms.double() * abs(scaling) * key_norm_max.double()[..., None] + m * keys  # (B, H, q)
    merges = 4 * unit * lse.double().abs()  # (B, H, q) the shifts and logaddexps that merged several calls' l
    delta = _gamma(dim + 2, unit) * logits + 2 * (_gamma(keys + 2, unit) + _KERNEL_EXP_ERROR) + merges  # (B, H, q)
    return lse.double() - 4 * delta


def decode_inputs(query, block_norms, slopes, query_offset, eps: float, block: int, lse_lower):
    """A decoding step's certificate inputs checked: (query (B, H, 1, D), lse_lower (B, H, 1), the number of key
    blocks wholly before the current position's block)."""
    _check_eps(eps)
    _check_positive("block", block)
    query = query[:, :, None] if query.dim() == 3 else query  # (B, H, 1, D)
    if query.dim() != 4 or query.shape[2] != 1:
        raise ValueError(f"query must be (B, H, D) or (B, H, 1, D), got {tuple(query.shape)}")
    _check_slopes(slopes, query.shape[1])
    batch, heads = query.shape[:2]
    if block_norms.dim() != 3 or block_norms.shape[1] != heads or block_norms.shape[0] not in (1, batch):
        raise ValueError(f"block_norms {tuple(block_norms.shape)} does not fit query {tuple(query.shape)}")
    if isinstance(query_offset, bool) or not isinstance(query_offset, int) or query_offset < 0:
        raise ValueError(f"query_offset must be a non-negative integer, got {query_offset!r}")
    lse_lower = lse_lower.reshape(*query.shape[:2], 1)  # (B, H, 1)
    n = min(query_offset // block, block_norms.shape[-1])  # blocks wholly before the current position's block
    return query, lse_lower, n


def certified_decode_start(
    query: torch.Tensor,
    block_norms: torch.Tensor,
    slopes: torch.Tensor,
    scaling: float,
    query_offset: int,
    eps: float,
    block: int,
    lse_lower: torch.Tensor,
) -> torch.Tensor:
    """First key one decoding step must compute, per batch element and head: int64 (B, H); `.amin(0)` per head.

    `query` (B, H, D) or (B, H, 1, D) at absolute position `query_offset`; `block_norms` (B, H, nb) from
    `key_block_norms` of the cache (a running maximum for the block being filled); `lse_lower` (B, H) or (B, H, 1) a
    lower bound on the row's LSE (the diagonal logit: `diagonal_lse`). The start is a multiple of `block` and
    <= `query_offset`. Cauchy-Schwarz (Theorem 3), in the few operations a step affords.
    """
    query, lse_lower, n = decode_inputs(query, block_norms, slopes, query_offset, eps, block, lse_lower)
    if eps == 0.0 or n == 0:
        return torch.zeros(query.shape[:2], dtype=torch.long, device=query.device)
    m, decay = _block_decay(tuple(slopes.tolist()), block, n, str(query.device))  # (H, 1), (H, n)
    # |s| |q|, kept > 0: a block without real keys has norm -inf and must give -inf, never 0 * -inf = NaN (a larger
    # factor only loosens the bound on real blocks, whose norms are >= 0)
    a = (upper_norms(query[:, :, 0]) * abs(scaling)).clamp(min=1e-300)  # (B, H)
    terms = a[..., None] * block_norms[..., :n] + decay + (-m * query_offset - lse_lower)  # (B, H, n)
    return _passing_blocks(terms, eps) * block  # (B, H)
