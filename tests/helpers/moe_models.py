"""Mixture-of-experts LightningModules, as their users write them: Hugging Face Mixtral and Qwen2-MoE with their
default experts kernel, and a hand-written top-k block whose routing uses ``torch.nonzero``.

What they share: each block routes every token to ``k`` of its experts by the token's values, so which expert
computes what (and, in the hand-written block, how many rows each expert's matrix product has) depends on the data.
Such code cannot run on the meta device, where a stage learns the shapes of the blocks it does not hold; the output
of each block still has its input's shape. Tiny configurations, random weights, no downloads, as in
``helpers.stock_models`` (added to its ``STOCK_MODELS`` and ``BLOCKS``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from torch import Tensor, nn
from torch.utils.data import Dataset

from helpers.stock_models import BLOCKS, STOCK_MODELS, VOCAB, CausalLM, TinyData, next_token_pairs


def mixtral_config(layers: int = 4, router_logits: bool = False):
    from transformers import MixtralConfig

    return MixtralConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                         num_local_experts=4, num_experts_per_tok=2, output_router_logits=router_logits)


class MixtralModule(CausalLM):
    """``MixtralForCausalLM``: a sparse mixture of 4 experts (top 2) in every block, the experts kernel transformers
    picks by default. ``router_logits``: ``output_router_logits=True``, the load-balancing loss added to the loss
    (from every block's router logits, which hooks collect during the model's forward)."""

    def __init__(self, layers: int = 4, router_logits: bool = False, **kwargs) -> None:
        from transformers import MixtralForCausalLM

        super().__init__(MixtralForCausalLM(mixtral_config(layers, router_logits)), **kwargs)


class Qwen2MoeModule(CausalLM):
    """``Qwen2MoeForCausalLM``: 4 routed experts (top 2) and a gated shared expert in every block."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        from transformers import Qwen2MoeConfig, Qwen2MoeForCausalLM

        config = Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, num_hidden_layers=layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                shared_expert_intermediate_size=32)
        super().__init__(Qwen2MoeForCausalLM(config), **kwargs)


class TopKMoE(nn.Module):
    """A residual mixture-of-experts block as hand-written ones are: a linear router, the top ``k`` experts of each
    token by ``torch.topk``, each expert's tokens found with ``torch.nonzero`` and its results added back with
    ``index_add_``."""

    def __init__(self, dim: int = 32, experts: int = 4, k: int = 2, hidden: int = 64) -> None:
        super().__init__()
        self.k = k
        self.norm = nn.LayerNorm(dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), nn.GELU(), nn.Linear(hidden, dim)) for _ in range(experts)
        )

    def forward(self, x: Tensor) -> Tensor:
        tokens = self.norm(x).reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), self.k, dim=-1)
        weights = weights / weights.sum(-1, keepdim=True)
        mixed = torch.zeros_like(tokens)
        for index, expert in enumerate(self.experts):
            rows, slot = torch.nonzero(chosen == index, as_tuple=True)
            if len(rows):
                mixed.index_add_(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return x + mixed.reshape(x.shape)


class TopKMoELanguageModel(TinyData, LightningModule):
    """Next-token prediction with an embedding, four :class:`TopKMoE` blocks in a ``ModuleList`` its forward loops
    over, a norm and a head. SGD (``lr``): Adam would amplify round-off to the learning rate (the NOTE in
    ``helpers.stock_models``). ``masked_loss``: the loss over the targets that are not token 0, picked by a boolean
    mask (code outside the blocks that cannot run on the meta device either). ``varying_length``: batch ``i`` cut
    to ``12 - 2 * (i % 3)`` tokens, as a length-bucketing loader gives them: the blocks' input shapes change from
    step to step and come back."""

    def __init__(self, layers: int = 4, dim: int = 32, lr: float = 0.5, batch_size: int = 8,
                 samples: int = 32, masked_loss: bool = False, varying_length: bool = False) -> None:
        super().__init__()
        self.lr, self.batch_size, self.samples, self.masked_loss = lr, batch_size, samples, masked_loss
        self.varying_length = varying_length
        self.embedding = nn.Embedding(VOCAB, dim)
        self.blocks = nn.ModuleList(TopKMoE(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, VOCAB)

    def dataset(self, seed: int) -> Dataset:
        return next_token_pairs(self.samples, seed=seed)

    def forward(self, tokens: Tensor) -> Tensor:
        x = self.embedding(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))

    def training_step(self, batch, batch_idx):
        tokens, target = batch
        if self.varying_length:
            length = tokens.shape[1] - 2 * (batch_idx % 3)
            tokens, target = tokens[:, :length], target[:, :length]
        logits, target = self(tokens).flatten(0, 1), target.flatten()
        if self.masked_loss:
            kept = target != 0
            logits, target = logits[kept], target[kept]
        loss = F.cross_entropy(logits, target)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr)


MOE_MODELS: dict[str, type[LightningModule]] = {
    "mixtral": MixtralModule,
    "qwen2_moe": Qwen2MoeModule,
    "topk_moe": TopKMoELanguageModel,
}
MOE_BLOCKS: dict[str, list[str]] = {
    "mixtral": ["model.model.layers"],
    "qwen2_moe": ["model.model.layers"],
    "topk_moe": ["blocks"],
}
STOCK_MODELS.update(MOE_MODELS)
BLOCKS.update(MOE_BLOCKS)
