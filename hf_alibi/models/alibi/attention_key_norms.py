"""The running key-norm summary a cache keeps for certified decoding (`sdpa_decode_certified`).

A decoding step certifies which far keys it may skip from an upper bound on the key norms of each block of
`KEY_BLOCK` cache positions (Cauchy-Schwarz, `attention_skip.py`). Recomputing those norms would read the whole cache
every step; `RunningKeyNorms` keeps them up to date as the cache grows, and `KeyNormSummaries` holds one per cache
for the model, without storing anything on transformers' objects.
"""

import weakref

import torch
from transformers import DynamicLayer, StaticLayer

from .attention_certified import KEY_BLOCK
from .attention_skip import upper_norms


class RunningKeyNorms:
    """Per layer, an upper bound on the key norms of each block of `KEY_BLOCK` cache positions, over the whole batch,
    kept up to date as a cache grows: a decoding step reads only the keys written since that layer's last step.

    The model tells it about every forward on its cache before the layers write (`note_write(query_offset,
    query_length)`, `query_offset` being the cache's length then); `self(layer, key, key_padding)` then folds in that
    layer's keys [covered, len(key)) and returns (1, H, blocks) float64. What keeps it an upper bound of the cache's
    keys (the premise N_K >= max |k_j| of Cauchy-Schwarz) is where each forward writes:
    - a forward at the offset the last one ended at (`written`) appends: keys [0, written) are as they were;
    - a smaller offset means the cache lost keys since (`reset()`: offset 0; `crop()`; a cache reused for another
      request): keys before the offset are still the ones folded in, so each layer keeps what it covered below the
      offset (the block straddling it also counted the lost keys: larger, still a bound) and folds the rest anew.
      This is the case the last key alone could not tell: a refill with the same token there reuses nothing;
    - a larger offset, or one a compiled graph cannot read (tracing), means keys were written unseen: forget all.
    transformers' other cache operations leave it a bound: `reorder_cache` (beam search), `batch_select_indices` and
    `batch_repeat_interleave` only select, permute or repeat rows, and the maximum over the batch bounds each of
    them; offloading moves keys without changing them. Padded keys are folded in too, so the bound holds whatever
    mask a later step passes (`key_padding` is not read). It trusts that keys enter the cache only through the
    model's forwards: a key written by hand (`cache.update`, another model, an in-place edit) is not seen, and a
    cache whose keys change as they age (a quantized cache) gets no summary (`for_forward`). The model keeps each
    cache's summary in its `KeyNormSummaries` (transformers' `Cache` has no place for a model's own state).
    """

    @classmethod
    def for_forward(cls, summaries: "KeyNormSummaries", cache, query_offset, query_length: int):
        """What a forward on `cache` hands `plan_alibi_attention` as `key_norms`, to be called before its layers write.

        The cache's summary in `summaries` (the model's), if it has one, is told of this forward's keys now, whether or
        not the forward skips. The function returned gives that summary, or makes a new one for a cache that has none.
        It gives None (the step summarises the whole cache afresh) for a cache that cannot be weakly referenced, or
        whose layers are not transformers' plain dynamic or static ones: a quantized cache's keys change as they age,
        unseen."""
        summary = summaries.find(cache)
        if summary is not None:
            summary.note_write(query_offset, query_length)
            return lambda: summary
        return lambda: cls._attach(summaries, cache, query_offset, query_length)

    @classmethod
    def _attach(cls, summaries: "KeyNormSummaries", cache, query_offset, query_length: int):
        layers = getattr(cache, "layers", None)
        if layers is None or getattr(cache, "layer_class_to_replicate", None) not in (None, DynamicLayer):
            return None
        if any(type(layer) not in (DynamicLayer, StaticLayer) for layer in layers):
            return None
        summary = cls(written=int(query_offset) + query_length)  # this forward's keys are its first
        try:
            summaries[cache] = summary
        except TypeError:  # no weak reference to this cache: nowhere to keep a summary
            return None
        return summary

    def __init__(self, written: int | None = None):
        self.written = written  # where the last noted forward's keys end; None: unknown, the next forward forgets
        self.layers = {}  # layer -> (norms (1, H, blocks) float64, keys covered)

    def note_write(self, query_offset, query_length: int) -> None:
        """A forward is about to write `query_length` keys into every layer at `query_offset` (the cache length)."""
        if torch.compiler.is_compiling():  # a graph must not branch on the offset, a 0-d tensor in a static cache
            self.layers, self.written = {}, None
            return
        query_offset = int(query_offset)  # a static cache counts in a 0-d tensor; only a cache with a summary reads it
        if self.written is None or query_offset > self.written:  # keys appended unseen: trust none of the summary
            self.layers = {}
        elif query_offset < self.written:  # keys dropped (reset, crop): keep what lies before the offset
            self.layers = {
                layer: (norms[..., : -(-min(covered, query_offset) // KEY_BLOCK)], min(covered, query_offset))
                for layer, (norms, covered) in self.layers.items()
            }
        self.written = query_offset + query_length

    def __call__(self, layer, key: torch.Tensor, key_padding: torch.Tensor | None = None) -> torch.Tensor:
        length = key.shape[2]
        norms, covered = self.layers.get(layer, (None, 0))
        if norms is None or covered > length:  # first call, or a caller that did not note its writes: start over
            norms, covered = key.new_full((1, key.shape[1], 0), -torch.inf, dtype=torch.float64), 0
        if length == covered + 1:  # one new key, the common step: fold it in, in a few operations
            new = upper_norms(key[:, :, covered]).amax(0)[None, :, None]  # (1, H, 1)
            if covered % KEY_BLOCK == 0:  # it opens a block
                norms = torch.cat([norms, new], dim=-1)  # (1, H, blocks)
            else:
                torch.maximum(norms[..., -1:], new, out=norms[..., -1:])  # the summary is this object's own
        elif length > covered:
            blocks = -(-length // KEY_BLOCK)
            grown = norms.new_full((1, key.shape[1], blocks), -torch.inf)  # (1, H, blocks)
            grown[..., : norms.shape[-1]] = norms
            new = upper_norms(key[:, :, covered:]).amax(0, keepdim=True)  # (1, H, n)
            index = (torch.arange(covered, length, device=key.device) // KEY_BLOCK).expand(1, key.shape[1], -1)
            norms = grown.scatter_reduce_(2, index, new, "amax")  # (1, H, blocks)
        self.layers[layer] = (norms, length)
        return norms


class KeyNormSummaries(weakref.WeakKeyDictionary):
    """A model's `RunningKeyNorms`, one per cache it has decoded with skipping, keyed weakly by the cache: a summary
    lives as long as its cache and no longer, and nothing is stored on transformers' objects. A summary is a memo (a
    cache without one is summarised afresh from its keys), so a copied or pickled model starts with none, and so does
    a copied cache."""

    def find(self, cache) -> RunningKeyNorms | None:
        """`cache`'s summary, or None (no cache, none yet, or a cache that cannot be weakly referenced)."""
        if cache is None:
            return None
        try:
            return self.get(cache)
        except TypeError:
            return None

    def __reduce__(self):
        return type(self), ()

    def __deepcopy__(self, memo):
        return type(self)()
