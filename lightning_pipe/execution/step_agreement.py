"""The step a stage is about to run, as its neighbours must run it too: which loop and batch, the batch's shapes and
dtypes, and how many batches the loop has; compared where a stage receives its first message of a step.

Every stage of a pipeline runs the user's step on its own copy of the batch, so the data loaders of one pipeline must
give every stage the same batches. Where they do not (a sampler that deals batches by global rank, a dataset built
from the rank), the stages would compute on different batches, or one rank would enter a step that the others never
enter and wait for them in a collective that does not match theirs (gloo then aborts the process). So the sending
stage puts its step's :class:`StepSignature` in the header of its first message of each step
(:class:`~lightning_pipe.execution.p2p.Header`), and the receiving stage compares it with its own before it uses the
message: the check rides on messages sent anyway and costs a few microseconds per step.

A rank with an extra batch is refused in the first step of the epoch where the loaders have a length (their batch
counts differ), else in the last step that both ranks run: Lightning's fetcher knows that a batch is the loader's last
before the step runs, so the stage whose loader ends there and the one whose loader goes on disagree on it.
"""

from __future__ import annotations

import functools
import math
import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

# The steps a pipeline runs, in the order their codes go into a message header.
STEP_HOOKS = ("training_step", "validation_step", "test_step", "predict_step")
_LOOPS = {"training_step": "training", "validation_step": "validation", "test_step": "test", "predict_step": "predict"}
_LISTED_ITEMS = 16  # a longer list of plain values (strings) is described by its length and first item's type

USUAL_CAUSES = (
    " Every stage of a pipeline must get the same batches in the same order. The usual causes: a sampler that does"
    " not deal the batches the same way on every rank (a DistributedSampler made by hand over every rank; Lightning's"
    " own deals them to the pipeline's replicas only, so that its stages get the same ones), or a dataset or batch size"
    " built differently per rank (from the rank, a random split without a common seed, files listed per host)."
)


class PipelineMismatchError(RuntimeError):
    """The stages of one pipeline disagree about what happens in a step."""


class StepMismatchError(PipelineMismatchError):
    """Two neighbouring stages of a pipeline are about to run different steps, or the same step on different batches."""


TensorShape = tuple[tuple[int, ...], torch.dtype | None]  # a tensor of the batch: its shape and dtype (None: unknown)


@dataclass(slots=True)  # made once per step: slots make that cheaper
class StepSignature:
    """What one stage's step is about: ``hook`` (``"training_step"``, ...) of ``dataloader`` on batch
    ``batch_index``; ``batches``: how many batches the loop runs on this rank (``None``: the loader has no length);
    ``last``: whether this batch is the loop's last here (``None``: not known); ``fingerprint``: of the batch's
    structure, shapes and dtypes; ``tensors``: the batch's tensors in order (``None``: not known, e.g. a receiver's
    copy of a signature whose tensors did not fit a message's header); ``batch``: this rank's, for errors (none in a
    received signature)."""

    hook: str
    batch_index: int
    dataloader: int = 0
    batches: int | None = None
    last: bool | None = None
    fingerprint: int = 0
    tensors: tuple[TensorShape, ...] | None = None
    batch: Any = field(default=None, compare=False, repr=False)  # this rank's batch (none in a received signature)

    @property
    def step(self) -> str:
        """``"training batch 3"``, as errors name the step."""
        where = f" of dataloader {self.dataloader}" if self.dataloader else ""
        return f"{_LOOPS.get(self.hook, self.hook)} batch {self.batch_index}{where}"

    @property
    def shapes(self) -> str:
        """The batch's tensors, ``"(16, 12) float32, (16,) int64"``."""
        if self.tensors is None:
            return "a batch whose tensors did not fit the message header"
        if not self.tensors:
            return "a batch without tensors"
        return ", ".join(f"{shape} {str(dtype).removeprefix('torch.') if dtype else '?'}" for shape, dtype in self.tensors)


# A header's signature part: its first entry says what follows. A later message of a step carries none (NONE): only a
# step's first message from a stage is compared.
NONE, SIGNED, OMITTED = 0, 1, 2  # OMITTED: in a step, but the activation left no room in the header for the signature
_FIXED_ENTRIES = 8  # flag, hook, dataloader, batch index, batches, last, fingerprint, count of tensors
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool, torch.complex64, torch.complex128,
)
_DTYPE_CODES = {dtype: code for code, dtype in enumerate(_DTYPES)}
UNCHECKED = object()  # a sender's signature that did not fit its message's header: nothing to compare


def encode_signature(signature: StepSignature | None, room: int) -> list[int]:
    """``signature`` as at most ``room`` header entries (its tensors only where they fit)."""
    if signature is None:
        return [NONE]
    if room < _FIXED_ENTRIES:
        return [OMITTED]
    last = -1 if signature.last is None else int(signature.last)
    batches = -1 if signature.batches is None else signature.batches
    values = [SIGNED, STEP_HOOKS.index(signature.hook), signature.dataloader, signature.batch_index, batches, last,
              signature.fingerprint]
    tensors = [n for shape, dtype in signature.tensors or () for n in (_DTYPE_CODES.get(dtype, -1), len(shape), *shape)]
    fits = signature.tensors is not None and len(values) + 1 + len(tensors) <= room
    return values + ([len(signature.tensors), *tensors] if fits else [-1])  # type: ignore[arg-type]


def decode_signature(values: list[int]) -> StepSignature | None | object:
    """The signature that :func:`encode_signature` wrote at the start of ``values`` (``None``: none was sent;
    :data:`UNCHECKED`: one did not fit)."""
    if values[0] != SIGNED:
        return UNCHECKED if values[0] == OMITTED else None
    hook, dataloader, batch_index, batches, last, fingerprint, count = values[1:_FIXED_ENTRIES]
    tensors: list[TensorShape] | None = None
    if count >= 0:
        tensors, pos = [], _FIXED_ENTRIES
        for _ in range(count):
            code, ndim = values[pos : pos + 2]
            tensors.append((tuple(values[pos + 2 : pos + 2 + ndim]), _DTYPES[code] if code >= 0 else None))
            pos += 2 + ndim
    return StepSignature(
        STEP_HOOKS[hook], batch_index, dataloader, None if batches < 0 else batches, None if last < 0 else bool(last),
        fingerprint, None if tensors is None else tuple(tensors),
    )


def step_signature(
    hook: str, batch: Any, batch_index: int, dataloader: int = 0, batches: int | None = None, last: bool | None = None
) -> StepSignature:
    """The signature of a step of ``hook`` on ``batch`` (see :class:`StepSignature`)."""
    tensors: list[TensorShape] = []
    tokens: list[int] = []
    _walk(batch, tensors, tokens)
    # NOTE: a tuple of ints hashes alike in every process (strings do not: Python salts their hashes per process).
    return StepSignature(hook, batch_index, dataloader, batches, last, hash(tuple(tokens)), tuple(tensors), batch)


def step_signature_of(module: Any, hook: str, args: tuple, kwargs: dict) -> StepSignature | None:
    """The signature of the step Lightning runs now: ``hook(*args, **kwargs)`` of ``module`` (the batch, its index and
    the dataloader's as Lightning passes them), with the loop's length and whether this batch is its last, from the
    trainer's loops. ``None`` outside a trainer's loop (a step called by hand)."""
    if hook not in STEP_HOOKS or not (args or "batch" in kwargs):
        return None
    batch = args[0] if args else kwargs["batch"]
    dataloader = int(args[2] if len(args) > 2 else kwargs.get("dataloader_idx", 0))
    index, batches, last = loop_position(getattr(module, "_trainer", None), hook, dataloader)
    # A step that takes no batch_idx gets none from Lightning: its loop's count then names the batch.
    batch_index = int(args[1] if len(args) > 1 else kwargs.get("batch_idx", index))
    return step_signature(hook, batch, batch_index, dataloader, batches, last)


def loop_position(trainer: Any, hook: str, dataloader: int = 0) -> tuple[int, int | None, bool | None]:
    """Where the trainer's loop of ``hook`` (on ``dataloader``) is: the index of the batch of the step now (-1: not
    known), how many batches the loop runs, and whether this batch is its last (``None`` where not known: no trainer,
    a loader without a length, a loop Lightning keeps elsewhere)."""
    if trainer is None:
        return -1, None, None
    try:
        if hook == "training_step":
            loop, counts = trainer.fit_loop.epoch_loop, [trainer.num_training_batches]
            dataloader = 0
        elif hook == "predict_step":
            loop = trainer.predict_loop
            counts = loop.max_batches
        else:
            loop = trainer._evaluation_loop
            counts = loop.max_batches
        progress = loop.batch_progress
        index, last = progress.current.ready - 1, progress.is_last_batch
        count = counts[dataloader] if dataloader < len(counts) else None
    except (AttributeError, RuntimeError, TypeError):  # a Lightning release that keeps them elsewhere
        return -1, None, None
    batches = int(count) if isinstance(count, (int, float)) and math.isfinite(count) else None
    return int(index), batches, bool(last) if isinstance(last, bool) else None


def check_same_step(mine: StepSignature, theirs: StepSignature | None | object, here: str, there: str) -> None:
    """Raise a :class:`StepMismatchError` naming both stages (``here``: this one, ``there``: the one whose message
    announced ``theirs``; ``None``: it is not in a step) unless both run the same step on the same batch."""
    if theirs is UNCHECKED:
        return
    if not isinstance(theirs, StepSignature):
        raise StepMismatchError(
            f"{here} is in {mine.step} but {there} sent its activations from outside a step (a call of the model by"
            " a hook or a callback on that rank only); every stage must run the same steps." + USUAL_CAUSES
        )
    if (mine.hook, mine.dataloader) != (theirs.hook, theirs.dataloader):
        raise StepMismatchError(
            f"{here} is in {mine.step} but {there} is in {theirs.step}: the stages run different loops, so their data"
            " loaders have different lengths (one rank has batches the other has not)." + USUAL_CAUSES
        )
    loop = f"{_LOOPS.get(mine.hook, mine.hook)} data loader"
    if mine.batches is not None and theirs.batches is not None and mine.batches != theirs.batches:
        raise StepMismatchError(
            f"the stages' {loop}s have different lengths: {here} runs {mine.batches} batches, {there}"
            f" {theirs.batches} (found in {mine.step}); the shorter would end its epoch while the other waits for it"
            " in a step." + USUAL_CAUSES
        )
    if mine.batch_index != theirs.batch_index:
        raise StepMismatchError(
            f"{here} is in {mine.step} but {there} in {theirs.step}: the stages are at different batches."
            + USUAL_CAUSES
        )
    if mine.last is not None and theirs.last is not None and mine.last != theirs.last:
        ends, goes_on = (here, there) if mine.last else (there, here)
        raise StepMismatchError(
            f"{mine.step} is the last of the {loop} on {ends} but not on {goes_on}: {goes_on} has more batches, so it"
            f" would enter a step that {ends} never enters." + USUAL_CAUSES
        )
    if mine.fingerprint != theirs.fingerprint:
        structure = ""
        if mine.tensors is not None and mine.tensors == theirs.tensors:
            structure = f" (the same tensors, in another structure: here {describe_batch(mine.batch)})"
        raise StepMismatchError(
            f"the stages got different batches in {mine.step}: {here} has {mine.shapes}, {there} has"
            f" {theirs.shapes}{structure}." + USUAL_CAUSES
        )


def describe_batch(batch: Any) -> str:
    """``batch``'s structure, shapes and dtypes, ``"tuple(float32[16, 12], int64[16])"``, for errors."""
    if isinstance(batch, Tensor):
        return f"{str(batch.dtype).removeprefix('torch.')}{list(batch.shape)}"
    if isinstance(batch, Mapping):
        return "{" + ", ".join(f"{key!r}: {describe_batch(item)}" for key, item in batch.items()) + "}"
    if isinstance(batch, (list, tuple)):
        if len(batch) > _LISTED_ITEMS and not isinstance(batch[0], (Tensor, Mapping, list, tuple)):
            return f"{type(batch).__name__} of {len(batch)} {type(batch[0]).__name__}"
        return f"{type(batch).__name__}(" + ", ".join(describe_batch(item) for item in batch) + ")"
    return type(batch).__name__


def _walk(value: Any, tensors: list[TensorShape], tokens: list[int]) -> None:
    """Append ``value``'s tensors to ``tensors``, and its structure, shapes and dtypes as integers to ``tokens``."""
    if isinstance(value, Tensor):
        shape, dtype = tuple(value.shape), value.dtype
        tensors.append((shape, dtype))
        tokens += (_TENSOR, _DTYPE_CODES.get(dtype, -1), len(shape), *shape)
    elif isinstance(value, (list, tuple)):
        if len(value) > _LISTED_ITEMS and not isinstance(value[0], (Tensor, Mapping, list, tuple)):
            tokens += (_LONG_SEQUENCE, len(value), _name_token(type(value[0]).__name__))
            return
        tokens += (_SEQUENCE, len(value), _name_token(type(value).__name__))
        for item in value:
            _walk(item, tensors, tokens)
    elif isinstance(value, Mapping):
        tokens.append(_MAPPING)
        for key, item in value.items():
            tokens.append(_name_token(str(key)))
            _walk(item, tensors, tokens)
        tokens.append(_END)
    else:
        tokens += (_OTHER, _name_token(type(value).__name__))


_TENSOR, _MAPPING, _END, _SEQUENCE, _LONG_SEQUENCE, _OTHER = range(-1, -7, -1)  # markers (shapes are >= 0)


@functools.lru_cache(maxsize=256)
def _name_token(name: str) -> int:
    """A name (a key, a type) as an integer that is the same in every process."""
    return zlib.crc32(name.encode())
