"""GPipe pipeline parallelism for PyTorch Lightning.

``import lightning_pipe`` registers the strategies ``"gpipe"``, ``"gpipe_spawn"`` and ``"gpipe_fork"``, so that
``Trainer(strategy="gpipe", devices=N)`` trains an unchanged LightningModule on ``N`` pipeline stages: the Trainer of
``lightning.pytorch``, and that of the standalone ``pytorch_lightning`` package where it is installed (see
:mod:`lightning_pipe.integration.lightning_packages`).
"""

import importlib.metadata
import importlib.util

from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry
from packaging.version import Version

from lightning_pipe.checkpoints.pretrained import PretrainedWeights
from lightning_pipe.partition.counts import PipelineParallelConfig
from lightning_pipe.integration import former_paths
from lightning_pipe.execution.materialize import init_weights
from lightning_pipe.integration.lightning_packages import LIGHTNING_RELEASES
from lightning_pipe.strategy import GPipeStrategy

if "gpipe" not in StrategyRegistry:
    GPipeStrategy.register_strategies(StrategyRegistry)


def _register_for_pytorch_lightning() -> None:
    """The standalone package's Trainer gets the strategy too, if its release is one ``lightning`` may be; an older
    or newer one gets an error naming the releases that work."""
    if importlib.util.find_spec("pytorch_lightning") is None:
        return
    version = importlib.metadata.version("pytorch-lightning")
    if Version(version) not in LIGHTNING_RELEASES:
        try:
            from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry
        except Exception:  # a release too old to import here is not one a project can train with either
            return

        def refuse(**_: object) -> None:
            raise TypeError(
                f"lightning_pipe works with pytorch-lightning {LIGHTNING_RELEASES}, as with lightning; pytorch-lightning"
                f" {version} is installed. Install pytorch-lightning{LIGHTNING_RELEASES}, or import the Trainer from"
                " lightning.pytorch instead of pytorch_lightning."
            )

        for name in ("gpipe", "gpipe_spawn", "gpipe_fork"):
            if name not in StandaloneRegistry:
                StandaloneRegistry.register(name, refuse, description=f"needs pytorch-lightning{LIGHTNING_RELEASES}")
        return
    from pytorch_lightning.strategies import ParallelStrategy as StandaloneParallelStrategy
    from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry

    from lightning_pipe.standalone import GPipeStrategy as StandaloneGPipeStrategy

    if "gpipe" not in StandaloneRegistry:
        StandaloneGPipeStrategy.register_strategies(StandaloneRegistry)
    # Either package's Trainer takes either package's strategy object; it adopts the Trainer's package on set-up.
    StandaloneParallelStrategy.register(GPipeStrategy)
    ParallelStrategy.register(StandaloneGPipeStrategy)
    GPipeStrategy.register(StandaloneGPipeStrategy)


_register_for_pytorch_lightning()
former_paths.install()

__all__ = ["GPipeStrategy", "PipelineParallelConfig", "PretrainedWeights", "init_weights"]
__version__ = "0.1.0"
