"""``torch.compile`` under the pipeline: each stage compiles its own blocks, never a module that spans the stages.

A compiled module runs the code it was compiled from. ``torch.compile(seq)`` returns a wrapper whose compiled call is
bound to ``seq`` itself, so replacing ``seq`` by a stage's stand-in would leave the wrapper running the whole,
unsplit ``seq`` on every rank: training that silently differs from one device. The forms, and what happens to them:

* ``torch.compile(seq)`` (an ``OptimizedModule`` wrapping the pipelined ``nn.Sequential``): supported. The wrapper
  stays where it is (state-dict keys keep their ``_orig_mod``, as on one device), calls the stage's stand-in, and
  every block of the stage is compiled with the wrapper's own compiler settings.
* compiled blocks (``nn.Sequential(torch.compile(block), ...)`` or ``block.compile()``): supported as they are; a
  block is wholly on one stage.
* ``seq.compile()`` (compiled in place, its settings out of reach), or a compiled module that contains the
  pipelined one (``torch.compile(model_part)``, ``lightning_module.compile()``): refused before training, naming
  the fix, because their compiled code would span the stages.
* ``GPipeStrategy(compile=True)`` or ``compile={...}`` (``torch.compile``'s keyword arguments): compiles every
  block of each stage, as torchtitan compiles each transformer block (the setting is checked in
  :mod:`lightning_pipe.settings`).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from torch._dynamo.eval_frame import OptimizedModule

from lightning_pipe.execution.stage import StageBlocks
from lightning_pipe.partition.region import Region

_WRAPPED = "_orig_mod"  # the attribute under which an OptimizedModule holds the module it compiled


def uncompiled_name(model: nn.Module, module_name: str | tuple[str, ...] | None) -> str | tuple[str, ...] | None:
    """``module_name`` pointing at the module that ``torch.compile`` wrapped, when it names an ``OptimizedModule``."""
    if not isinstance(module_name, str):
        return module_name  # none, or a chain of sibling blocks (each may be compiled: a block is on one stage)
    try:
        named = model.get_submodule(module_name)
    except AttributeError:
        return module_name  # the partition names the problem, with the modules that exist
    return f"{module_name}.{_WRAPPED}" if isinstance(named, OptimizedModule) else module_name


def compiled_in_place(module: nn.Module) -> bool:
    """Whether ``module.compile()`` was called. Read at set-up only: torch has no public way to tell, so this reads
    the attribute where ``nn.Module.compile`` keeps the compiled call (private to torch)."""
    return getattr(module, "_compiled_call_impl", None) is not None


def check_compiled(model: nn.Module, region: Region) -> None:
    """Refuse the compiled forms whose compiled code would span the stages (see the module docstring)."""
    name = region.container
    if name is not None and compiled_in_place(model.get_submodule(name)):
        raise ValueError(
            f"the pipelined module {name!r} was compiled in place (`{name}.compile()`): its compiled code runs all"
            " its blocks, but under the gpipe strategy each stage runs only its own. Remove the call and pass"
            " GPipeStrategy(compile=True) (or compile={...} with torch.compile's arguments), which compiles each"
            " stage's blocks, or compile the blocks themselves (`for block in seq: block.compile()`)."
        )
    # The modules whose code calls the blocks: the container's ancestors, or a chain's parent and its ancestors.
    inner = name if name is not None else region.names[0]
    parts = inner.split(".")
    for depth in range(len(parts)):
        ancestor_name = ".".join(parts[:depth])
        if name is not None and _is_own_wrapper(ancestor_name, name):
            continue
        ancestor = model.get_submodule(ancestor_name)
        if isinstance(ancestor, OptimizedModule) or compiled_in_place(ancestor):
            shown = ancestor_name or type(model).__name__
            raise ValueError(
                f"the module {shown!r} is compiled and contains the pipelined module {region.label!r}: its compiled"
                " code would run across the pipeline's stages, which each hold only their own blocks. Compile the"
                " pipelined module itself (`torch.compile(...)` of the container) or its blocks instead, or pass"
                " GPipeStrategy(compile=True) to compile each stage's blocks."
            )


def compile_stage(model: nn.Module, region: Region, stage: StageBlocks, options: dict[str, Any] | None) -> None:
    """Compile the blocks of this rank's ``stage``: with ``options`` when the strategy was asked to, else with the
    settings of a ``torch.compile`` wrapper around the pipelined container, which then runs uncompiled (its
    compiled code would run every block, and drive the pipeline's communication). A block the user compiled stays
    as it is (``torch.compile(block)``, or ``block.compile()``: noted in ``stage.compiled_calls``)."""
    wrapper = _own_wrapper(model, region.container) if region.container is not None else None
    if wrapper is not None:
        compiled_forward = wrapper.__dict__.get("forward")
        wrapper.forward = wrapper._orig_mod.__call__
        stage.on_uninstall(lambda: setattr(wrapper, "forward", compiled_forward))
    compiler = None
    if options is not None or wrapper is not None:
        compiler = wrapper.dynamo_ctx if options is None else partial(torch.compile, **options)
    for index, block in zip(stage.indices, stage.blocks):
        if compiled_in_place(block):
            stage.compiled_calls[index] = block  # nn.Module's call of the block runs its compiled code
            continue
        if isinstance(block, OptimizedModule) or compiler is None:
            continue
        # What `nn.Module.compile` does (the block's hooks and forward, compiled), through a function of this file:
        # dynamo does not compile a top frame inside torch.nn (a bare Linear's `_call_impl`), but inlines torch.nn
        # code called from elsewhere. The stage calls it when it runs the block on a micro-batch. Bound as a method,
        # not a `partial`: dynamo wraps a callable without source in a shared frame, whose recompilation limit all
        # the blocks would then share.
        stage.compiled_calls[index] = compiler(types.MethodType(_call_for(type(block)), block))


def compiles_in_first_steps(model: nn.Module, stage: StageBlocks) -> bool:
    """Whether ``torch.compile`` will compile code of this rank in its first steps: the stage's blocks (compiled by
    the strategy, in place, or wrapped), or any module of ``model`` that a ``torch.compile`` wrapper holds."""
    return bool(stage.compiled_calls) or any(isinstance(module, OptimizedModule) for module in model.modules())


def _call(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    return nn.Module.__call__(block, *args, **kwargs)  # nn.Module's call (its hooks, its forward), past the routing


@functools.cache
def _call_for(block_type: type) -> Callable[..., Any]:
    """``_call`` with a code object per block type. Dynamo keeps compiled code per code object, with a limit of
    recompilations (8) on each: blocks of one type share their compiled code (twelve equal blocks compile once),
    and the types of a stage do not share the limit."""
    code = _call.__code__.replace(co_name=f"_call_{block_type.__name__}")
    return types.FunctionType(code, _call.__globals__, code.co_name)


def _is_own_wrapper(ancestor_name: str, name: str) -> bool:
    """Whether the module called ``ancestor_name`` is the ``torch.compile`` wrapper directly around ``name``."""
    parent, _, attribute = name.rpartition(".")
    return attribute == _WRAPPED and ancestor_name == parent


def _own_wrapper(model: nn.Module, name: str) -> OptimizedModule | None:
    parent, _, attribute = name.rpartition(".")
    if attribute != _WRAPPED:
        return None
    wrapper = model.get_submodule(parent)
    return wrapper if isinstance(wrapper, OptimizedModule) else None
