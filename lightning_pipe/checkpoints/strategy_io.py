"""The strategy's checkpoints on one rank: what Lightning's checkpoint hooks read, load, save and export.

A checkpoint holds the whole model, numbered as on one device, so it loads anywhere. It is loaded after ``setup``
has split the model, memory-mapped: each rank copies out only its stage's weights and optimizer state, and the rest
of the file is never read into its memory. A model built on the meta device is saved sharded by default: each rank
writes its own stage. After a run the split is remembered, so that a checkpoint saved then still holds every
stage's optimizer state.

Where Lightning's own behaviour applies (a single stage, no stages held, another checkpoint IO), a method returns
``None`` or ``False`` and the strategy calls its base class.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer

from lightning_pipe.checkpoints.commit import save_committed
from lightning_pipe.checkpoints.export import export_pretrained_by_stage, library_model_prefix, parse_size
from lightning_pipe.checkpoints.integrity import check_sharded_checkpoint, refuse_interrupted_save
from lightning_pipe.checkpoints.optimizer_states import name_optimizer_state
from lightning_pipe.checkpoints.sharded import SHARDED, is_sharded_checkpoint
from lightning_pipe.checkpoints.sharded import load as load_sharded
from lightning_pipe.checkpoints.whole_model import (
    WholeModelLayout,
    group_names,
    held_state_dict,
    load_stage_optimizer_state,
    load_stage_state_dict,
    refuse_checkpoint_without_stages,
    whole_optimizer_state,
    whole_state_dict,
)
from lightning_pipe.execution.process_groups import PipelineGroups


@dataclass(frozen=True)
class StageCheckpoints:
    """This rank's part in the run's checkpoints, from what it holds now."""

    module: LightningModule | None
    # The user's pipelined module as it was; None where this process holds no stage (before set-up, the launching
    # process of spawn/fork after its workers ended, a failed run).
    pipelined: WholeModelLayout | None
    groups: PipelineGroups | None  # set wherever `pipelined` is
    num_stages: int
    save_distributed_checkpoint: bool | None = None  # the setting: sharded, one file, or None (as built)
    deferred: bool = False  # the pipelined module was built on the meta device
    pretrained_prefix: str | None = None  # where the pretrained model sits, once its weights were mapped

    @property
    def sharded(self) -> bool:
        """Written with torch.distributed.checkpoint, each rank its own stage: when asked, and by default for a model
        built on the meta device (which need not fit on one host)."""
        if self.save_distributed_checkpoint is not None:
            return self.save_distributed_checkpoint
        return self.deferred

    @property
    def writes_shards(self) -> bool:
        """Whether a save writes each rank's own share through torch.distributed.checkpoint: a stage sharded over
        its replicas (FSDP2) then writes its DTensors as they are, each replica its shard, never gathered whole."""
        return self.sharded and self._split

    @property
    def _split(self) -> bool:
        return self.pipelined is not None and self.num_stages > 1

    def read(
        self, path: str | Path, optimizers: Iterable[Optimizer], default_io: bool, weights_only: bool | None
    ) -> dict[str, Any] | None:
        """A sharded checkpoint's share for this rank, or a local checkpoint file memory-mapped
        (``torch.load(mmap=True)``), not read: its tensors take memory only where a rank copies them out. None for
        other checkpoint IO (remote paths, custom plugins: not ``default_io``), which Lightning's reads. A sharded
        checkpoint that is not whole is refused on every rank alike, before anything is read (see
        :mod:`lightning_pipe.checkpoints.integrity`)."""
        local = "://" not in str(path)
        if local and is_sharded_checkpoint(path):
            assert self.module is not None
            checked = check_sharded_checkpoint(path)
            optimizers = list(optimizers)
            names = [group_names(self.module, optimizer) for optimizer in optimizers]
            # A stage sharded over its replicas reads into its DTensors: each replica only its shard's rows.
            state = self.module.state_dict()
            parameters = {name: parameter for optimizer, groups in zip(optimizers, names)
                          for group, group_names_ in zip(optimizer.param_groups, groups)
                          for parameter, name in zip(group["params"], group_names_)}
            return load_sharded(checked.directory, set(state), names, weights_only, like=_sharded(state),
                                optimizer_like=_sharded(parameters))
        if local:
            refuse_interrupted_save(path)
        local_file = local and Path(path).is_file()
        if not (local_file and default_io and self.num_stages > 1):
            return None
        return torch.load(path, map_location="cpu", mmap=True, weights_only=weights_only)

    def load_model_state(self, checkpoint: Mapping[str, Any], strict: bool) -> bool:
        """Copy this rank's weights (its stage's and the replicated modules') out of the whole model's state dict;
        False where Lightning loads it (a whole model, or this rank's share of a sharded checkpoint)."""
        if self.pipelined is None or checkpoint.get(SHARDED):
            return False
        assert self.module is not None
        load_stage_state_dict(self.module, checkpoint["state_dict"], self.pipelined.state_keys, strict)
        return True

    def module_state(self) -> dict[str, Any]:
        """The whole model's state dict on the rank that writes checkpoints (global rank 0); a share elsewhere."""
        module = self.module
        assert module is not None
        if not self._split:
            return module.state_dict()
        if self.sharded:  # written by `write`: this rank's own weights
            return held_state_dict(module)
        assert self.pipelined is not None and self.groups is not None
        groups = self.groups
        return whole_state_dict(module, self.pipelined, groups.stage_ranks, groups.rank, groups.pipeline_cpu)

    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The whole model's optimizer state on the checkpoint writer, numbered as a single-device optimizer's."""
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # unwrap a LightningOptimizer
        if not self._split:
            return optimizer.state_dict()
        assert self.module is not None and self.pipelined is not None and self.groups is not None
        if self.sharded:  # written by `write`
            return name_optimizer_state(optimizer.state_dict(), group_names(self.module, optimizer))
        groups = self.groups
        return whole_optimizer_state(
            optimizer, self.module, self.pipelined.parameter_order, groups.stage_ranks, groups.rank, groups.pipeline_cpu
        )

    def write(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None, after_spawned_ranks: bool
    ) -> bool:
        """Write ``checkpoint`` sharded, each rank its own stage, committed whole or not at all (see
        :mod:`lightning_pipe.checkpoints.commit`); False where Lightning's checkpoint IO writes the whole model on
        rank 0. Raises where the stages' optimizer states are out of reach."""
        if self.pipelined is None and "optimizer_states" in checkpoint:
            refuse_checkpoint_without_stages(after_spawned_ranks, filepath)
        if not self.writes_shards:
            return False
        if storage_options is not None:
            raise TypeError("sharded checkpoints are written with torch.distributed.checkpoint, which takes no"
                            f" storage_options (got {storage_options!r}); pass save_distributed_checkpoint=False to"
                            " write one file through the checkpoint IO plugin.")
        if "://" in str(filepath):
            raise ValueError(f"sharded checkpoints are written into a local (or mounted) directory, and {filepath!r} is"
                             " remote; pass save_distributed_checkpoint=False to write one file through the"
                             " checkpoint IO plugin (fsspec).")
        assert self.pipelined is not None and self.groups is not None
        save_committed(checkpoint, filepath, self.pipelined.state_keys, self.pipelined.parameter_order, self.groups)
        return True

    def load_optimizer_states(
        self, optimizers: Iterable[Optimizer], checkpoint: Mapping[str, Any], device: torch.device
    ) -> bool:
        """Load each optimizer's stage share of the whole model's optimizer states; False where Lightning loads
        them (a single stage, or this rank's share of a sharded checkpoint)."""
        if not self._split or checkpoint.get(SHARDED):
            return False
        assert self.module is not None and self.pipelined is not None and self.groups is not None
        for optimizer, saved in zip(optimizers, checkpoint["optimizer_states"]):
            load_stage_optimizer_state(
                optimizer, saved, self.module, self.pipelined.parameter_order, self.groups.pipeline_cpu, device
            )
        return True

    def save_pretrained(
        self,
        directory: str | Path,
        prefix: str | None,
        dtype: torch.dtype | str | None,
        max_shard_size: str | int | None = None,
    ) -> None:
        """Write the model as a Hugging Face directory that ``from_pretrained`` loads: one safetensors shard per
        stage (or, with ``max_shard_size`` such as ``"2GB"``, shards of at most that size), written by the stage
        that holds it (nothing is gathered), the index and the model's config written by global rank 0. Each
        tensor is written once, by one replica: a tensor tied across stages (a head sharing the embedding's weight)
        under the name ``save_pretrained`` gives it, and ``from_pretrained`` ties it again. Called on every rank, as ``trainer.save_checkpoint``, after ``fit`` or in a callback (the
        strategy's ``save_pretrained``, which then waits for every rank).

        ``prefix``: where the library's model sits in the LightningModule (``"model."``), whose keys lose it; by
        default the prefix the pretrained weights were mapped with, else the one Hugging Face model's place, else
        none. Keys outside it are left out (a warning names them). ``dtype``: cast every tensor (``"bfloat16"``);
        by default each keeps its own.
        """
        module = self.module
        if self.pipelined is None or module is None:
            raise RuntimeError(
                f"save_pretrained({str(directory)!r}) needs the pipeline's stages, which this process does not hold"
                " (the launching process of gpipe_spawn / gpipe_fork, or a run that failed). Call it on every rank"
                " with the default start method, or write a checkpoint and run"
                " `lightning-pipe export_pretrained CHECKPOINT DIRECTORY`."
            )
        if prefix is None:
            prefix = self.pretrained_prefix if self.pretrained_prefix is not None else library_model_prefix(module)
        if not any(key.startswith(prefix) for key in self.pipelined.state_keys):
            raise ValueError(
                f"save_pretrained(prefix={prefix!r}): no key of the model starts with it; give the path of the model"
                f" to write in the LightningModule, with its dot (e.g. {library_model_prefix(module) or 'model.'!r})."
            )
        assert self.groups is not None
        groups = self.groups
        left_out = export_pretrained_by_stage(
            module, self.pipelined, Path(directory), prefix, dtype, groups.stage, groups.stage_ranks, groups.rank,
            groups.pipeline_cpu, writes=groups.replica == 0 and groups.tensor_index == 0,
            max_shard_bytes=parse_size(max_shard_size) if max_shard_size is not None else None,
        )
        if left_out:
            rank_zero_warn(f"save_pretrained left out the keys outside the prefix {prefix!r}: {left_out}")


def _sharded(tensors: Mapping[str, Any]) -> dict[str, DTensor]:
    """The DTensors among ``tensors`` (a stage's parameters and state sharded over its replicas)."""
    return {name: tensor for name, tensor in tensors.items() if isinstance(tensor, DTensor)}
