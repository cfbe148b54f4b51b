"""Tensor parallelism inside a stage (``tensor_parallel_size=T``): each held block split over the stage's T ranks with
torch's DTensor (``parallelize_module``, ``ColwiseParallel``, ``RowwiseParallel``), by a plan from where users keep it.

The plan names modules inside a block (``"self_attn.q_proj"``; ``"*"`` matches one name part) and how each is
split. It comes from the user (a mapping, or a function ``fn(block, tp_mesh)`` that parallelizes one block itself) or,
by default, from the Hugging Face model holding the blocks: its ``config.base_model_tp_plan`` (``layers.*.mlp.up_proj:
colwise``), whose entries under the pipelined blocks' own path apply to each block, prefix dropped. Entries for
modules outside the blocks (an embedding, the head) are not applied: those modules stay whole on every rank, as the
norms inside the blocks do.

A split block's output is whole again on every one of the stage's ranks (a row-wise layer ends each split pair with
an all-reduce), so everything the pipeline does between blocks stays as it was: the stage's T ranks run the same
step on the same batch, each as one pipeline of its own (activations travel between ranks of one tensor-parallel
index), and only inside a block do they talk. A split layer's parameters are DTensors (each rank holds its slice);
the gradients of the whole ones (norms) come out identical on the T ranks, as DTensor's backward sums the input
gradients of the column-wise layers over them.

Lightning's convention is the third place a plan lives: the LightningModule's ``configure_model`` calls
``parallelize_module`` itself with ``self.device_mesh["tensor_parallel"]`` (the run's mesh, dimensions named as
Lightning's ``ModelParallelStrategy`` names them). Its blocks arrive split, on the meta device; set-up takes each
split module's layout and torch's hooks off (:func:`take_split_modules`), so that the pipeline decides, places and
initialises whole blocks as for any plan, and puts that same split back on the ranks holding each block
(:class:`TakenSplit`): no second plan on top.

Checked at set-up (:func:`resolve_plan`), on the whole model before anything is allocated: every name matches a
linear layer (or embedding) of some block, every split width and every head count divides by T.
"""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, parallelize_module
from torch.optim import Optimizer

from lightning_pipe.execution.sharding import replace_in_optimizer
from lightning_pipe.partition.tensor_slices import rank_slice_shapes

# The plan's strings (the names Hugging Face's plans use): how each makes a torch ParallelStyle.
STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
}
# Attributes that hold a head count in attention modules (torch's, Hugging Face's, nanoGPT's, ours).
HEAD_COUNTS = ("num_heads", "num_attention_heads", "num_key_value_heads", "n_head", "n_heads", "n_kv_heads")

PlanFunction = Callable[[nn.Module, DeviceMesh], Any]


def checked_plan(plan: Any, key: str) -> dict[str, Any] | PlanFunction | None:
    """The ``tensor_parallel_plan`` setting checked where it enters: ``None``, a function, or a mapping of names to
    ``ParallelStyle``\\ s or the strings of :data:`STYLES` (returned as a ``dict``)."""
    if plan is None or (callable(plan) and not isinstance(plan, Mapping)):
        return plan  # type: ignore[no-any-return]
    if not isinstance(plan, Mapping) or not plan:
        raise ValueError(
            f"{key}={plan!r} is invalid; give a mapping from module names inside a block to 'colwise' or 'rowwise'"
            " (or torch ParallelStyles), e.g. {'mlp.up': 'colwise', 'mlp.down': 'rowwise'}, a function"
            " fn(block, tp_mesh) that parallelizes one block, or None for the Hugging Face model's own plan."
        )
    for name, style in plan.items():
        if not isinstance(name, str) or not (isinstance(style, ParallelStyle) or style in STYLES):
            raise ValueError(
                f"{key}[{name!r}]={style!r} is invalid; use one of {', '.join(map(repr, STYLES))} or a torch"
                " ParallelStyle (ColwiseParallel(), RowwiseParallel(), ...), keyed by a module name inside a block."
            )
    return dict(plan)


@dataclass(frozen=True)
class BlockPlans:
    """How each pipelined block is split: by block index, the block's module names and their styles (the same
    object on every rank), or the user's function for every block."""

    styles: dict[int, dict[str, Any]]  # block index -> {module name in the block: style name or ParallelStyle}
    function: PlanFunction | None = None
    source: str = "the tensor_parallel_plan"
    size: int = 1  # the stage's tensor-parallel ranks

    def rank_shapes(self, index: int, block: nn.Module) -> dict[str, tuple[int, ...]]:
        """What one rank holds of each parameter of block ``index`` that the plan splits, by name in the block (a
        function's split is not known before it runs: none)."""
        return rank_slice_shapes(block, self.styles.get(index, {}), self.size)

    def rank_elements(self, blocks: Sequence[nn.Module]) -> dict[int, int]:
        """The elements one rank holds of each split parameter of ``blocks`` (whole, as built), by its id."""
        return {id(block.get_parameter(name)): math.prod(shape)
                for index, block in enumerate(blocks) for name, shape in self.rank_shapes(index, block).items()}

    def apply(self, index: int, block: nn.Module, mesh: DeviceMesh) -> None:
        if self.function is not None:
            self.function(block, mesh)
            return
        styles = self.styles.get(index, {})
        for name, style in styles.items():
            if isinstance(style, TakenSplit):  # the block's own split, back as configure_model made it
                style._apply(block.get_submodule(name), mesh)
        planned = {name: _style(style) for name, style in styles.items() if not isinstance(style, TakenSplit)}
        if planned:
            parallelize_module(block, mesh, planned)


def resolve_plan(
    model: nn.Module, block_names: Sequence[str], blocks: Sequence[nn.Module], plan: Any, size: int, key: str = "",
    taken: Mapping[str, TakenSplit] | None = None,
) -> BlockPlans:
    """Each block's plan from the setting ``plan`` (see :func:`checked_plan`), or from the split ``configure_model``
    made (``taken``, by qualified module name: see :func:`take_split_modules`), checked against the blocks (built
    whole, on any device, the meta one included) for ``size`` tensor-parallel ranks; raises naming what does not fit
    and how to fix it."""
    if taken:
        styles = _taken_plans(block_names, plan, taken, key)
        _check_head_counts(model, block_names, blocks, size, key)
        return BlockPlans(styles, None, "configure_model's parallelize_module", size)
    if callable(plan) and not isinstance(plan, Mapping):
        _check_head_counts(model, block_names, blocks, size, key)
        return BlockPlans({}, plan, "the tensor_parallel_plan function", size)
    if plan is None:
        styles, source = _hugging_face_plans(model, block_names, size, key)
    else:
        styles, source = _user_plans(block_names, blocks, plan, key), f"{key}tensor_parallel_plan"
    for index, block_styles in styles.items():
        for name, style in block_styles.items():
            _check_width(f"{block_names[index]}.{name}", blocks[index].get_submodule(name), style, size, source, key)
    _check_head_counts(model, block_names, blocks, size, key)
    return BlockPlans(styles, None, source, size)


def refuse_split_ties(plans: BlockPlans, ties: Sequence[tuple[Sequence[tuple[int, str]], Sequence[str]]]) -> None:
    """Raise where a parameter shared by blocks of several stages (each tie: its places, ``(block index, name in the
    block)``, and the blocks' names) lies in a layer the plan splits: the stages keep one value of it, whole."""
    for places, block_names in ties:
        for index, name in places:
            layer = name.rpartition(".")[0]
            if layer in plans.styles.get(index, {}):
                raise ValueError(
                    f"{plans.source} splits {block_names[index]}.{layer!r}, whose parameter {name.rpartition('.')[2]!r}"
                    " is shared with a block of another stage (tied); the stages keep a tied parameter whole. Leave"
                    f" {layer!r} out of the plan, or untie the parameter."
                )


def _taken_plans(block_names: Sequence[str], plan: Any, taken: Mapping[str, TakenSplit], key: str) -> dict:
    """The split ``configure_model`` made, by block: each split module's name inside its block."""
    split = list(taken)
    if plan is not None:
        raise ValueError(
            f"configure_model() split {split[:3]} with parallelize_module, and {key}tensor_parallel_plan={plan!r} is"
            " set as well: a block is split once. Leave tensor_parallel_plan unset to train the blocks as"
            " configure_model split them, or build them whole there and keep the plan."
        )
    styles: dict[int, dict[str, Any]] = {}
    for name, style in taken.items():
        index = next((i for i, block in enumerate(block_names) if name == block or name.startswith(f"{block}.")), None)
        if index is None:
            raise ValueError(
                f"configure_model() split {name!r} with parallelize_module, but it lies outside the pipelined blocks"
                f" ({block_names[0]!r}, ...): only the blocks are split over a stage's tensor-parallel ranks, the"
                " modules outside them stay whole on every rank. Split only the blocks' own layers."
            )
        styles.setdefault(index, {})[name[len(block_names[index]) + 1:]] = style
    return styles


def _user_plans(block_names: Sequence[str], blocks: Sequence[nn.Module], plan: Mapping[str, Any], key: str) -> dict:
    styles: dict[int, dict[str, Any]] = {}
    for pattern, style in plan.items():
        matched = False
        for index, block in enumerate(blocks):
            for name, _ in block.named_modules():
                if name and _matches(pattern, name):
                    styles.setdefault(index, {})[name] = style
                    matched = True
        if not matched:
            inside = [name for name, m in blocks[0].named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
            raise ValueError(
                f"{key}tensor_parallel_plan names {pattern!r}, but no pipelined block holds a module of that name"
                f" (names are relative to each block, e.g. {block_names[0]!r} holds {inside[:8]}); name the block's"
                " own layers ('*' matches one name part), or leave the entry out."
            )
    return styles


def _hugging_face_plans(model: nn.Module, block_names: Sequence[str], size: int, key: str) -> tuple[dict, str]:
    """The entries of the Hugging Face model's ``base_model_tp_plan`` that fall inside each block, by block."""
    styles: dict[int, dict[str, Any]] = {}
    source = None
    for index, block_name in enumerate(block_names):
        found = _base_model_of(model, block_name)
        if found is None:
            continue
        path, plan, source = found
        parts = path.split(".")
        for pattern, style in plan.items():
            pattern_parts = pattern.split(".")
            head, rest = pattern_parts[: len(parts)], pattern_parts[len(parts):]
            if rest and len(head) == len(parts) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, head)):
                if style not in STYLES:
                    raise ValueError(
                        f"{source} splits {'.'.join(rest)!r} of block {block_name!r} as {style!r}, which"
                        f" {key}tensor_parallel_size={size} does not support yet (it supports"
                        f" {', '.join(map(repr, STYLES))}); give {key}tensor_parallel_plan for the blocks."
                    )
                styles.setdefault(index, {})[".".join(rest)] = style
    if not styles:
        raise ValueError(
            f"{key}tensor_parallel_size={size} splits each pipelined block, but {key}tensor_parallel_plan is not"
            " set and no Hugging Face model with a tensor-parallel plan (config.base_model_tp_plan) holds the"
            f" blocks ({block_names[0]!r}, ...). Give {key}tensor_parallel_plan: a mapping such as"
            " {'attn.qkv': 'colwise', 'attn.out': 'rowwise', 'mlp.up': 'colwise', 'mlp.down': 'rowwise'}, or a"
            " function fn(block, tp_mesh)."
        )
    return styles, source or ""


def _base_model_of(model: nn.Module, block_name: str) -> tuple[str, Mapping[str, str], str] | None:
    """The block's path inside the innermost Hugging Face model holding it that has a plan, that plan, and words
    naming it."""
    parts = block_name.split(".")
    for cut in range(len(parts) - 1, -1, -1):
        holder = model.get_submodule(".".join(parts[:cut])) if cut else model
        plan = getattr(getattr(holder, "config", None), "base_model_tp_plan", None)
        if plan:
            prefix = getattr(holder, "base_model_prefix", "")
            path = ".".join(parts[cut:])
            # The task model (LlamaForCausalLM) holds the base model under its prefix: the plan is the base model's.
            if prefix and path.startswith(prefix + ".") and isinstance(getattr(holder, prefix, None), nn.Module):
                path = path[len(prefix) + 1:]
            return path, plan, f"{type(holder.config).__name__}.base_model_tp_plan"
    return None


def _check_width(name: str, module: nn.Module, style: Any, size: int, source: str, key: str) -> None:
    kind = style if isinstance(style, str) else type(style).__name__
    column = kind.startswith("colwise") or isinstance(style, ColwiseParallel)
    if not isinstance(module, (nn.Linear, nn.Embedding)):
        if isinstance(style, ParallelStyle) and not isinstance(style, (ColwiseParallel, RowwiseParallel)):
            return  # the user's own style (SequenceParallel, PrepareModuleInput): theirs to check
        raise ValueError(
            f"{source} splits {name!r} ({type(module).__name__}) as {kind!r}, but column- and row-wise splits apply"
            " to nn.Linear and nn.Embedding only; name the linear layers inside it."
        )
    if isinstance(module, nn.Linear):
        width, what = (module.out_features, "out_features") if column else (module.in_features, "in_features")
    else:
        width, what = (module.embedding_dim, "embedding_dim") if column else (module.num_embeddings, "num_embeddings")
    if width % size:
        raise ValueError(
            f"{source} splits {name!r} {'column' if column else 'row'}-wise over {key}tensor_parallel_size={size}"
            f" ranks, but its {what}={width} does not divide by {size}; choose a {key}tensor_parallel_size that"
            f" divides {width}, or leave {name!r} whole."
        )


def _check_head_counts(model: nn.Module, block_names: Sequence[str], blocks: Sequence[nn.Module], size: int,
                       key: str) -> None:
    """Attention splits by heads: every head count in the blocks (a module's, the Hugging Face config's) must divide
    by the tensor-parallel size."""
    for block_name, block in zip(block_names, blocks):
        for name, module in block.named_modules():
            holders = [(module, f"{block_name}.{name}" if name else block_name)]
            config = getattr(module, "config", None)
            if config is not None and not isinstance(config, (int, str)):
                holders.append((config, f"{block_name}.{name}.config" if name else f"{block_name}.config"))
            for holder, where in holders:
                for attribute in HEAD_COUNTS:
                    count = getattr(holder, attribute, None)
                    if isinstance(count, int) and not isinstance(count, bool) and count % size:
                        raise ValueError(
                            f"{key}tensor_parallel_size={size} splits attention by heads, but {where}.{attribute}="
                            f"{count} does not divide by {size}; choose a {key}tensor_parallel_size that divides"
                            f" {count}."
                        )


def _matches(pattern: str, name: str) -> bool:
    parts, pattern_parts = name.split("."), pattern.split(".")
    return len(parts) == len(pattern_parts) and all(fnmatch.fnmatchcase(p, q) for p, q in zip(parts, pattern_parts))


def _style(style: Any) -> ParallelStyle:
    return STYLES[style]() if isinstance(style, str) else style


class TakenSplit(ParallelStyle):
    """How ``configure_model`` split one module with ``parallelize_module``, taken off it at set-up: the layout of
    each split tensor (its mesh and placements) and torch's hooks around the module's forward. Applied where the
    module is held, it splits the module's whole tensors (identical on the stage's tensor-parallel ranks) the same way
    and puts the hooks back: the module as configure_model made it, with the values the pipeline initialised."""

    def __init__(self, layouts: dict[str, tuple[DeviceMesh, tuple[Placement, ...]]],
                 hooks: dict[str, dict[int, Callable]]) -> None:
        self.layouts = layouts  # tensor name in the module -> (mesh, placements)
        self.hooks = hooks  # "_forward_pre_hooks" / "_forward_hooks" -> the module's hooks of torch's split, by key

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, (mesh, placements) in self.layouts.items():
            whole = getattr(module, name)
            split = distribute_tensor(whole.detach(), mesh, placements, src_data_rank=None)
            if name in module._parameters:
                module._parameters[name] = nn.Parameter(split, whole.requires_grad)
            else:
                module._buffers[name] = split
        for kind, hooks in self.hooks.items():
            getattr(module, kind).update(hooks)
        module._distribute_module_applied = True  # type: ignore[assignment]  # as distribute_module marks it
        return module


# Where the split taken from configure_model stays on the LightningModule: the blocks are whole after a run, and a
# later run on the same module (trainer.test after trainer.fit; configure_model builds nothing twice) splits them again.
_TAKEN = "_lightning_pipe_split_taken"


def take_split_modules(model: nn.Module, mesh: DeviceMesh | None) -> dict[str, TakenSplit]:
    """The modules of ``model`` that its ``configure_model`` split with ``parallelize_module`` (DTensor tensors, or
    torch's split hooks), by qualified name, each taken off: its split tensors whole (on the meta device where they
    were built there), torch's hooks and mark removed; where none is split, what an earlier run on ``model`` took.
    Raises naming the fix where one was split over a mesh other than ``mesh``, the run's tensor-parallel dimension.
    A collective over the tensor-parallel ranks for real DTensors."""
    taken = _take_split_modules(model, mesh)
    if not taken:
        taken = model.__dict__.get(_TAKEN, {})
        for name, split in taken.items():
            for tensor, (used, _) in split.layouts.items():
                _check_mesh(name, tensor, used, mesh)
    if taken:
        model.__dict__[_TAKEN] = taken
    return taken


def _take_split_modules(model: nn.Module, mesh: DeviceMesh | None) -> dict[str, TakenSplit]:
    taken: dict[str, TakenSplit] = {}
    wholes: dict[int, Tensor] = {}  # a tensor shared by several modules stays one
    for name, module in model.named_modules():
        split = {key: t for store in (module._parameters, module._buffers) for key, t in store.items()
                 if isinstance(t, DTensor)}
        hooks = {kind: {k: h for k, h in getattr(module, kind).items() if _is_torch_split_hook(h)}
                 for kind in ("_forward_pre_hooks", "_forward_hooks")}
        if not split and not any(hooks.values()):
            continue
        for key, tensor in split.items():
            _check_mesh(name, key, tensor.device_mesh, mesh)
            if id(tensor) not in wholes:
                value = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta") if tensor.is_meta else (
                    tensor.full_tensor().detach())
                wholes[id(tensor)] = nn.Parameter(value, tensor.requires_grad) if key in module._parameters else value
            (module._parameters if key in module._parameters else module._buffers)[key] = wholes[id(tensor)]
        for kind, found in hooks.items():
            for k in found:
                del getattr(module, kind)[k]
        module.__dict__.pop("_distribute_module_applied", None)
        taken[name] = TakenSplit({key: (t.device_mesh, tuple(t.placements)) for key, t in split.items()}, hooks)
    return taken


def _is_torch_split_hook(hook: Any) -> bool:
    """Whether ``hook`` is one that torch's ``distribute_module`` (under every ParallelStyle) registered."""
    return getattr(hook, "__module__", None) == "torch.distributed.tensor._api" and getattr(
        hook, "__qualname__", "").startswith("distribute_module.")


def _check_mesh(module: str, tensor: str, used: DeviceMesh, run: DeviceMesh | None) -> None:
    ranks = used.mesh.flatten().tolist()
    expected = run.mesh.flatten().tolist() if run is not None else None
    if used.ndim != 1 or ranks != expected:
        raise ValueError(
            f"configure_model() split {module}.{tensor} over the ranks {ranks} (a mesh of shape {tuple(used.shape)}),"
            f" but a stage's tensor-parallel ranks here are {expected}: split the blocks over"
            " self.device_mesh['tensor_parallel'], the run's tensor-parallel dimension."
        )


class StageTensorParallel:
    """This rank's split blocks (over the stage's tensor-parallel mesh), and what puts them whole again."""

    def __init__(self, blocks: list[nn.Module], hooks: list[tuple[dict, list[int]]]) -> None:
        self.blocks = blocks
        self._hooks = hooks  # the forward hooks parallelize_module added: (the module's hook dict, their keys)

    def split_parameters(self) -> list[nn.Parameter]:
        """The parameters split over the tensor-parallel ranks (DTensors), each once."""
        seen: dict[int, nn.Parameter] = {}
        for block in self.blocks:
            for parameter in block.parameters():
                if isinstance(parameter, DTensor):
                    seen.setdefault(id(parameter), parameter)
        return list(seen.values())

    @contextmanager
    def whole_view(self, optimizers: Iterable[Optimizer] = ()) -> Iterator[None]:
        """While open, every split parameter is a whole plain tensor in its module and in ``optimizers`` (their state
        of it whole too), as with replicated stages; on leaving, the whole values (a loaded checkpoint's among them)
        go back into the slices. A collective over the stage's tensor-parallel ranks, in the same order on each."""
        swapped = [(parameter, nn.Parameter(parameter.full_tensor().detach(), parameter.requires_grad))
                   for parameter in self.split_parameters()]
        optimizers = list(optimizers)
        _replace(self.blocks, optimizers, {id(split): whole for split, whole in swapped}, _whole)
        try:
            yield
        finally:
            _replace(self.blocks, optimizers, {id(whole): split for split, whole in swapped}, _split_like)
            with torch.no_grad():
                for split, whole in swapped:
                    split.to_local().copy_(_split_like(whole.detach(), split).to_local())

    def make_whole(self, optimizers: Iterable[Optimizer] = ()) -> None:
        """After the run: every block whole again, as the user built it (plain parameters holding the trained values,
        no tensor-parallel hook); ``optimizers`` hold the whole parameters and their state whole too (a checkpoint
        saved after the run reads them). A collective over the stage's tensor-parallel ranks."""
        wholes = {id(p): nn.Parameter(p.full_tensor().detach(), p.requires_grad) for p in self.split_parameters()}
        _replace(self.blocks, list(optimizers), wholes, _whole)
        for block in self.blocks:
            for module in block.modules():
                module.__dict__.pop("_distribute_module_applied", None)
        for hook_dict, keys in self._hooks:
            for key in keys:
                hook_dict.pop(key, None)
        self.blocks, self._hooks = [], []


def parallelize_stage(
    blocks: Iterable[tuple[int, nn.Module]], plans: BlockPlans, mesh: DeviceMesh, group: dist.ProcessGroup
) -> StageTensorParallel:
    """Split each of this stage's ``blocks`` (by index in the region) over ``mesh`` (the stage's tensor-parallel
    ranks, the same ranks as ``group``) as ``plans`` says. A collective over them: the blocks' whole parameters and
    buffers are first made those of the first tensor-parallel rank, so that the slices and the whole parts agree."""
    blocks = list(blocks)
    source = dist.get_process_group_ranks(group)[0]
    with torch.no_grad():
        for _, block in blocks:
            for tensor in [*block.parameters(), *block.buffers()]:
                dist.broadcast(tensor.data, src=source, group=group)
    hooks: list[tuple[dict, list[int]]] = []
    for index, block in blocks:
        before = {id(m): (set(m._forward_pre_hooks), set(m._forward_hooks)) for m in block.modules()}
        plans.apply(index, block, mesh)
        for module in block.modules():
            pre, post = before.get(id(module), (set(), set()))
            hooks.append((module._forward_pre_hooks, [k for k in module._forward_pre_hooks if k not in pre]))
            hooks.append((module._forward_hooks, [k for k in module._forward_hooks if k not in post]))
    return StageTensorParallel([block for _, block in blocks], [(d, keys) for d, keys in hooks if keys])


def _whole(value: Any, _: Tensor) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _split_like(value: Any, parameter: Tensor) -> Any:
    """A tensor of ``parameter``'s whole shape (its value, or optimizer state of it) split as ``parameter`` is, from
    this rank's whole copy (every tensor-parallel rank holds the same); anything else as it is."""
    if not isinstance(value, Tensor) or isinstance(value, DTensor) or value.shape != parameter.shape:
        return value
    return distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                             src_data_rank=None)


def _replace(blocks: list[nn.Module], optimizers: list[Optimizer], replacement: dict[int, nn.Parameter],
             convert: Callable[[Any, Tensor], Any]) -> None:
    """``replacement[id(p)]`` in place of each parameter ``p`` it names, in the blocks' modules and in ``optimizers``
    (with ``p``'s state converted by ``convert(value, new parameter)``)."""
    for block in blocks:
        for module in block.modules():
            for name, parameter in list(module._parameters.items()):
                if parameter is not None and id(parameter) in replacement:
                    module._parameters[name] = replacement[id(parameter)]
    for optimizer in optimizers:
        replace_in_optimizer(optimizer, replacement, convert)
