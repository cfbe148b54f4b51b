"""The stand-in for the pipelined ``nn.Sequential``: this process's layers, and the door into the pipeline."""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor, nn

from lightning_pipe.microbatch import Activation


class StageLayers(nn.Module):
    """The layers ``layer_range`` of the pipelined ``nn.Sequential``, registered under their original indices.

    Registering layer ``i`` as child ``"i"`` keeps state-dict keys identical to the unsplit model
    (``net.model.5.weight`` stays ``net.model.5.weight`` on whichever stage holds layer 5). Calling the module hands
    the call to the pipeline (``pipelined_call``, set by the runtime that owns this stage): the user's code calls
    ``self.net.model(x)`` exactly as on one device.
    """

    def __init__(self, sequential: nn.Sequential, layer_range: range, stage_index: int, num_stages: int) -> None:
        super().__init__()
        self.layer_range = layer_range
        self.stage_index = stage_index
        self.num_stages = num_stages
        layers = list(sequential)
        for index in layer_range:
            self.add_module(str(index), layers[index])
        self.pipelined_call: Callable[[Activation], Activation] | None = None

    def run_layers(self, is_tuple: bool, *tensors: Tensor) -> Activation:
        """This stage's layers applied to one micro-batch, as ``nn.Sequential`` would apply them."""
        value: Activation = tensors if is_tuple else tensors[0]
        for layer in self.children():
            value = layer(value)
        return value

    def forward(self, value: Activation) -> Activation:
        if self.pipelined_call is None:
            raise RuntimeError(
                "the pipelined module was called before the gpipe strategy set up its engine; run the model through"
                " `Trainer(strategy='gpipe').fit/validate/test/predict`."
            )
        return self.pipelined_call(value)

    def extra_repr(self) -> str:
        layers = f"{self.layer_range.start}..{self.layer_range.stop - 1}"
        return f"stage={self.stage_index}/{self.num_stages}, layers={layers}"
