"""Train a small byte-level GPT on the Python standard library's own sources as a GPipe pipeline, set up by Hydra.

    python examples/train.py                                  # 2 stages on the CPU, a minute or two
    python examples/train.py strategy.num_stages=4 strategy.num_micro_batches=16
    python examples/train.py trainer=gpu                      # one CUDA device per stage
    python examples/train.py trainer.devices=4 strategy.num_stages=2 strategy.data_parallel=shard  # 2 replicas sharding each stage
    python examples/train.py -m strategy.num_stages=1,2,4     # a sweep: comparison.csv and .md in its directory
    python examples/train.py hydra.run.dir=DIR ckpt_path=last # resume the run in DIR from its last checkpoint

The config tree is ``conf/`` at the repository root; ``--cfg job`` prints the composed config without training.
"""

from __future__ import annotations

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.utils import instantiate
from lightning.pytorch import seed_everything
from lightning.pytorch.callbacks import ModelCheckpoint
from omegaconf import DictConfig

from lightning_pipe.integration.hydra_schema import validate_config  # importing it registers the strategy schema before Hydra composes
from report import RunReport


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float | None:
    """One training run; returns the final validation loss (what a Hydra sweeper would minimise)."""
    validate_config(cfg)  # bad values fail here, naming their key, before any process starts
    seed_everything(cfg.seed, workers=True)  # every rank builds the same initial weights
    out_dir = HydraConfig.get().runtime.output_dir
    run_dir = cfg.trainer.default_root_dir or out_dir
    callbacks = [RunReport(out_dir)]
    if cfg.trainer.enable_checkpointing:  # at every validation, and last.ckpt: what `ckpt_path=last` resumes from
        callbacks.append(ModelCheckpoint(dirpath=f"{run_dir}/checkpoints", save_last=True))
    trainer = instantiate(
        cfg.trainer,
        strategy=instantiate(cfg.strategy, _convert_="all"),
        callbacks=callbacks,
        default_root_dir=run_dir,
    )
    trainer.fit(instantiate(cfg.model), datamodule=instantiate(cfg.data), ckpt_path=cfg.ckpt_path)
    val_loss = trainer.callback_metrics.get("val_loss")
    return float(val_loss) if val_loss is not None else None


if __name__ == "__main__":  # the spawn launcher (used in sweeps) re-imports this file in every rank
    main()
