"""What a training step's loss averages over in each micro-batch, so that per-micro-batch schedules weight each
micro-batch's loss by its share of the batch and equal one device on the whole batch.

Three sources, the first that applies:

* the LightningModule's ``items_in_loss(batch)`` (the user says it);
* a Hugging Face model with its own loss, given a mapping batch with ``labels``: the labels its loss counts, as
  transformers' ``Trainer`` counts ``num_items_in_batch`` (5.x): ``shift_labels`` if the batch has them, else
  ``labels[..., 1:]`` for a causal LM (its loss shifts the labels by one), else ``labels``; each not -100 (a
  causal LM is told by the loss function the model calls, see :func:`_shifts_labels`);
* the samples (a mean over samples), with a warning where the batch's ``labels`` say that a token mean would be
  weighted wrong (micro-batches holding unequal shares of the labels that are not -100).

A step whose loss is a mean over samples gets the same weights from the labels' count wherever every label is
counted (no -100): only batches with ignored labels are weighted otherwise, which is where weighting by samples is
wrong for the model's own token-mean loss.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import Tensor, nn

IGNORE_INDEX = -100  # the label Hugging Face's (and PyTorch's) cross-entropy ignores


@dataclass(frozen=True)
class LossItems:
    """How this LightningModule's loss is counted: ``count`` gives a micro-batch's items (``None``: its samples);
    ``says`` describes it for the start-up line."""

    count: Callable[[Any], float] | None
    says: str

    @classmethod
    def of(cls, module: LightningModule, batch: Any) -> LossItems:
        """Decided on the first batch: the module's ``items_in_loss``, its Hugging Face model's label count, or
        the samples."""
        own = getattr(module, "items_in_loss", None)
        if callable(own):
            return cls(lambda part: float(own(part)), f"{type(module).__name__}.items_in_loss")
        model = _model_with_its_own_loss(module)
        if model is None or not _holds_labels(batch):
            return cls(None, "the samples")
        if isinstance(batch.get("shift_labels"), Tensor):
            return cls(_label_count("shift_labels", 0), "the batch's shift_labels not -100")
        if _shifts_labels(model):
            return cls(_label_count("labels", 1), "the labels not -100 after the causal shift (labels[..., 1:])")
        return cls(_label_count("labels", 0), "the labels not -100")

    def per_micro_batch(self, parts: list[Any], sizes: list[int]) -> list[float]:
        """Each micro-batch's items; at least one in the batch, none negative."""
        if self.count is None:
            return [float(size) for size in sizes]
        items = [self.count(part) for part in parts]
        if any(item < 0 for item in items) or sum(items) == 0:
            raise ValueError(
                f"counting {self.says} gave {items} for the batch's {len(parts)} micro-batches; the count must be"
                " what the training step's loss averages over (the label tokens not -100, say), at least one in"
                " the batch."
            )
        return items


def announce(items: LossItems, module: LightningModule) -> None:
    """The start-up line: what each micro-batch's loss is weighted by, when it is not the samples."""
    if items.count is not None and not callable(getattr(module, "items_in_loss", None)):
        rank_zero_info(
            f"Per-micro-batch schedule: each micro-batch's loss is weighted by its share of {items.says}, the"
            " count transformers' Trainer passes as num_items_in_batch, so that the model's token-mean loss equals"
            " one device's on the whole batch. Define items_in_loss(batch) in the LightningModule to say otherwise"
            " (return len(batch['labels']) to weight by samples)."
        )


def unequal_label_shares(batch_parts: list[Any], sizes: list[int]) -> str | None:
    """Where micro-batches weighted by samples hold unequal shares of the labels that are not -100 (a padded batch),
    those counts described for a warning; None where they cannot tell or agree with the samples."""
    if not all(_holds_labels(part) for part in batch_parts):
        return None
    counts = [int((part["labels"] != IGNORE_INDEX).sum()) for part in batch_parts]
    total, samples = sum(counts), sum(sizes)
    if total == 0 or all(count * samples == size * total for count, size in zip(counts, sizes)):
        return None
    return f"labels not -100 per micro-batch {counts} for samples {sizes}"


def warn_weighted_by_samples(module: LightningModule, shares: str) -> None:
    rank_zero_warn(
        f"Per-micro-batch schedule: {type(module).__name__}'s micro-batches are weighted by their samples, but they"
        f" hold unequal shares of the batch's labels ({shares}). A loss averaged over those labels (a token mean)"
        " then differs from one device on the whole batch; define items_in_loss(batch) in the LightningModule,"
        " returning what the loss averages over (see docs/schedules.md), or use schedule='gpipe'."
    )


def _holds_labels(batch: Any) -> bool:
    return isinstance(batch, Mapping) and isinstance(batch.get("labels"), Tensor) and not batch["labels"].is_floating_point()


def _label_count(key: str, shift: int) -> Callable[[Any], float]:
    def count(part: Any) -> float:
        labels = part[key][..., shift:]
        return float((labels != IGNORE_INDEX).sum())

    return count


def _model_with_its_own_loss(module: nn.Module) -> nn.Module | None:
    """The one outermost Hugging Face model in ``module`` (a ``config`` and ``save_pretrained``) whose forward takes
    ``labels``, that is, computes its own loss; None when there is none or several."""
    found = [
        (name, sub) for name, sub in module.named_modules()
        if callable(getattr(sub, "save_pretrained", None)) and hasattr(sub, "config")
    ]
    outermost = [sub for name, sub in found if not any(name.startswith(f"{other}.") for other, _ in found if other)]
    if len(outermost) != 1:
        return None
    try:
        takes_labels = "labels" in inspect.signature(outermost[0].forward).parameters
    except (TypeError, ValueError):
        return None
    return outermost[0] if takes_labels else None


def _shifts_labels(model: nn.Module) -> bool:
    """Whether the model's loss shifts its labels by one (a causal LM's): the loss function it calls is
    ``ForCausalLMLoss`` and it is not an encoder-decoder (whose decoder input is already shifted), transformers'
    Trainer's rule. Read as the model's ``loss_function`` property resolves it (its ``loss_type``, else
    ``ForCausalLM``), without the property's warning: GPT-2's ``loss_type`` is None and its loss shifts, where the
    Trainer, reading ``loss_type`` alone, counts the unshifted labels."""
    try:
        from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    except ImportError:
        return False
    loss = getattr(model, "_loss_function", None) or LOSS_MAPPING.get(getattr(model, "loss_type", None), ForCausalLMLoss)
    return loss is ForCausalLMLoss and not getattr(getattr(model, "config", None), "is_encoder_decoder", False)
