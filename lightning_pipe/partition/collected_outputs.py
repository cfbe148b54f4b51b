"""Values a model collects from inside its blocks with hooks, beside the blocks' outputs: refused, with the fix.

Hugging Face models gather some values of every block through forward hooks while their ``forward`` runs (the
``capture_outputs`` decorator of transformers 5): a mixture of experts' router logits (``output_router_logits``,
which its load-balancing loss reads), the hidden states and the attentions. Pipelined, each block runs on its own
stage, on micro-batches: the loss stage would collect its own blocks' values only, per micro-batch, and the others'
not at all. The load-balancing loss is a product of two sums over every block and every token of the batch (tokens
per expert times router probability per expert), so neither the loss stage nor a per-micro-batch schedule can
compute it as one device does: the gradient of each router depends on the expert counts of all blocks and all
micro-batches, which a per-micro-batch schedule does not know when its first backward runs. The strategy refuses
such a model at set-up, and any call that collects such values at the first step, naming the flag to turn off.
"""

from __future__ import annotations

import sys
from typing import Any

from torch import nn

from lightning_pipe.partition.region import Region

# Each value collected: what it is, and what reads it, as the refusal says them.
_READ_FOR = {
    "router_logits": ("every block's router logits", "its load-balancing loss, added to its loss"),
    "hidden_states": ("every block's hidden state", "its output"),
    "attentions": ("every block's attention weights", "its output"),
}


def collected_inside_blocks(model: nn.Module, region: Region) -> list[tuple[str, str, str]]:
    """(the Hugging Face model's name in ``model``, its ``output_...`` flag, the collecting module's class) for each
    value a model of ``model`` is configured to collect with hooks on modules inside the pipelined blocks."""
    inside = [module for block in region.blocks(model) for module in block.modules()]
    found = []
    for name, module in model.named_modules():
        config, recorders = getattr(module, "config", None), _recorders(module)
        if config is None or not recorders:
            continue
        for key, specs in recorders.items():
            if key not in _READ_FOR or not getattr(config, f"output_{key}", False):
                continue
            target = next((m for m in inside if _records(specs, m)), None)
            flags = {flag for _, flag, _ in found}
            if target is not None and f"output_{key}" not in flags:  # the outermost model that collects it
                found.append((f"{name or 'the LightningModule'} ({type(module).__name__})", f"output_{key}",
                              type(target).__name__))
    return found


def collecting_now() -> list[str]:
    """The values a Hugging Face model's ``forward`` running now collects with hooks (its active collector's keys)."""
    capturing = sys.modules.get("transformers.utils.output_capturing")  # nothing to ask where none was imported
    if capturing is None:
        return []
    collected = capturing._active_collector.get()
    return sorted(key for key in (collected or {}) if key in _READ_FOR)


def check_nothing_collected_inside_blocks(model: nn.Module, region: Region, num_stages: int) -> None:
    """At set-up: refuse a model configured to collect values from inside the pipelined blocks."""
    found = collected_inside_blocks(model, region)
    if found:
        raise ValueError(refusal(*found[0], num_stages))


def check_nothing_collected_now(num_stages: int) -> None:
    """At a step's first block call: refuse a call that asks the model to collect values from inside the blocks
    (``model(..., output_router_logits=True)``). Every stage makes the call alike: every stage refuses there."""
    collected = collecting_now()
    if collected:
        raise ValueError(refusal("The model's call", f"output_{collected[0]}", "module", num_stages))


def refusal(model_name: str, flag: str, collector: str, num_stages: int) -> str:
    """The error for a model that collects ``flag``'s values from inside the pipelined blocks."""
    key = flag.removeprefix("output_")
    what, reader = _READ_FOR[key]
    aside = (
        " to train without the load-balancing loss, or compute each block's auxiliary loss inside the block (its"
        " gradient added in the block's own backward, as Megatron-LM's MoEAuxLossAutoScaler does), which pipelines"
        if key == "router_logits" else ", and read them on one device (training does not need them)"
    )
    return (
        f"{model_name} collects {what} with hooks on each {collector} inside the pipelined blocks ({flag}=True),"
        f" for {reader}. Over {num_stages} pipeline stages each block runs on its own stage, one micro-batch at a"
        " time, so the loss stage cannot see them as one device does, and the result would differ from one"
        f" device's. Set {flag}=False (`model.config.{flag} = False`, and not in the model's calls){aside}. See"
        " docs/existing_project.md, mixtures of experts."
    )


def _recorders(module: nn.Module) -> dict[str, Any]:
    try:
        from transformers.utils.output_capturing import _CAN_RECORD_REGISTRY
    except ImportError:
        return {}
    return _CAN_RECORD_REGISTRY.get(module) if hasattr(module, "config") else {}


def _records(specs: Any, module: nn.Module) -> bool:
    """Whether a recorder (a class, a class name, or an ``OutputRecorder``, or a list of them) hooks ``module``."""
    for spec in specs if isinstance(specs, list) else [specs]:
        target = getattr(spec, "target_class", spec)
        name = getattr(spec, "class_name", None) or (spec if isinstance(spec, str) else None)
        if isinstance(target, type) and isinstance(module, target):
            return True
        if name is not None and type(module).__name__.endswith(name):
            return True
    return False
