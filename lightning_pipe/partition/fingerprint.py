"""The structure of a model (every state-dict entry's name, shape and dtype), compared across ranks at setup.

Every rank builds the whole model and keeps its stage. Ranks that built different models (a size chosen per rank,
a randomly drawn architecture, a config file only some ranks read) would otherwise fail later with a shape error
far from its cause, or train a model that no single device would.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

from torch import nn

Fingerprint = list[tuple[str, tuple[int, ...], str]]


def model_fingerprint(model: nn.Module) -> Fingerprint:
    """``(name, shape, dtype)`` of every state-dict entry, in order (meta tensors have both: no data is read)."""
    state = model.state_dict()
    return [(name, tuple(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in state.items()]


def fingerprint_digest(fingerprint: Fingerprint) -> str:
    """A short digest, so that ranks compare a few bytes unless they differ."""
    return hashlib.sha256(repr(fingerprint).encode()).hexdigest()


def different_models_message(fingerprints: list[Fingerprint], describe_rank: Callable[[int], str]) -> str:
    """What differs between the first rank whose model differs from rank 0's and rank 0, and the fix."""
    reference = fingerprints[0]
    rank = next(rank for rank, fingerprint in enumerate(fingerprints) if fingerprint != reference)
    other = fingerprints[rank]
    ours = {name: (shape, dtype) for name, shape, dtype in reference}
    theirs = {name: (shape, dtype) for name, shape, dtype in other}
    here, there = describe_rank(rank), describe_rank(0)
    difference = next(
        (
            f"'{name}' is {_describe(theirs[name])} on {here} but {_describe(ours[name])} on {there}"
            for name, _, _ in reference
            if name in theirs and theirs[name] != ours[name]
        ),
        None,
    )
    if difference is None:
        missing = [name for name, _, _ in reference if name not in theirs]
        extra = [name for name, _, _ in other if name not in ours]
        if missing:
            difference = f"{here} lacks {missing[:3]} that {there} has"
        elif extra:
            difference = f"{here} has {extra[:3]} that {there} lacks"
        else:
            difference = f"{here} holds the same entries as {there} in another order"
    return (
        f"the ranks built different models: {difference}. Every rank builds the whole model and keeps its stage, so"
        " the model must come out the same on every rank: do not make its sizes or layers depend on the rank, on"
        " unseeded random numbers, or on files that only some ranks read."
    )


def _describe(entry: tuple[tuple[int, ...], str]) -> str:
    shape, dtype = entry
    return f"{dtype} of shape {shape}"
