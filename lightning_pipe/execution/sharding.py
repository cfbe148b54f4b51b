"""A stage's blocks sharded over its data-parallel replicas with torch's FSDP2 (``data_parallel="shard"`` or
``"full_shard"``): wrapped once at set-up, gathered as the schedule needs them, reduce-scattered once per step.

Each held block with parameters becomes its own ``fully_shard`` module over the replicas' dimension of the rank mesh
(a ``DeviceMesh`` over the stage's replica group), as torchtitan wraps each transformer block. Under a pipeline a
step runs many forwards and backwards of a block, one per micro-batch, so FSDP2 is driven as torch's pipelining
schedules drive it (``torch/distributed/pipelining/stage.py``, ``backward_maybe_with_nosync`` and
``perform_reduce_grad``):

* every backward of the step runs with gradient sync off (``set_requires_gradient_sync(False)``), keeping the
  gathered weights (``set_reshard_after_backward(False)``): each micro-batch's weight gradients accumulate on the
  gathered (unsharded) parameters;
* ``"shard"`` (``reshard_after_forward=False``, ZeRO-2 as torchtitan runs it under a pipeline): each block's
  weights are gathered once per step, at its first forward, and kept; after the step's last backward
  :meth:`StageSharding.reduce_scatter_gradients` runs FSDP2's post-backward once with sync on: one reduce-scatter
  per block per step, averaging over the replicas, leaving each rank the gradient of its shard, and the weights are
  released. During the step a rank holds its stage's whole weights and whole (accumulated) gradients.
* ``"full_shard"`` (``reshard_after_forward=True``, ZeRO-3): the weights are released after every forward and every
  backward, so each micro-batch gathers them for its forward and again for its backward, and each micro-batch's
  gradient is reduce-scattered as soon as its backward on the block's chunk ends (both halves, when the schedule
  splits it: :meth:`StageSharding.micro_batch_done`, called by the engine), adding into the shard's gradient. A
  rank then never holds more than its shards and the blocks running.

The modules outside the blocks that the stage holds (the embedding on the first stage, the final norm and the head
on the loss stage: :mod:`lightning_pipe.execution.outside`) are sharded the same way, each its own ``fully_shard``
module, in either mode gathered for their forward as FSDP2 does and reduce-scattered once per step, at the step's
end (they run in the user's step, outside the schedule's chunks): under ``"full_shard"`` their whole gradient is
held through the step, as ``"shard"`` holds every gradient.

Parameters that the pipeline keeps whole on every replica are left out of the shards (``ignored_params``): a
parameter tied to another stage's block, or to a module outside the blocks, whose gradient is summed over the
stages holding it before the replicas average it (see :mod:`lightning_pipe.execution.tied`), one that two of the
stage's sharded modules share, and one that every stage holds (a loose parameter of the model, an outside module no
step showed where it runs): each stays one whole tensor, equal on every rank as one device's.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from lightning_pipe.reliability.watchdog import UNWATCHED, StallWatchdog

DataParallelMode = Literal["replicate", "shard", "full_shard"]


class StageSharding:
    """This rank's sharded blocks (FSDP2 modules over the stage's replica group), and what drives them in a step."""

    def __init__(
        self, blocks: list[FSDPModule], mode: DataParallelMode, group: dist.ProcessGroup, watchdog: StallWatchdog,
        watched: list[RemovableHandle], outside: list[FSDPModule] | None = None,
    ) -> None:
        self.blocks = blocks
        self.outside = outside or []  # the sharded modules outside the blocks: reduce-scattered at the step's end
        self._watched = watched  # the hooks that gather each module's weights under the watchdog
        self.mode = mode
        self.group = group
        self.watchdog = watchdog
        self.sharded_ids = {id(p) for module in self.modules for p in _sharded_parameters(module)}
        self._ids = {id(block) for block in blocks}

    @property
    def modules(self) -> list[FSDPModule]:
        """Every sharded module of the stage: its blocks, then the modules outside them that it holds."""
        return [*self.blocks, *self.outside]

    def is_sharded(self, parameter: Tensor) -> bool:
        return id(parameter) in self.sharded_ids

    def micro_batch_done(self, blocks: Iterable[nn.Module]) -> None:
        """Under ``"full_shard"``: a chunk's backward of one micro-batch ended (both halves, when split), so its
        blocks' gradients are reduce-scattered now, each rank adding its shard's to its gradient: the stage never
        holds its whole gradient. (``"shard"`` waits for the step's end: :meth:`reduce_scatter_gradients`.)"""
        if self.mode != "full_shard":
            return
        mine = [block for block in blocks if isinstance(block, FSDPModule) and id(block) in self._ids]
        if mine:
            self._reduce_scatter(mine)

    def reduce_scatter_gradients(self) -> None:
        """The step's gradients of every sharded block, accumulated over its micro-batches on the gathered weights,
        averaged over the replicas and reduce-scattered: each rank keeps its shard's gradient (added to the shard's
        ``grad`` when one is there, as gradient accumulation over several batches adds). The weights are released.
        (Under ``"full_shard"`` each micro-batch's were already: nothing is left to reduce but the outside
        modules'.)"""
        self._reduce_scatter(self.modules)

    def _reduce_scatter(self, blocks: list[FSDPModule]) -> None:
        waited = self.watchdog.collective("the sharded gradients' reduce-scatter over the replicas", self.group)
        with self.watchdog.waiting(waited):
            _same_gradients_on_every_replica(blocks, self.group)
            for block in blocks:
                _syncing(block, True, self.mode)
                state = fully_shard.state(block)  # type: ignore[attr-defined]
                for inner in state._state_ctx.all_states:
                    for param_group in inner._fsdp_param_groups:
                        param_group.post_backward()
                # Waits for the reduce-scatters, moves their output into the shards' gradients, resets the step.
                state._root_post_backward_final_callback()
                _syncing(block, False, self.mode)

    @contextmanager
    def whole_view(self, optimizers: Iterable[Optimizer] = ()) -> Iterator[None]:
        """While open, every sharded parameter is a whole plain tensor in its module and in ``optimizers`` (their
        state of it whole too): the checkpoint code reads and writes whole tensors, as with replicated stages. On
        leaving, the whole values, changed or not, go back into the shards (a loaded checkpoint's among them). A
        collective over the replicas, in the same order on each."""
        swapped: list[tuple[Any, nn.Parameter]] = []  # (FSDP2's parameter, its whole stand-in)
        hooks = _fsdp_state_dict_hooks_set_aside(self.modules)  # they expect the shards in the modules
        for block in self.modules:
            block.reshard()  # the modules hold the shards; the next forward gathers what the view leaves
            for fsdp_param in _fsdp_params(block):
                sharded = fsdp_param.sharded_param
                whole = nn.Parameter(sharded.full_tensor().detach(), requires_grad=sharded.requires_grad)
                _set_on_modules(fsdp_param, whole)
                swapped.append((fsdp_param, whole))
        to_whole = {id(fsdp_param.sharded_param): whole for fsdp_param, whole in swapped}
        optimizers = list(optimizers)
        for optimizer in optimizers:
            replace_in_optimizer(optimizer, to_whole, _whole)
        try:
            yield
        finally:
            back = {id(whole): fsdp_param.sharded_param for fsdp_param, whole in swapped}
            for optimizer in optimizers:
                replace_in_optimizer(optimizer, back, _shard_like)
            for fsdp_param, whole in swapped:
                sharded = fsdp_param.sharded_param
                _set_on_modules(fsdp_param, sharded)
                with torch.no_grad():
                    sharded.to_local().copy_(_shard_like(whole.detach(), sharded).to_local())
            for hook_dict, kept in hooks:
                hook_dict.update(kept)

    def make_whole(self, optimizers: Iterable[Optimizer] = ()) -> None:
        """After the run: every sharded module whole again, as the user built it (its own class, plain parameters
        holding the trained values gathered from every replica's shard, no FSDP2 hook), so that the model comes back
        as one device's would; ``optimizers`` hold the whole parameters and their state whole too (a checkpoint
        saved after the run reads them). A collective over the replicas; the sharding is over."""
        _fsdp_state_dict_hooks_set_aside(self.modules)  # for good
        to_whole: dict[int, Tensor] = {}
        for block, watched in zip(self.modules, self._watched):
            watched.remove()
            block.reshard()
            state = fully_shard.state(block)  # type: ignore[attr-defined]
            for param_group in state._fsdp_param_groups:
                for fsdp_param in param_group.fsdp_params:
                    sharded = fsdp_param.sharded_param
                    whole = nn.Parameter(sharded.full_tensor().detach(), sharded.requires_grad)
                    _set_on_modules(fsdp_param, whole)
                    to_whole[id(sharded)] = whole
            state._pre_forward_hook_handle.remove()
            state._post_forward_hook_handle.remove()
            block.__class__ = type(block).__bases__[1]  # fully_shard made it a subclass of (FSDPModule, its class)
        for optimizer in optimizers:  # in the same order on every replica: their state's gathering is collective
            replace_in_optimizer(optimizer, to_whole, _whole)
        self.blocks, self.outside, self._watched, self.sharded_ids, self._ids = [], [], [], set(), set()


def shard_stage(
    blocks: Iterable[tuple[str, nn.Module]],
    mode: DataParallelMode,
    group: dist.ProcessGroup,
    device: torch.device,
    kept_whole: Iterable[Tensor] = (),
    watchdog: StallWatchdog = UNWATCHED,
    outside: Iterable[tuple[str, nn.Module]] = (),
    precision: str | None = None,
    mesh: DeviceMesh | None = None,
) -> StageSharding:
    """Wrap each of ``blocks`` and of the ``outside`` modules the stage holds (each by its name in the model) that
    holds parameters to shard (not one of ``kept_whole``) with ``fully_shard`` over ``group``, in Lightning's
    ``precision`` (see :func:`mixed_precision`); ``mesh``: the mesh of ``group`` where blocks split with tensor
    parallelism need the run's, else one is made of ``group``. A collective over ``group``: its ranks must hold the
    same values already (the pipeline broadcast them from the first replica)."""
    blocks, outside = list(blocks), list(outside)
    refuse_sharded_already([*blocks, *outside])
    mesh = mesh if mesh is not None else DeviceMesh.from_group(group, device.type)
    whole = {id(t) for t in kept_whole}
    # A parameter two of this stage's modules share (a tie within the stage) stays whole too: FSDP2 shards a
    # parameter for one module only.
    seen: set[int] = set()
    for _, module in [*blocks, *outside]:
        ids = {id(p) for p in module.parameters()}
        whole |= ids & seen
        seen |= ids
    watched: list[RemovableHandle] = []
    policy = mixed_precision(precision)

    def wrapped(modules: list[tuple[str, nn.Module]]) -> list[FSDPModule]:
        done = []
        for _, module in modules:
            shardable = [p for p in module.parameters() if id(p) not in whole]
            if not shardable:
                continue
            ignored = {p for p in module.parameters() if id(p) in whole}
            fully_shard(module, mesh=mesh, reshard_after_forward=mode == "full_shard", ignored_params=ignored or None,
                        mp_policy=policy)
            sharded: FSDPModule = module  # type: ignore[assignment]
            _syncing(sharded, False, mode)
            watched.append(module.register_forward_pre_hook(_gather_watched(sharded, watchdog, group), prepend=True))
            done.append(sharded)
        return done

    sharded_blocks = wrapped(blocks)
    return StageSharding(sharded_blocks, mode, group, watchdog, watched, outside=wrapped(outside))


def mixed_precision(precision: str | None) -> MixedPrecisionPolicy:
    """FSDP2's precision for Lightning's ``precision``: under ``"bf16-mixed"`` the weights are gathered in bfloat16
    (half the all-gather, and the stage's whole weights held in bfloat16 during the step, as torchtitan runs) while
    the shards, their gradients and the optimizer state stay float32, and gradients are reduce-scattered (and
    accumulated over the micro-batches) in float32; Lightning's autocast still runs around the step, for the modules
    kept whole. Any other precision: FSDP2's default (the parameters' own dtype)."""
    if precision == "bf16-mixed":
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def refuse_sharded_already(blocks: Iterable[tuple[str, nn.Module]]) -> None:
    """Raise, naming the module, when the user's code already called ``fully_shard`` on a pipelined block or a module
    outside the blocks that a stage holds (or inside one): the pipeline shards them itself, over the replicas of their
    stage only."""
    for name, block in blocks:
        inner = next((n for n, m in block.named_modules() if isinstance(m, FSDPModule)), None)
        if inner is not None:
            where = f"{name}.{inner}" if inner else name
            raise ValueError(
                f"the pipelined module {where!r} was already wrapped with fully_shard (FSDP2) by the model's own code,"
                " but GPipeStrategy shards each block (and each module outside the blocks a stage holds) itself, over"
                " the data-parallel replicas of its stage only: a model-wide mesh would mix the stages. Remove the"
                " fully_shard calls for the model's modules and use"
                " GPipeStrategy(data_parallel='shard') (or 'full_shard')."
            )


def scaler_refused(mode: str) -> str:
    """Why a sharded stage does not train with a gradient scaler (``16-mixed``) yet, and what to do instead."""
    return (
        f"precision='16-mixed' with data_parallel={mode!r} is not supported yet: its gradient scaler unscales the"
        " sharded blocks' gradients (FSDP2 DTensors) and the stage's whole ones in one call, which torch refuses."
        " Use precision='bf16-mixed' (no scaler), or data_parallel='replicate' with 16-mixed."
    )


def weights_in_graph(blocks: Iterable[nn.Module]) -> list[Tensor]:
    """The parameters of ``blocks`` (a chunk's) that their forward's autograd graph holds, needing a gradient: for the
    split backward's weight half (:mod:`lightning_pipe.execution.split_backward`)."""
    return [weight for block in blocks for weight in _block_weights_in_graph(block)]


def _block_weights_in_graph(block: nn.Module) -> list[Tensor]:
    """A sharded block's gathered (unsharded) weights, which FSDP2 keeps as the same tensors from one gathering to the
    next, and the parameters it keeps whole; any other block's own parameters."""
    if not isinstance(block, FSDPModule):
        return [p for p in block.parameters() if p.requires_grad]
    sharded = set()
    weights: list[Tensor] = []
    state = fully_shard.state(block)  # type: ignore[attr-defined]
    for param_group in state._fsdp_param_groups:
        for fsdp_param in param_group.fsdp_params:
            sharded.add(id(fsdp_param.sharded_param))
            if fsdp_param.sharded_param.requires_grad and hasattr(fsdp_param, "_unsharded_param"):
                weights.append(fsdp_param._unsharded_param)
    return weights + [p for p in block.parameters() if p.requires_grad and id(p) not in sharded
                      and not isinstance(p, DTensor) and not any(p is w for w in weights)]


def local_squared_norm(grads: list[Tensor], device: torch.device) -> Tensor:
    """The squared 2-norm of this rank's shards of ``grads`` (DTensors), in float64 (zero for none)."""
    if not grads:
        return torch.zeros((), device=device, dtype=torch.float64)
    local = [g.to_local() for g in grads]
    return torch.nn.utils.get_total_norm(local).to(device, torch.float64).square()


def scale_sharded_gradients(parameters: Iterable[nn.Parameter], coefficient: Tensor) -> None:
    """Multiply the local shards of the sharded parameters' gradients by ``coefficient``, as
    ``clip_grads_with_norm_`` multiplies whole gradients."""
    locals_ = [p.grad.to_local() for p in parameters if p.grad is not None]
    if locals_:
        torch._foreach_mul_(locals_, coefficient.to(locals_[0].device))


def _sharded_parameters(block: FSDPModule) -> Iterator[Tensor]:
    for fsdp_param in _fsdp_params(block):
        yield fsdp_param.sharded_param


def _fsdp_params(block: FSDPModule) -> Iterator[Any]:
    state = fully_shard.state(block)  # type: ignore[attr-defined]
    for param_group in state._fsdp_param_groups:
        yield from param_group.fsdp_params


def _same_gradients_on_every_replica(blocks: list[FSDPModule], group: dist.ProcessGroup) -> None:
    """Every replica reduce-scatters the same parameters: those some replica computed a gradient for (a block's branch
    that only some replicas' data took), a zero gradient standing in where this replica has none. One small
    all-reduce of the flags. A parameter no replica used keeps no gradient, as on one device (and as the replicated
    stages' all-reduce decides); without it, the replicas' reduce-scatters would differ in size."""
    params = [fsdp_param for block in blocks for fsdp_param in _fsdp_params(block)
              if fsdp_param.sharded_param.requires_grad and hasattr(fsdp_param, "_unsharded_param")]
    if not params:
        return
    has = [fsdp_param.unsharded_accumulated_grad is not None or fsdp_param.unsharded_param.grad is not None
           for fsdp_param in params]
    flags = torch.tensor(has, dtype=torch.uint8, device=params[0].sharded_param.device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    for fsdp_param, mine, anyone in zip(params, has, flags.tolist()):
        if anyone and not mine:
            fsdp_param.unsharded_param.grad = torch.zeros_like(fsdp_param.unsharded_param)


_STATE_DICT_HOOKS = ("_state_dict_pre_hooks", "_state_dict_hooks", "_load_state_dict_pre_hooks",
                     "_load_state_dict_post_hooks")


def _fsdp_state_dict_hooks_set_aside(blocks: Iterable[nn.Module]) -> list[tuple[dict, dict]]:
    """FSDP2's state-dict hooks taken out of the blocks' modules (each hook dictionary, and what was taken), to be put
    back: they move the shards in and out of the modules, which hold whole tensors while checkpoints read them."""
    taken = []
    for block in blocks:
        for module in block.modules():
            for name in _STATE_DICT_HOOKS:
                hook_dict = getattr(module, name)
                ours = {key: hook for key, hook in hook_dict.items()
                        if getattr(getattr(hook, "hook", hook), "__module__", "").startswith("torch.distributed.fsdp")}
                for key in ours:
                    del hook_dict[key]
                if ours:
                    taken.append((hook_dict, ours))
    return taken


def _set_on_modules(fsdp_param: Any, parameter: nn.Parameter) -> None:
    """``parameter`` in the place of FSDP2's parameter, in every module that holds it."""
    info = fsdp_param._module_info
    for module, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
        module._parameters[name] = parameter


def _whole(value: Any, _: Tensor) -> Any:
    return value.full_tensor() if isinstance(value, DTensor) else value


def _shard_like(value: Any, parameter: Tensor) -> Any:
    """A tensor of ``parameter``'s whole shape (its value, or optimizer state of it) as ``parameter`` is sharded,
    from this rank's whole copy (every replica holds the same); anything else as it is."""
    if not isinstance(value, Tensor) or isinstance(value, DTensor) or value.shape != parameter.shape:
        return value
    return distribute_tensor(value.to(parameter.device), parameter.device_mesh, parameter.placements,
                             src_data_rank=None)


def replace_in_optimizer(
    optimizer: Optimizer, replacement: dict[int, Tensor], convert: Callable[[Any, Tensor], Any]
) -> None:
    """Put ``replacement[id(p)]`` in place of each parameter ``p`` of ``optimizer`` that it names, with the state
    of ``p`` converted by ``convert(value, new parameter)`` (DTensors to whole tensors, or back)."""
    state = optimizer.state
    for group in optimizer.param_groups:
        params = group["params"]
        for i, parameter in enumerate(params):
            new = replacement.get(id(parameter))
            if new is None:
                continue
            params[i] = new
            if parameter in state:
                entries = state.pop(parameter)
                state[new] = {key: convert(value, new) if isinstance(value, Tensor) and value.dim() > 0 else value
                              for key, value in entries.items()}


def _syncing(block: FSDPModule, last: bool, mode: DataParallelMode) -> None:
    """Gradient sync on (``last``: the step's reduce-scatter) or off (every micro-batch's backward). Between
    micro-batches ``"shard"`` keeps the gathered weights, ``"full_shard"`` releases them after each backward too."""
    block.set_is_last_backward(last)
    block.set_requires_gradient_sync(last, recurse=True)
    block.set_reshard_after_backward(last or mode == "full_shard", recurse=True)


def _gather_watched(block: FSDPModule, watchdog: StallWatchdog, group: dist.ProcessGroup):  # noqa: ANN202
    """A forward pre-hook, run before FSDP2's own: the block's weights gathered under the stall watchdog (FSDP2's
    hook then finds them gathered). Run as it is under ``torch.compile`` of the block, as FSDP2 runs its own hooks: the
    watchdog's clock and the collective are no code to trace."""

    @torch.compiler.disable(reason="the sharded weights' gathering, watched")
    def gather(module: nn.Module, args: tuple) -> None:
        with watchdog.waiting(watchdog.collective("the sharded weights' all-gather over the replicas", group)):
            block.unshard()

    return gather
