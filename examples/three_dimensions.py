"""Three dimensions on the CPU: a tiny Llama over 2 pipeline stages x 2 data-parallel replicas x 2 tensor-parallel
ranks (8 processes). Each stage's blocks are split by the model's own plan (``config.base_model_tp_plan``: q, k, v
and the MLP's gate and up projections column-wise, o and down row-wise) and sharded over the stage's replicas with
FSDP2 (``data_parallel="shard"``): torchtitan's 3D layout, from a Lightning Trainer.

    python examples/three_dimensions.py
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from lightning_pipe import GPipeStrategy


class TinyLlama(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
        self.model = LlamaForCausalLM(config)

    def training_step(self, batch, batch_idx):
        loss = self.model(input_ids=batch, labels=batch).loss
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)  # averaged over the replicas
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


def main() -> None:
    tokens = torch.randint(0, 128, (64, 32), generator=torch.Generator().manual_seed(0))
    strategy = GPipeStrategy(num_stages=2, tensor_parallel_size=2, data_parallel="shard", num_micro_batches=4)
    trainer = Trainer(accelerator="cpu", devices=8, strategy=strategy, max_steps=4, logger=False,
                      enable_checkpointing=False, enable_model_summary=False)
    trainer.fit(TinyLlama(), DataLoader(tokens, batch_size=8))
    if trainer.global_rank == 0:
        layout = strategy.layout
        print(f"trained {trainer.global_step} steps on {layout.num_stages} stages x {layout.num_replicas} replicas x"
              f" {layout.tensor_parallel} tensor-parallel ranks; last loss {float(trainer.callback_metrics['train_loss']):.3f}")


if __name__ == "__main__":
    main()
