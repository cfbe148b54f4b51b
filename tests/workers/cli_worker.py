"""A LightningCLI script, as a user would write one; the strategy is chosen on the command line."""

import torch
from lightning.pytorch import LightningDataModule
from lightning.pytorch.cli import LightningCLI

from helpers.models import PipeClassifier, loaders
from helpers.process_exit import skip_the_last_collection

skip_the_last_collection()  # in every process that runs this script, ranks included


class ClassificationData(LightningDataModule):
    def __init__(self, batch_size: int = 16) -> None:
        super().__init__()
        self.train, self.val = loaders(64, 32, batch_size)

    def train_dataloader(self):
        return self.train

    def val_dataloader(self):
        return self.val


class ReportingCLI(LightningCLI):
    def after_fit(self):
        strategy = self.trainer.strategy
        print(f"RESULT rank={self.trainer.global_rank} strategy={type(strategy).__name__}"
              f" micro_batches={strategy.config.num_micro_batches} steps={self.trainer.global_step}", flush=True)
        torch.save(self.model.state_dict(), f"rank{self.trainer.global_rank}.pt")  # the whole model, on every rank


if __name__ == "__main__":
    ReportingCLI(PipeClassifier, ClassificationData)
