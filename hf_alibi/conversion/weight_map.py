"""One declarative weight map per family, applied both ways: import (theirs -> ours) and export (ours -> theirs).

A map is a tuple of `Entry(ours, theirs, transform)`, one per tensor; `{i}` in a key stands for every block index.
A `Transform` pairs a tensor map with its exact inverse (a transpose, a permutation of rows), so exporting what was
imported gives back the original tensors bit for bit by construction. `map_weights` applies a map in either
direction and refuses a state dict that does not use every key of the map exactly once, or has keys left over.
"""

from collections import Counter
from collections.abc import Callable
from functools import partial
from typing import Literal, NamedTuple

import torch


class Transform(NamedTuple):
    """A tensor map (`to_ours`, on import) and its exact inverse (`to_theirs`, on export)."""

    to_ours: Callable[[torch.Tensor], torch.Tensor]
    to_theirs: Callable[[torch.Tensor], torch.Tensor]

    def then(self, other: "Transform") -> "Transform":
        """This transform, then `other`, on import; on export `other`'s inverse runs first."""
        return Transform(lambda t: other.to_ours(self.to_ours(t)), lambda t: self.to_theirs(other.to_theirs(t)))


def _same(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


IDENTITY = Transform(_same, _same)
TRANSPOSE = Transform(torch.t, torch.t)  # nn.Linear (out, in) <-> Conv1D (in, out): exact, its own inverse


def interleaved_to_grouped(fused: torch.Tensor, n_head: int) -> torch.Tensor:
    """BLOOM/Falcon fused qkv rows `[h, 3, d]` (per head: q, k, v) -> ours `[3, h, d]` (all q, all k, all v).

    Works on a weight `(3C, C)` and a bias `(3C,)` alike: only the first dimension is permuted.
    """
    rest = fused.shape[1:]
    return fused.reshape(n_head, 3, -1, *rest).transpose(0, 1).reshape(fused.shape)  # (3C, ...)


def grouped_to_interleaved(fused: torch.Tensor, n_head: int) -> torch.Tensor:
    """The inverse of `interleaved_to_grouped`: ours `[3, h, d]` -> BLOOM/Falcon `[h, 3, d]`."""
    rest = fused.shape[1:]
    return fused.reshape(3, n_head, -1, *rest).transpose(0, 1).reshape(fused.shape)  # (3C, ...)


def per_head_qkv(n_head: int) -> Transform:
    """BLOOM/Falcon's fused qkv, interleaved per head, <-> ours grouped `[q | k | v]` (a permutation of rows)."""
    return Transform(partial(interleaved_to_grouped, n_head=n_head), partial(grouped_to_interleaved, n_head=n_head))


class Entry(NamedTuple):
    """One tensor: our key, their key (`{i}`: every block index) and how its values change on the way."""

    ours: str
    theirs: str
    transform: Transform = IDENTITY


class _Step(NamedTuple):
    """One entry at one block index, in one direction."""

    read: str
    written: str
    apply: Callable[[torch.Tensor], torch.Tensor]


WeightMap = tuple[Entry, ...]
StateDict = dict[str, torch.Tensor]
Direction = Literal["ours", "theirs"]  # "ours": import (read their keys, write ours); "theirs": export


def map_weights(entries: WeightMap, state: StateDict, n_layer: int, *, to: Direction, what: str) -> StateDict:
    """`state` (their state dict when `to="ours"`, ours when `to="theirs"`) with every key renamed and transformed.

    `ValueError` naming the keys (after `what`, e.g. "bloom -> alibi_gpt2") when the map names a key twice on
    either side, when `state` lacks a key the map reads, or when `state` has a key the map does not read.
    """
    if to not in ("ours", "theirs"):
        raise ValueError(f"to must be 'ours' or 'theirs', got {to!r}")
    steps = []
    for entry in entries:
        for i in range(n_layer) if "{i}" in entry.ours + entry.theirs else (None,):
            ours, theirs = entry.ours.format(i=i), entry.theirs.format(i=i)
            steps.append(
                _Step(theirs, ours, entry.transform.to_ours)
                if to == "ours"
                else _Step(ours, theirs, entry.transform.to_theirs)
            )
    for side in ("read", "written"):
        twice = sorted(key for key, count in Counter(getattr(step, side) for step in steps).items() if count > 1)
        if twice:
            raise ValueError(f"{what}: the weight map has keys {side} more than once: {twice}")
    missing = [step.read for step in steps if step.read not in state]
    unused = sorted(set(state) - {step.read for step in steps})
    if missing or unused:
        raise ValueError(f"{what}: weights do not line up with the weight map: missing {missing}, unused {unused}")
    return {step.written: step.apply(state[step.read]) for step in steps}
