"""GPipe pipeline parallelism for PyTorch Lightning.

``import lightning_pipe`` registers the strategies ``"gpipe"``, ``"gpipe_spawn"`` and ``"gpipe_fork"``, so that
``Trainer(strategy="gpipe", devices=N)`` trains an unchanged LightningModule on ``N`` pipeline stages.
"""

import sys

from lightning.pytorch.strategies import StrategyRegistry

from lightning_pipe.config import PipelineParallelConfig
from lightning_pipe.materialize import init_weights
from lightning_pipe.pretrained import PretrainedWeights
from lightning_pipe.strategy import GPipeStrategy

if "gpipe" not in StrategyRegistry:
    GPipeStrategy.register_strategies(StrategyRegistry)


def _refuse_pytorch_lightning(**_: object) -> None:
    raise TypeError(
        "lightning_pipe works with the `lightning` package: replace `import pytorch_lightning as pl` with"
        " `import lightning.pytorch as pl` (and `from pytorch_lightning import ...` with"
        " `from lightning.pytorch import ...`), then use Trainer(strategy='gpipe')."
    )


# A script that imported the standalone `pytorch_lightning` package gets a clear error, not "invalid strategy".
if "pytorch_lightning" in sys.modules:
    from pytorch_lightning.strategies import StrategyRegistry as _StandaloneRegistry

    for _name in ("gpipe", "gpipe_spawn", "gpipe_fork"):
        if _name not in _StandaloneRegistry:
            _StandaloneRegistry.register(_name, _refuse_pytorch_lightning, description="needs `lightning`")

__all__ = ["GPipeStrategy", "PipelineParallelConfig", "PretrainedWeights", "init_weights"]
__version__ = "0.1.0"
