"""LightningModules around the classes people train, written as their users write them: Hugging Face GPT-2 and
Llama (also as a base model at ``self.backbone``), BERT (a base model with a classifier), Hugging Face BART (an encoder-decoder), ``nn.TransformerEncoder`` with a padding mask, Lightning's demo transformer,
ResNet-18- and VGG-11-shaped CNNs.

Tiny configurations, random weights (no downloads), dropout 0; each module brings its own tiny deterministic data
(a ``torch.Generator`` of its own, so the data never depends on the global seed; the weights do: seed before
building, as every rank of a pipeline must build the same model). ``example_input_array`` is set only on the CNNs,
where Lightning's image tutorials set it; users of the language models do not.

The CNNs are written here after torchvision's layout (its wheel does not import with the CPU build of torch used
here): the same module names and the same forward, so that what works on them works on torchvision's classes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from lightning.pytorch import LightningModule
from lightning.pytorch.demos.transformer import LightningTransformer, Transformer
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint, checkpoint_sequential
from torch.utils.data import DataLoader, Dataset, TensorDataset

VOCAB = 64


# -- data ------------------------------------------------------------------------------------------------------


class CountingSequences(Dataset):
    """Token sequences that count up from a random start (learnable in a few steps), right-padded to ``length``.

    An item is what a tokenizer with padding gives a causal language model: ``input_ids``, ``attention_mask``
    (0 on padding) and ``labels`` (-100 on padding, the value Hugging Face's loss ignores). Token 0 is padding.
    """

    def __init__(self, samples: int = 32, length: int = 12, seed: int = 0, padded: bool = True) -> None:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(1, VOCAB, (samples, 1), generator=generator)
        self.input_ids = (starts + torch.arange(length)) % (VOCAB - 1) + 1
        lengths = torch.randint(length // 2, length + 1, (samples,), generator=generator)
        if not padded:  # every sequence of the full length: a token mean is then a mean over samples too
            lengths[:] = length
        lengths[0] = length  # at least one full sequence: the padded batch is never all padding at the end
        self.attention_mask = (torch.arange(length) < lengths[:, None]).long()
        self.input_ids = self.input_ids * self.attention_mask
        self.labels = self.input_ids.masked_fill(self.attention_mask == 0, -100)

    def __len__(self) -> int:
        return len(self.input_ids)

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return {"input_ids": self.input_ids[index], "attention_mask": self.attention_mask[index],
                "labels": self.labels[index]}


def padded_token_classes(samples: int = 32, length: int = 12, classes: int = 3, seed: int = 0) -> TensorDataset:
    """(tokens, class) with token 0 as right padding; the class is a bucket of the mean of the real tokens."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, VOCAB, (samples, length), generator=generator)
    lengths = torch.randint(length // 2, length + 1, (samples,), generator=generator)
    tokens = tokens * (torch.arange(length) < lengths[:, None])
    means = tokens.sum(1) / lengths
    labels = torch.bucketize(means, torch.linspace(0, VOCAB, classes + 1)[1:-1])
    return TensorDataset(tokens, labels)


def next_token_pairs(samples: int = 32, length: int = 12, seed: int = 0) -> TensorDataset:
    """(inputs, target) as the demo's WikiText2 gives them: target is inputs shifted by one token."""
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, VOCAB, (samples, 1), generator=generator)
    tokens = (starts + torch.arange(length + 1)) % VOCAB
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


def images(samples: int = 32, size: int = 32, classes: int = 10, seed: int = 0, channels: int = 3) -> TensorDataset:
    """Random images whose class is the brightest of ``classes`` horizontal bands (learnable, deterministic)."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, channels, size, size, generator=generator)
    labels = torch.randint(0, classes, (samples,), generator=generator)
    band = size // classes
    for i, label in enumerate(labels.tolist()):
        x[i, :, label * band:(label + 1) * band] += 1.0
    return TensorDataset(x, labels)


class TinyData:
    """Each module's own loaders: ``samples`` items in batches of ``batch_size``, validation from another seed."""

    batch_size: int = 8
    samples: int = 32

    def dataset(self, seed: int) -> Dataset:
        raise NotImplementedError

    def train_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset(seed=0), batch_size=self.batch_size)

    def val_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset(seed=1), batch_size=self.batch_size)

    def predict_dataloader(self) -> DataLoader:
        return DataLoader(self.dataset(seed=2), batch_size=self.batch_size)


# -- Hugging Face causal language models -----------------------------------------------------------------------


class CausalLM(TinyData, LightningModule):
    """A Hugging Face causal LM in a LightningModule: the loss is the model's own, from ``labels=``."""

    def __init__(
        self, model: nn.Module, lr: float = 3e-3, batch_size: int = 8, samples: int = 32, padded: bool = True,
        sgd_lr: float | None = None, weight_by_samples: bool = False,
    ) -> None:
        super().__init__()
        self.model = model
        self.lr, self.batch_size, self.samples, self.padded = lr, batch_size, samples, padded
        self.sgd_lr = sgd_lr  # SGD instead of AdamW: for comparing weights where Adam amplifies round-off
        if weight_by_samples:  # micro-batches weighted by their samples, not the label tokens the loss counts
            self.items_in_loss = lambda batch: len(batch["labels"])

    def dataset(self, seed: int) -> Dataset:
        return CountingSequences(self.samples, seed=seed, padded=self.padded)

    def forward(self, **inputs):
        return self.model(**inputs)

    def training_step(self, batch, batch_idx):
        loss = self(**batch).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self(**batch).loss)

    def predict_step(self, batch, batch_idx):
        return self(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits

    def configure_optimizers(self):
        if self.sgd_lr is not None:
            return torch.optim.SGD(self.parameters(), lr=self.sgd_lr)
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


def gpt2_config(layers: int = 4):
    from transformers import GPT2Config

    return GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=layers, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1)


def llama_config(layers: int = 4):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)


class GPT2Module(CausalLM):
    """``GPT2LMHeadModel``: blocks in the ModuleList ``model.transformer.h``; the head shares the embedding's weight.

    ``gradient_checkpointing``: Hugging Face's ``gradient_checkpointing_enable()`` (renamed
    ``activation_checkpointing_enable()`` in transformers 5.x), which checkpoints inside each block.
    """

    def __init__(self, layers: int = 4, gradient_checkpointing: bool = False, **kwargs) -> None:
        from transformers import GPT2LMHeadModel

        super().__init__(GPT2LMHeadModel(gpt2_config(layers)), **kwargs)
        if gradient_checkpointing:
            enable = getattr(self.model, "activation_checkpointing_enable", self.model.gradient_checkpointing_enable)
            enable()


class LlamaModule(CausalLM):
    """``LlamaForCausalLM``: blocks in the ModuleList ``model.model.layers``, rotary position embeddings."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        from transformers import LlamaForCausalLM

        super().__init__(LlamaForCausalLM(llama_config(layers)), **kwargs)


class Qwen2Module(CausalLM):
    """``Qwen2ForCausalLM`` with its head tied to the input embedding, as the small Qwen2 checkpoints have it."""

    def __init__(self, layers: int = 4, **kwargs) -> None:
        from transformers import Qwen2Config, Qwen2ForCausalLM

        config = Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                             tie_word_embeddings=True)
        super().__init__(Qwen2ForCausalLM(config), **kwargs)


class TokenMeanLlama(LlamaModule):
    """``LlamaModule`` whose LightningModule says what its loss averages over (``items_in_loss``): the label tokens
    the model's own loss counts, after its shift by one (labels -100 on padding are not counted)."""

    def items_in_loss(self, batch) -> int:
        return int((batch["labels"][:, 1:] != -100).sum())


def padded_token_loaders(train_samples: int, val_samples: int, batch_size: int) -> tuple[DataLoader, DataLoader]:
    """Right-padded counting sequences of varying lengths (:class:`CountingSequences`), for training and validation."""
    return (DataLoader(CountingSequences(train_samples, seed=0), batch_size=batch_size),
            DataLoader(CountingSequences(val_samples, seed=1), batch_size=batch_size))


def bart_config(layers: int = 2):
    from transformers import BartConfig

    return BartConfig(vocab_size=VOCAB, d_model=32, encoder_layers=layers, decoder_layers=layers, encoder_ffn_dim=128,
                      decoder_ffn_dim=128, encoder_attention_heads=4, decoder_attention_heads=4,
                      max_position_embeddings=32, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                      pad_token_id=0, bos_token_id=VOCAB - 1, eos_token_id=VOCAB - 1, decoder_start_token_id=VOCAB - 1)


class BartModule(CausalLM):
    """``BartForConditionalGeneration``, an encoder-decoder: the encoder's blocks in ``model.model.encoder.layers``,
    the decoder's in ``model.model.decoder.layers``, each decoder block attending to the encoder's output. The loss is
    the model's own, from ``labels=`` (the decoder's input is the labels shifted right); the head shares the
    embedding's weight."""

    def __init__(self, layers: int = 2, **kwargs) -> None:
        from transformers import BartForConditionalGeneration

        super().__init__(BartForConditionalGeneration(bart_config(layers)), **kwargs)

    def predict_step(self, batch, batch_idx):
        return self(**batch).logits


def t5_config(layers: int = 2):
    from transformers import T5Config

    return T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=128, num_layers=layers, num_decoder_layers=layers,
                    num_heads=4, dropout_rate=0.0, pad_token_id=0, eos_token_id=VOCAB - 1, decoder_start_token_id=0)


class T5Module(BartModule):
    """``T5ForConditionalGeneration``: the encoder's blocks in ``model.encoder.block``, the decoder's in
    ``model.decoder.block``; each stack's first block computes the attention's position bias, which every later
    block of the stack takes (and returns)."""

    def __init__(self, layers: int = 2, **kwargs) -> None:
        from transformers import T5ForConditionalGeneration

        CausalLM.__init__(self, T5ForConditionalGeneration(t5_config(layers)), **kwargs)


class PretrainedCausalLM(CausalLM):
    """A causal LM fine-tuned from a Hugging Face directory, as the docs' page writes it: built from the directory's
    config in ``configure_model`` (on the meta device under the gpipe strategy, whose ``pretrained=`` fills it), or
    with ``from_pretrained`` in ``__init__`` (``from_pretrained=True``: the one-device baseline)."""

    def __init__(self, path: str, from_pretrained: bool = False, **kwargs) -> None:
        from transformers import AutoModelForCausalLM

        super().__init__(AutoModelForCausalLM.from_pretrained(path) if from_pretrained else None, **kwargs)
        self.path = path

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        if self.model is None:  # configure_model runs again for trainer.validate/test
            self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.path))


class BackboneCausalLM(CausalLM):
    """A base model held at ``self.backbone`` (``AutoModel.from_config``, no head) with the LightningModule's own
    head and loss: how fine-tuning projects often hold a pretrained body. ``from_pretrained=True``: the body made
    with ``AutoModel.from_pretrained`` in ``__init__`` (the one-device baseline)."""

    def __init__(self, path: str, from_pretrained: bool = False, **kwargs) -> None:
        from transformers import AutoModel

        super().__init__(None, **kwargs)
        self.path = path
        self.backbone = AutoModel.from_pretrained(path) if from_pretrained else None
        self.lm_head = None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(self.path)
        if self.backbone is None:
            self.backbone = AutoModel.from_config(config)
        if self.lm_head is None:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def training_step(self, batch, batch_idx):
        hidden = self.backbone(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).last_hidden_state
        logits = self.lm_head(hidden)[:, :-1]
        loss = F.cross_entropy(logits.flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))


def bert_config(layers: int = 4):
    from transformers import BertConfig

    return BertConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                      attention_probs_dropout_prob=0.0, pad_token_id=0)


class BertClassifier(TinyData, LightningModule):
    """A BERT body held at ``self.encoder`` (``AutoModel.from_config``: ``BertModel``, with its pooler) and the
    LightningModule's own classifier on the pooled output, on right-padded token classes. ``from_pretrained=True``:
    the body made with ``AutoModel.from_pretrained`` in ``__init__`` (the one-device baseline)."""

    def __init__(self, path: str, from_pretrained: bool = False, classes: int = 3, lr: float = 3e-3,
                 batch_size: int = 8, samples: int = 32) -> None:
        from transformers import AutoModel

        super().__init__()
        self.path, self.classes, self.lr, self.batch_size, self.samples = path, classes, lr, batch_size, samples
        self.encoder = AutoModel.from_pretrained(path) if from_pretrained else None
        self.classifier = None

    def configure_model(self) -> None:
        from transformers import AutoConfig, AutoModel

        config = AutoConfig.from_pretrained(self.path)
        if self.encoder is None:
            self.encoder = AutoModel.from_config(config)
        if self.classifier is None:
            self.classifier = nn.Linear(config.hidden_size, self.classes)

    def dataset(self, seed: int) -> Dataset:
        return padded_token_classes(self.samples, seed=seed, classes=self.classes)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        pooled = self.encoder(input_ids=tokens, attention_mask=(tokens != 0).long()).pooler_output
        loss = F.cross_entropy(self.classifier(pooled), labels)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


class BertSequenceClassifier(TinyData, LightningModule):
    """``BertForSequenceClassification``: blocks in ``model.bert.encoder.layer``, the embeddings before them, the
    pooler and the classifier after; right-padded token classes."""

    def __init__(self, layers: int = 4, classes: int = 3, lr: float = 3e-3, batch_size: int = 8, samples: int = 32) -> None:
        from transformers import BertForSequenceClassification

        super().__init__()
        config = bert_config(layers)
        config.num_labels = classes
        self.model = BertForSequenceClassification(config)
        self.classes, self.lr, self.batch_size, self.samples = classes, lr, batch_size, samples

    def dataset(self, seed: int) -> Dataset:
        return padded_token_classes(self.samples, seed=seed, classes=self.classes)

    def training_step(self, batch, batch_idx):
        tokens, labels = batch
        loss = self.model(input_ids=tokens, attention_mask=(tokens != 0).long(), labels=labels).loss
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.training_step(batch, batch_idx))

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr, weight_decay=0.01)


# -- torch's TransformerEncoder ----------------------------------------------------------------------------------


class Classification:
    """The steps of a classifier as its users write them: cross entropy on (inputs, labels) batches."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x), y))

    def predict_step(self, batch, batch_idx):
        return self(batch[0]).softmax(-1)


class EncoderClassifier(Classification, TinyData, LightningModule):
    """Sequence classification with ``nn.TransformerEncoder`` and a key padding mask (True on padding tokens).

    ``batch_first=True`` is how most code writes it today; ``batch_first=False`` (torch's default) transposes to
    (T, B, d) around the encoder, as older code does.
    """

    def __init__(self, layers: int = 4, batch_first: bool = True, lr: float = 0.05, batch_size: int = 8,
                 samples: int = 32, classes: int = 3, d_model: int = 32, max_length: int = 32) -> None:
        super().__init__()
        self.batch_first, self.lr, self.batch_size, self.samples = batch_first, lr, batch_size, samples
        self.embedding = nn.Embedding(VOCAB, d_model, padding_idx=0)
        self.position = nn.Parameter(torch.randn(1, max_length, d_model) * 0.02)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=64, dropout=0.0, batch_first=batch_first)
        self.encoder = nn.TransformerEncoder(layer, num_layers=layers, enable_nested_tensor=batch_first)
        self.head = nn.Linear(d_model, classes)

    def dataset(self, seed: int) -> Dataset:
        return padded_token_classes(self.samples, seed=seed)

    def forward(self, tokens: Tensor) -> Tensor:
        padding = tokens == 0
        x = self.embedding(tokens) + self.position[:, : tokens.size(1)]
        if self.batch_first:
            x = self.encoder(x, src_key_padding_mask=padding)
        else:
            x = self.encoder(x.transpose(0, 1), src_key_padding_mask=padding).transpose(0, 1)
        keep = (~padding).unsqueeze(-1).to(x.dtype)
        return self.head((x * keep).sum(1) / keep.sum(1))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.lr)


# -- Lightning's demo transformer ---------------------------------------------------------------------------------


class DemoTransformer(TinyData, LightningTransformer):
    """Lightning's ``LightningTransformer`` with a tiny model and random token data instead of WikiText-2.

    The demo's loss, optimizer (SGD, lr 0.1) and forward are its own; only the model's size, dropout (0) and the
    data are changed, as a user trying the demo on their own data would.
    """

    def __init__(self, layers: int = 2, batch_size: int = 8, samples: int = 32) -> None:
        super().__init__(vocab_size=VOCAB)
        self.model = Transformer(vocab_size=VOCAB, ninp=32, nhead=2, nhid=64, nlayers=layers, dropout=0.0)
        self.batch_size, self.samples = batch_size, samples

    def dataset(self, seed: int) -> Dataset:
        return next_token_pairs(self.samples, seed=seed)

    def prepare_data(self) -> None:
        """The demo downloads WikiText-2 here; the random data needs nothing."""

    def validation_step(self, batch, batch_idx):
        inputs, target = batch
        self.log("val_loss", F.nll_loss(self(inputs, target), target.view(-1)))

    def predict_step(self, batch, batch_idx):
        inputs, target = batch
        return self(inputs, target)


# -- torchvision-shaped CNNs ---------------------------------------------------------------------------------------


def conv3x3(in_planes: int, out_planes: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_planes, out_planes, kernel_size=3, stride=stride, padding=1, bias=False)


class BasicBlock(nn.Module):
    """torchvision's ResNet basic block: two 3x3 convolutions and the identity (or a downsampling) shortcut."""

    expansion = 1

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None) -> None:
        super().__init__()
        self.conv1 = conv3x3(inplanes, planes, stride)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(planes, planes)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = downsample
        self.stride = stride

    def forward(self, x: Tensor) -> Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet layout (stem, ``layer1``..``layer4``, ``avgpool``, ``fc``) with a base ``width``."""

    def __init__(self, layers: list[int], num_classes: int = 10, width: int = 64) -> None:
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, kernel_size=7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * BasicBlock.expansion, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * BasicBlock.expansion:
            downsample = nn.Sequential(
                nn.Conv2d(self.inplanes, planes * BasicBlock.expansion, kernel_size=1, stride=stride, bias=False),
                nn.BatchNorm2d(planes * BasicBlock.expansion),
            )
        layers = [BasicBlock(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * BasicBlock.expansion
        layers += [BasicBlock(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def _forward_impl(self, x: Tensor) -> Tensor:
        x = self.conv1(x)
        x = self.bn1(x)
        x = self.relu(x)
        x = self.maxpool(x)

        x = self.layer1(x)
        x = self.layer2(x)
        x = self.layer3(x)
        x = self.layer4(x)

        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.fc(x)
        return x

    def forward(self, x: Tensor) -> Tensor:
        return self._forward_impl(x)


def resnet18(num_classes: int = 10, width: int = 64) -> ResNet:
    return ResNet([2, 2, 2, 2], num_classes=num_classes, width=width)


VGG11_LAYOUT: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]


class VGG(nn.Module):
    """torchvision's VGG layout: ``features`` (convolutions, in-place ReLUs, max pools), ``avgpool``, ``classifier``."""

    def __init__(self, features: nn.Sequential, num_classes: int = 10, hidden: int = 4096, dropout: float = 0.5,
                 pool: int = 7) -> None:
        super().__init__()
        channels = [m.out_channels for m in features if isinstance(m, nn.Conv2d)][-1]
        self.features = features
        self.avgpool = nn.AdaptiveAvgPool2d((pool, pool))
        self.classifier = nn.Sequential(
            nn.Linear(channels * pool * pool, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, hidden),
            nn.ReLU(True),
            nn.Dropout(p=dropout),
            nn.Linear(hidden, num_classes),
        )

    def forward(self, x: Tensor) -> Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        x = self.classifier(x)
        return x


def vgg_features(layout: list[int | str], divisor: int = 1, batch_norm: bool = False) -> nn.Sequential:
    layers: list[nn.Module] = []
    in_channels = 3
    for v in layout:
        if v == "M":
            layers += [nn.MaxPool2d(kernel_size=2, stride=2)]
        else:
            out_channels = int(v) // divisor
            conv = nn.Conv2d(in_channels, out_channels, kernel_size=3, padding=1)
            norm = [nn.BatchNorm2d(out_channels)] if batch_norm else []
            layers += [conv, *norm, nn.ReLU(inplace=True)]
            in_channels = out_channels
    return nn.Sequential(*layers)


def vgg11(num_classes: int = 10, divisor: int = 1, hidden: int = 4096, dropout: float = 0.5) -> VGG:
    return VGG(vgg_features(VGG11_LAYOUT, divisor), num_classes=num_classes, hidden=hidden, dropout=dropout)


class ImageClassifier(Classification, TinyData, LightningModule):
    """An image classifier as Lightning's tutorials write one: cross entropy, SGD with momentum, an example input."""

    def __init__(self, model: nn.Module, lr: float = 0.05, batch_size: int = 8, samples: int = 32) -> None:
        super().__init__()
        self.model = model
        self.lr, self.batch_size, self.samples = lr, batch_size, samples
        self.example_input_array = torch.zeros(2, 3, 32, 32)

    def dataset(self, seed: int) -> Dataset:
        return images(self.samples, seed=seed)

    def forward(self, x: Tensor) -> Tensor:
        return self.model(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=self.lr, momentum=0.9, weight_decay=5e-4)


class ResNet18Classifier(ImageClassifier):
    """ResNet-18's layout (BatchNorm everywhere) with base width 8 instead of 64, on 32x32 images."""

    def __init__(self, width: int = 8, **kwargs) -> None:
        super().__init__(resnet18(num_classes=10, width=width), **kwargs)


class VGG11Classifier(ImageClassifier):
    """VGG-11's layout (no BatchNorm, in-place ReLUs) with 1/8 of its channels and a 64-wide classifier."""

    def __init__(self, divisor: int = 8, **kwargs) -> None:
        super().__init__(vgg11(num_classes=10, divisor=divisor, hidden=64, dropout=0.0), **kwargs)


# -- Lightning's first example -------------------------------------------------------------------------------------


def lit_autoencoder_class(lightning_module: type) -> type:
    """The autoencoder of Lightning's README, on a LightningModule of either Lightning package (``lightning.pytorch``
    or the standalone ``pytorch_lightning``), with MNIST-shaped random images instead of MNIST."""

    class LitAutoEncoder(TinyData, lightning_module):
        def __init__(self, batch_size: int = 8, samples: int = 32, sgd_lr: float | None = None) -> None:
            super().__init__()
            self.encoder = nn.Sequential(nn.Linear(28 * 28, 128), nn.ReLU(), nn.Linear(128, 3))
            self.decoder = nn.Sequential(nn.Linear(3, 128), nn.ReLU(), nn.Linear(128, 28 * 28))
            self.batch_size, self.samples = batch_size, samples
            self.sgd_lr = sgd_lr  # not the README's: SGD for weight comparisons (see the NOTE below the class)

        def dataset(self, seed: int) -> Dataset:
            return images(self.samples, size=28, seed=seed, channels=1)

        def forward(self, x):
            # in lightning, forward defines the prediction/inference actions
            embedding = self.encoder(x)
            return embedding

        def training_step(self, batch, batch_idx):
            # training_step defines the train loop. It is independent of forward
            x, _ = batch
            x = x.view(x.size(0), -1)
            z = self.encoder(x)
            x_hat = self.decoder(z)
            loss = F.mse_loss(x_hat, x)
            self.log("train_loss", loss)
            return loss

        def configure_optimizers(self):
            if self.sgd_lr is not None:
                return torch.optim.SGD(self.parameters(), lr=self.sgd_lr)
            optimizer = torch.optim.Adam(self.parameters(), lr=1e-3)
            return optimizer

    return LitAutoEncoder


# NOTE: Adam's step is m / sqrt(v) per element, blind to the gradient's size: an element whose gradient is mostly
# round-off (the sum of terms that nearly cancel) moves by up to the whole learning rate, in the direction round-off
# picks, and another summation order (micro-batches, another CPU's vector width) can flip it. The README autoencoder
# under Adam differed from one device by 1.97e-5 of the weights' change on an AVX-512 CPU with AMX. Under SGD a step
# is lr * gradient, so round-off stays round-off: weight comparisons to 1e-5 of the change train it with SGD.


LitAutoEncoder = lit_autoencoder_class(LightningModule)


# -- a ViT with activation checkpointing around its blocks ---------------------------------------------------------


def checkpoint_seq(functions, x, every: int = 1):
    """timm's ``checkpoint_seq`` (``timm.models._manipulate``): the blocks in segments of ``every``, each segment under
    ``torch.utils.checkpoint`` (non-reentrant). timm itself is not a test dependency."""
    def run_function(start: int, end: int):
        def forward(_x):
            for j in range(start, end + 1):
                _x = functions[j](_x)
            return _x
        return forward

    for start in range(0, len(functions), every):
        x = checkpoint(run_function(start, min(start + every - 1, len(functions) - 1)), x, use_reentrant=False)
    return x


class PatchEmbedding(nn.Module):
    """The patches embedded, the class token put first and the position embedding added, in one module (as Hugging
    Face's ``ViTEmbeddings`` and many hand-written ViTs hold them): what it returns is all the blocks get."""

    def __init__(self, dim: int, patch: int, size: int) -> None:
        super().__init__()
        self.proj = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)

    def forward(self, images: Tensor) -> Tensor:
        x = self.proj(images).flatten(2).transpose(1, 2)
        return torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed


class ViT(nn.Module):
    """A small vision transformer as timm and hand-written ones are laid out (patch embedding, class token, position
    embedding, ``blocks``, ``norm``, ``head``), whose forward calls its blocks under ``torch.utils.checkpoint`` in
    training, in one of the ways projects write it (``checkpointing``):

    * ``"loop"``: ``for block in self.blocks: x = checkpoint(block, x, use_reentrant=False)`` (litgpt, most GPTs);
    * ``"loop_reentrant"``: the same with ``use_reentrant=True`` (older code);
    * ``"every_other_reentrant"``: only every other block (the odd ones) checkpointed, reentrant: a block called
      plainly, then one under the checkpoint;
    * ``"sequential"``: ``checkpoint_sequential(self.blocks, 2, x)``, with its default (reentrant) mode;
    * ``"timm"``: timm's ``checkpoint_seq(self.blocks, x, every=2)``: segments of two blocks, non-reentrant;
    * ``"trunk"``: ``checkpoint(lambda x: self.norm(self.blocks(x)), x, use_reentrant=False)``: the blocks and the norm
      after them in one checkpoint, whose re-computation in backward runs the norm again on the blocks' output.

    With ``embedding_module=True`` the class token and the position embedding live in the patch embedding (a
    :class:`PatchEmbedding`), as in Hugging Face's ViT: the blocks' input then comes from that one module, which
    only the first stage holds.
    """

    def __init__(self, checkpointing: str, depth: int = 4, dim: int = 32, patch: int = 8, size: int = 32,
                 classes: int = 10, embedding_module: bool = False) -> None:
        super().__init__()
        self.checkpointing = checkpointing
        self.embedding_module = embedding_module
        if embedding_module:
            self.patch_embed = PatchEmbedding(dim, patch, size)
        else:
            self.patch_embed = nn.Conv2d(3, dim, kernel_size=patch, stride=patch)
            self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
            self.pos_embed = nn.Parameter(torch.randn(1, (size // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(
            nn.TransformerEncoderLayer(dim, nhead=4, dim_feedforward=2 * dim, dropout=0.0, batch_first=True,
                                       norm_first=True)
            for _ in range(depth)
        ))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, images: Tensor) -> Tensor:
        if self.embedding_module:
            x = self.patch_embed(images)
        else:
            x = self.patch_embed(images).flatten(2).transpose(1, 2)
            x = torch.cat([self.cls_token.expand(len(x), -1, -1), x], dim=1) + self.pos_embed
        if not self.training:
            x = self.blocks(x)
        elif self.checkpointing == "loop":
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=False)
        elif self.checkpointing == "loop_reentrant":
            for block in self.blocks:
                x = checkpoint(block, x, use_reentrant=True)
        elif self.checkpointing == "every_other_reentrant":
            for index, block in enumerate(self.blocks):
                x = checkpoint(block, x, use_reentrant=True) if index % 2 else block(x)
        elif self.checkpointing == "sequential":
            x = checkpoint_sequential(self.blocks, 2, x, use_reentrant=True)
        elif self.checkpointing == "timm":
            x = checkpoint_seq(self.blocks, x, every=2)
        else:
            return self.head(checkpoint(lambda x: self.norm(self.blocks(x)), x, use_reentrant=False)[:, 0])
        return self.head(self.norm(x)[:, 0])


class ViTClassifier(ImageClassifier):
    """The ViT on 32x32 images; ``checkpointing`` says how its forward checkpoints its blocks (see :class:`ViT`)."""

    def __init__(self, checkpointing: str = "loop", embedding_module: bool = False, **kwargs) -> None:
        super().__init__(ViT(checkpointing, embedding_module=embedding_module), **kwargs)
        self.example_input_array = None  # users of transformers rarely set one


STOCK_MODELS: dict[str, type[LightningModule]] = {
    "gpt2": GPT2Module,
    "llama": LlamaModule,
    "qwen2": Qwen2Module,
    "bert": BertSequenceClassifier,
    "bart": BartModule,
    "t5": T5Module,
    "encoder": EncoderClassifier,
    "demo": DemoTransformer,
    "resnet18": ResNet18Classifier,
    "vgg11": VGG11Classifier,
    "vit": ViTClassifier,
    "autoencoder": LitAutoEncoder,
}

# Where each model keeps the blocks its forward calls one after another (its own loop or a Sequential).
BLOCKS: dict[str, list[str]] = {
    "gpt2": ["model.transformer.h"],
    "llama": ["model.model.layers"],
    "qwen2": ["model.model.layers"],
    "bert": ["model.bert.encoder.layer"],
    "bart": ["model.model.encoder.layers", "model.model.decoder.layers"],
    "t5": ["model.encoder.block", "model.decoder.block"],
    "encoder": ["encoder.layers"],
    "demo": ["model.transformer.encoder.layers", "model.transformer.decoder.layers"],
    "resnet18": ["model"],  # its children in order: conv1, bn1, relu, maxpool, layer1..layer4, avgpool, fc
    "vgg11": ["model.features"],
    "vit": ["model.blocks"],
    "autoencoder": ["encoder", "decoder"],
}

# The mixture-of-experts models build on the classes above; their module adds them to STOCK_MODELS and BLOCKS.
import helpers.moe_models  # noqa: E402,F401
