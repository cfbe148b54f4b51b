"""The gpipe strategy of the standalone ``pytorch_lightning`` package (``import pytorch_lightning as pl``).

The same strategy as :class:`lightning_pipe.strategy.GPipeStrategy`, derived from ``pytorch_lightning``'s classes so
that its Trainer accepts it, with the launchers likewise (see :mod:`lightning_pipe.integration.lightning_packages`). ``import lightning_pipe``
imports this module when ``pytorch_lightning`` is installed in the release range that ``lightning`` is, registers
``strategy="gpipe"`` (and ``"gpipe_spawn"``, ``"gpipe_fork"``) in its registry too, and lets each package's
``ParallelStrategy`` accept the other's gpipe strategy, which becomes the Trainer's on set-up.
"""

from __future__ import annotations

from lightning_fabric.plugins import TorchCheckpointIO
from lightning_fabric.utilities.warnings import PossibleUserWarning
from pytorch_lightning.strategies import ParallelStrategy
from pytorch_lightning.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from pytorch_lightning.strategies.strategy import _ForwardRedirection

from lightning_pipe.integration.launchers import ModelCheck, SpawnedRanks
from lightning_pipe.integration.lightning_packages import STANDALONE, LightningPackage, register_package
from lightning_pipe.strategy import GPipeStrategyMixin


class GPipeStrategy(GPipeStrategyMixin, ParallelStrategy):
    __doc__ = GPipeStrategyMixin.__doc__


class CheckedSubprocessScriptLauncher(ModelCheck, _SubprocessScriptLauncher):
    pass


class CheckedMultiProcessingLauncher(SpawnedRanks, _MultiProcessingLauncher):
    pass


GPipeStrategy.lightning_package = LightningPackage(
    STANDALONE, GPipeStrategy, CheckedSubprocessScriptLauncher, CheckedMultiProcessingLauncher, PossibleUserWarning,
    TorchCheckpointIO, _ForwardRedirection,
)
register_package(GPipeStrategy.lightning_package)
