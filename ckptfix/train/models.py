"""The two models the trainer knows.

* :class:`LeNet` -- the default: LeNet-5 for 28x28 grey images (conv 1->6 5x5
  padding 2, conv 6->16 5x5, each ReLU + 2x2 average pooling, then 400->120
  ReLU and 120->10; LeNet-5's 84-unit layer is left out): 51,902 parameters.
* :class:`TutorialLeNet` (``tutorial``) -- exactly the network of the
  hand-written "data parallelism from scratch" tutorial (Dive into Deep
  Learning, "Training on Multiple GPUs"): conv 1->20 3x3, ReLU, 2x2 average
  pooling; conv 20->50 5x5, ReLU, 2x2 average pooling; 800->128 ReLU; 128->10;
  129,068 parameters, zero biases, held as a plain parameter list and run by
  the functional :func:`tutorial_forward`.  Weights are He-scaled, N(0, sqrt(2 /
  fan_in)), by default; ``init="tutorial"`` gives the tutorial's N(0, 0.01),
  which starts the network at a saddle (logits ~1e-5, every layer's gradient
  scaled by the other layers' tiny weights): plain SGD at lr 0.2 needs about
  500 steps to leave chance accuracy -- two epochs of the tutorial's 60,000
  images, but 60 epochs of the bundled 2,048 (8 steps each).  He scaling keeps
  each layer's signal at unit variance, and the same run learns in 2-3 epochs.
* :class:`SmallResNet` -- a tiny ResNet with BatchNorm (stem + two basic
  blocks), so the trainer exercises BatchNorm buffers, ``SyncBatchNorm`` and
  ``num_batches_tracked`` keys in checkpoints.

Both take ``[N, 1, 28, 28]`` float input and return ``[N, 10]`` logits.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch import nn

from ckptfix.train.config import MODELS


class LeNet(nn.Module):
    """LeNet-5 without its 84-unit layer.

    conv(1->6, 5x5, pad 2) - relu - avgpool - conv(6->16, 5x5) - relu - avgpool - fc(400->120) - relu - fc(120->10).
    """

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 6, kernel_size=5, padding=2)
        self.conv2 = nn.Conv2d(6, 16, kernel_size=5)
        self.pool = nn.AvgPool2d(2)
        self.fc1 = nn.Linear(16 * 5 * 5, 120)
        self.fc2 = nn.Linear(120, num_classes)
        # When set (by --show-split), forward prints the size of the batch this
        # replica received, like the DataParallel tutorial's "In Model" line.
        self.show_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits."""
        if self.show_split:
            print(f"\tIn Model: input size {tuple(x.shape)} on {x.device}", file=sys.stderr, flush=True)
        x = self.pool(F.relu(self.conv1(x)))
        x = self.pool(F.relu(self.conv2(x)))
        x = torch.flatten(x, 1)
        x = F.relu(self.fc1(x))
        return self.fc2(x)


#: the tutorial's weight standard deviation (``init="tutorial"``)
TUTORIAL_SCALE = 0.01


def tutorial_params(scale: float | None = None) -> list[torch.Tensor]:
    """The tutorial's parameter list ``[W1, b1, W2, b2, W3, b3, W4, b4]``: Gaussian weights, zero biases.

    Args:
        scale: The weights' standard deviation (``0.01``: the tutorial's); None: He scaling,
            ``sqrt(2 / fan_in)`` per layer (fan-in 9, 500, 800 and 128).
    """
    shapes = [(20, 1, 3, 3), (50, 20, 5, 5), (800, 128), (128, 10)]
    out: list[torch.Tensor] = []
    for shape in shapes:
        fan_in = shape[1] * shape[2] * shape[3] if len(shape) == 4 else shape[0]
        std = scale if scale is not None else (2.0 / fan_in) ** 0.5
        out += [torch.randn(*shape) * std, torch.zeros(shape[0] if len(shape) == 4 else shape[1])]
    return out


def tutorial_forward(x: torch.Tensor, params: list[torch.Tensor]) -> torch.Tensor:
    """The tutorial's functional LeNet on ``[N, 1, 28, 28]`` input with ``params`` from :func:`tutorial_params`."""
    w1, b1, w2, b2, w3, b3, w4, b4 = params
    h1 = F.avg_pool2d(F.relu(F.conv2d(x, w1, b1)), kernel_size=2, stride=2)
    h2 = F.avg_pool2d(F.relu(F.conv2d(h1, w2, b2)), kernel_size=2, stride=2)
    h3 = F.relu(h2.reshape(h2.shape[0], -1) @ w3 + b3)
    return h3 @ w4 + b4


class TutorialLeNet(nn.Module):
    """The tutorial network as a module: its plain parameter list (``w1, b1 ... w4, b4``) + :func:`tutorial_forward`.

    The module only gives the list names (so checkpoints have ``w1``, ``b1``... keys); the
    forward pass is the tutorial's function of ``(x, params)``.
    """

    NAMES = ("w1", "b1", "w2", "b2", "w3", "b3", "w4", "b4")

    def __init__(self, init: str = "he") -> None:
        super().__init__()
        scale = TUTORIAL_SCALE if init == "tutorial" else None
        for name, t in zip(self.NAMES, tutorial_params(scale), strict=False):
            self.register_parameter(name, nn.Parameter(t))
        self.show_split = False

    @property
    def params(self) -> list[torch.Tensor]:
        """The parameters in the tutorial's order (``w1, b1 ... w4, b4``)."""
        return [getattr(self, n) for n in self.NAMES]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits."""
        if self.show_split:
            print(f"\tIn Model: input size {tuple(x.shape)} on {x.device}", file=sys.stderr, flush=True)
        return tutorial_forward(x, self.params)


class BasicBlock(nn.Module):
    """A ResNet basic block: two 3x3 conv+BN, with a 1x1 conv+BN shortcut when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride=stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The block's output."""
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class SmallResNet(nn.Module):
    """stem conv(1->16, stride 2)+BN, block(16->16), block(16->32, stride 2), avg-pool to 3x3, fc(288->10)."""

    def __init__(self, num_classes: int = 10, width: int = 16) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, width, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.layer1 = BasicBlock(width, width, 1)
        self.layer2 = BasicBlock(width, 2 * width, 2)
        self.fc = nn.Linear(2 * width * 3 * 3, num_classes)
        self.show_split = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The logits."""
        if self.show_split:
            print(f"\tIn Model: input size {tuple(x.shape)} on {x.device}", file=sys.stderr, flush=True)
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        x = F.adaptive_avg_pool2d(x, 3).flatten(1)
        return self.fc(x)


def build_model(name: str, seed: int, *, init: str = "he") -> nn.Module:
    """Build ``name`` with weights initialised from ``seed`` (identical on every rank/replica).

    Args:
        name: One of :data:`ckptfix.train.config.MODELS`.
        seed: The initialisation seed (the global RNG is left as it was).
        init: The tutorial network's initialisation (:data:`ckptfix.train.config.INITS`); others ignore it.

    Raises:
        TrainingError: ``name`` is not a known model.
    """
    from ckptfix.errors import TrainingError

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if name == "lenet":
            return LeNet()
        if name == "resnet":
            return SmallResNet()
        if name == "tutorial":
            return TutorialLeNet(init)
    raise TrainingError(f"unknown model {name!r}; choose one of: {', '.join(MODELS)}")


def has_batchnorm(model: nn.Module) -> bool:
    """Whether ``model`` has BatchNorm layers (DDP on CUDA converts them to SyncBatchNorm).

    Returns:
        True when some submodule is a BatchNorm.
    """
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())
