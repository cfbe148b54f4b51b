"""GPipe pipeline parallelism for PyTorch Lightning.

``import lightning_pipe`` registers the strategies ``"gpipe"``, ``"gpipe_spawn"`` and ``"gpipe_fork"``, so that
``Trainer(strategy="gpipe", devices=N)`` trains an unchanged LightningModule on ``N`` pipeline stages.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.config import PipelineParallelConfig
from lightning_pipe.strategy import GPipeStrategy

if "gpipe" not in StrategyRegistry:
    GPipeStrategy.register_strategies(StrategyRegistry)

__all__ = ["GPipeStrategy", "PipelineParallelConfig"]
__version__ = "0.1.0"
