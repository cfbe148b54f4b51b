"""A study of how the stock models call their blocks: ``python tests/helpers/block_calls.py`` prints, per model,
every block call of one training step (identity of the hidden state, side arguments, outputs, batch dimension),
what runs between the blocks, the parameter shares, and who calls the blocks under Hugging Face's gradient
checkpointing. The findings are in STUDY.md of the branch that wrote this; the engine's own observation of a
model's forward is the lead's (issue 14, item 4), this only shows what it will meet.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import seed_everything
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from helpers.stock_models import BLOCKS, STOCK_MODELS  # noqa: E402

MODULE_PY = str(Path(nn.Module.__module__.replace(".", "/")))  # torch/nn/modules/module


def describe(value: Any) -> str:
    """Type and shape of a value, recursively for tuples and lists, briefly for other objects."""
    if isinstance(value, Tensor):
        grad = ", grad" if value.requires_grad else ""
        return f"Tensor{tuple(value.shape)} {str(value.dtype).replace('torch.', '')}{grad}"
    if isinstance(value, (tuple, list)):
        inner = ", ".join(describe(v) for v in value)
        return f"{type(value).__name__}({inner})"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    return type(value).__name__


def first_tensor(output: Any) -> Any:
    """What a loop takes from a block's output as the next hidden state: the output, or its first element."""
    if isinstance(output, Tensor):
        return output
    if isinstance(output, (tuple, list)) and output:
        return output[0]
    if hasattr(output, "to_tuple"):  # a ModelOutput
        return output.to_tuple()[0]
    return None


MACHINERY = (MODULE_PY, "torch/utils/checkpoint", "transformers/modeling_layers", "functools", "block_calls")


def caller(skip: tuple[str, ...] = MACHINERY) -> str:
    """The first frame of the stack that is not module-call machinery: who called this block."""
    frame = sys._getframe(1)
    chain = []
    while frame is not None:
        name = frame.f_code.co_filename
        where = f"{Path(name).name}:{frame.f_lineno} {frame.f_code.co_name}"
        chain.append(where)
        if not any(part in name for part in skip):
            return where
        frame = frame.f_back
    return " <- ".join(chain)


@dataclass
class Call:
    container: str
    name: str
    args: tuple
    kwargs: dict
    output: Any = None
    called_from: str = ""
    in_backward: bool = False


@dataclass
class Observation:
    calls: list[Call] = field(default_factory=list)
    between: list[list[str]] = field(default_factory=list)  # per gap between block calls: modules and functions run
    before: list[str] = field(default_factory=list)
    after: list[str] = field(default_factory=list)


def blocks_of(model: nn.Module, container: str) -> list[tuple[str, nn.Module]]:
    parent = model.get_submodule(container)
    prefix = f"{container}." if container else ""
    return [(f"{prefix}{name}", child) for name, child in parent.named_children()]


def observe(model: nn.Module, containers: list[str], step, backward: bool = True) -> Observation:
    """Run ``step()`` (a training step returning the loss) with hooks on every block; record calls and gaps."""
    seen = Observation()
    blocks = {id(child): (container, name) for container in containers for name, child in blocks_of(model, container)}
    names = {id(m): n for n, m in model.named_modules()}
    block_names = [name for _, name in blocks.values()]
    state = {"in_block": 0, "backward": False, "gap": seen.before}

    def inside_block(module_name: str) -> bool:
        return any(module_name == b or module_name.startswith(b + ".") for b in block_names)

    def pre(module, args, kwargs):
        container, name = blocks[id(module)]
        if state["in_block"] == 0:
            seen.calls.append(Call(container, name, args, kwargs, called_from=caller(), in_backward=state["backward"]))
        state["in_block"] += 1

    def post(module, args, kwargs, output):
        state["in_block"] -= 1
        if state["in_block"] == 0:
            seen.calls[-1].output = output
            seen.between.append([])
            state["gap"] = seen.between[-1]

    def any_module(module, args):
        name = names.get(id(module))
        if name is not None and state["in_block"] == 0 and not inside_block(name) and name:
            state["gap"].append(name)

    def functions(frame, event, arg):
        # Python functions called by the function that loops over the blocks, and C functions it calls, between blocks
        if state["in_block"] == 0 and event in ("call", "c_call") and seen.calls:
            parent = frame.f_back if event == "call" else frame
            if parent is not None and parent.f_code is loop_code[0]:
                label = frame.f_code.co_qualname if event == "call" else getattr(arg, "__qualname__", str(arg))
                if not label.startswith("Module."):  # module calls and attribute look-ups: the module hook has them
                    state["gap"].append(f"{label}()")

    def find_loop(module, args, kwargs):
        frame = sys._getframe(1)
        while frame is not None and any(part in frame.f_code.co_filename for part in MACHINERY):
            frame = frame.f_back
        loop_code[0] = frame.f_code if frame is not None else None

    loop_code: list[Any] = [None]
    handles = []
    for container in containers:
        for _, child in blocks_of(model, container):
            handles.append(child.register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(child.register_forward_hook(post, with_kwargs=True))
    handles.append(nn.modules.module.register_module_forward_pre_hook(any_module))
    try:
        # a dry run without gradients finds the function that calls the first block, whose calls are traced after
        probe = blocks_of(model, containers[0])[0][1].register_forward_pre_hook(find_loop, with_kwargs=True)
        with torch.no_grad():
            step()
        probe.remove()
        seen.calls.clear(), seen.between.clear(), seen.before.clear()
        state["gap"] = seen.before
        sys.setprofile(functions)
        try:
            loss = step()
        finally:
            sys.setprofile(None)
        if seen.between:
            seen.after = seen.between.pop()
        if backward and loss is not None:
            state["backward"] = True
            loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return seen


def parameter_shares(model: nn.Module, containers: list[str]) -> tuple[int, int, list[tuple[str, int]]]:
    """(parameters in the blocks, all parameters, the biggest modules outside the blocks), counting shared once."""
    in_blocks = {id(p) for c in containers for p in model.get_submodule(c).parameters()}
    total = {id(p): p.numel() for p in model.parameters()}
    outside: dict[str, int] = {}
    for name, p in model.named_parameters():
        if id(p) not in in_blocks:
            owner = name.rsplit(".", 1)[0]
            outside[owner] = outside.get(owner, 0) + p.numel()
    blocks = sum(total[i] for i in in_blocks)
    return blocks, sum(total.values()), sorted(outside.items(), key=lambda kv: -kv[1])[:4]


def report(seen: Observation, batch_size: int) -> list[str]:
    lines = [f"before the first block: {compress(seen.before)}"]
    previous: Call | None = None
    for index, call in enumerate(seen.calls):
        if call.in_backward:
            lines.append(f"  {call.name}: called again during backward (re-computation), from {call.called_from}")
            continue
        hidden = call.args[0] if call.args else next(iter(call.kwargs.values()), None)
        where = "positional" if call.args else f"keyword {next(iter(call.kwargs), None)!r}"
        chained = ""
        if previous is not None and previous.container == call.container:
            last = first_tensor(previous.output)
            if hidden is last:
                chained = "IS the previous output" + ("" if isinstance(previous.output, Tensor) else "[0]")
            elif isinstance(hidden, Tensor) and isinstance(last, Tensor) and hidden.shape == last.shape \
                    and torch.equal(hidden, last):
                chained = "equals the previous output but is another object"
            else:
                chained = "is NOT the previous output"
        dims = [d for d, size in enumerate(hidden.shape) if size == batch_size] if isinstance(hidden, Tensor) else []
        lines.append(f"  {call.name} from {call.called_from}")
        lines.append(f"    hidden ({where}): {describe(hidden)}; batch dim {dims}; {chained}")
        side = [(f"arg{i}", v) for i, v in enumerate(call.args[1:], 1)] + list(call.kwargs.items())
        if not call.args:
            side = side[1:]
        for key, value in side:
            same = ""
            if previous is not None and previous.container == call.container:
                old = dict([(f"arg{i}", v) for i, v in enumerate(previous.args[1:], 1)] + list(previous.kwargs.items()))
                if key in old:
                    same = ", same object as before" if old[key] is value else ", NEW object"
            lines.append(f"    {key}: {describe(value)}{same}")
        lines.append(f"    output: {describe(call.output)}")
        gap = seen.between[index] if index < len(seen.between) else []
        if gap:
            lines.append(f"    then, before the next block: {compress(gap)}")
        previous = call
    lines.append(f"after the last block: {compress(seen.after)}")
    return lines


def compress(names: list[str], limit: int = 14) -> str:
    out: list[str] = []
    for name in names:
        if not out or out[-1] != name:
            out.append(name)
    text = ", ".join(out[:limit])
    return (text + f", ... ({len(out) - limit} more)") if len(out) > limit else (text or "nothing")


def study(name: str, containers: list[str] | None = None, **options) -> list[str]:
    seed_everything(0, verbose=False)
    module = STOCK_MODELS[name](**options)
    module.train()
    containers = containers or BLOCKS[name]
    batch = next(iter(module.train_dataloader()))
    batch_size = module.batch_size
    lines = [f"## {name} {options or ''}".rstrip()]
    blocks, total, outside = parameter_shares(module, containers)
    lines.append(f"parameters: {total}; in {containers}: {blocks} ({100 * blocks / total:.0f}%); outside, biggest: "
                 + ", ".join(f"{n} {c}" for n, c in outside))
    seen = observe(module, containers, lambda: module.training_step(batch, 0))
    return lines + report(seen, batch_size)


def study_gradient_checkpointing(name: str) -> list[str]:
    """The same step with Hugging Face's gradient checkpointing on: who calls the blocks, and what runs in backward."""
    seed_everything(0, verbose=False)
    module = STOCK_MODELS[name]()
    module.model.gradient_checkpointing_enable()
    module.train()
    containers = BLOCKS[name]
    blocks = [child for _, child in blocks_of(module, containers[0])]
    function = blocks[0]._gradient_checkpointing_func
    lines = [f"## {name} with model.gradient_checkpointing_enable()",
             f"checkpoint function of each block: {getattr(function, 'func', function).__module__}."
             f"{getattr(function, 'func', function).__name__} {getattr(function, 'keywords', {})}"]
    inner_calls = {"forward": 0, "backward": 0}
    phase = ["forward"]

    def count(module, args):
        inner_calls[phase[0]] += 1

    handles = [m.register_forward_pre_hook(count) for block in blocks for m in block.modules() if m is not block]
    batch = next(iter(module.train_dataloader()))
    try:
        seen = observe(module, containers, lambda: module.training_step(batch, 0), backward=False)
        loss = module.training_step(batch, 0)
        inner_calls["forward"] = 0
        phase[0] = "backward"
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    lines += report(seen, module.batch_size)
    lines.append(f"module calls inside the blocks: {inner_calls['backward']} during backward (re-computation)")
    return lines


def real_size_shares() -> list[str]:
    """The parameter shares of the same classes at their published sizes (built on the meta device)."""
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM
    from lightning.pytorch.demos.transformer import Transformer

    from helpers.stock_models import resnet18, vgg11

    def encoder_base() -> nn.Module:  # BERT-base's sizes
        model = nn.Module()
        model.embedding = nn.Embedding(30522, 768)
        model.encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(768, 12, 3072, batch_first=True), 12)
        model.head = nn.Linear(768, 2)
        return model

    sizes = {
        "GPT-2 small (GPT2Config())": (lambda: GPT2LMHeadModel(GPT2Config()), ["transformer.h"]),
        "Llama-2-7B shape (LlamaConfig())": (lambda: LlamaForCausalLM(LlamaConfig()), ["model.layers"]),
        "TransformerEncoder, BERT-base sizes": (encoder_base, ["encoder.layers"]),
        "Lightning demo, default sizes": (lambda: Transformer(), ["transformer.encoder.layers",
                                                                 "transformer.decoder.layers"]),
        "ResNet-18 (width 64, 1000 classes)": (lambda: resnet18(1000), ["layer1", "layer2", "layer3", "layer4"]),
        "VGG-11 (1000 classes)": (lambda: vgg11(1000), ["features"]),
    }
    lines = ["## parameter shares at published sizes"]
    for label, (build, containers) in sizes.items():
        with torch.device("meta"):
            model = build()
        blocks, total, outside = parameter_shares(model, containers)
        lines.append(f"- {label}: {total / 1e6:.1f}M; in {', '.join(containers)}: {100 * blocks / total:.0f}%; "
                     "outside, biggest: " + ", ".join(f"{n} {c / 1e6:.2f}M" for n, c in outside))
    return lines


if __name__ == "__main__":
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    chosen = sys.argv[1:] or list(STOCK_MODELS)
    for name in chosen:
        print("\n".join(study(name)))
        print()
    if not sys.argv[1:]:
        print("\n".join(study("encoder", batch_first=False)))
        print()
        print("\n".join(study("resnet18", containers=["model"])))
        for name in ("gpt2", "llama"):
            print()
            print("\n".join(study_gradient_checkpointing(name)))
        print()
        print("\n".join(real_size_shares()))
