"""Data for the trainer: a synthetic, learnable 28x28 10-class set, or a file.

Synthetic set
    Generated from a seed, no downloads.  Each class has a prototype pattern (a
    random 7x7 grid upsampled to 28x28, so it has smooth blobs and edges).  A
    sample is its class prototype shifted by up to +-3 pixels, with random
    contrast and brightness, plus Gaussian pixel noise, stored as uint8.  A
    LeNet reaches well above chance (10%) within one or two epochs, but not
    100% at once, so accuracy is a meaningful number.

Real handwritten digits (``--data digits``)
    The 1,797 8x8 digits of the UCI "Optical Recognition of Handwritten Digits"
    set (E. Alpaydin, C. Kaynak, 1998; CC BY 4.0; the copy scikit-learn ships
    for ``load_digits``), vendored as ``digits.csv.gz`` (56 KiB; see
    DIGITS-LICENSE.txt beside it).  Each image (0..16) is scaled to 0..255 and
    upsampled to 20x20 in a 28x28 frame, as MNIST centres its digits; a seeded
    shuffle puts 1,437 in the training split and 360 in the test split.

File format (``--data PATH``)
    A ``.pt`` file written with ``torch.save`` of a plain dict, or a ``.npz``
    file written with ``numpy.savez``, holding:

    * ``images``: uint8 ``[N, 28, 28]`` (grey, 0..255)
    * ``labels``: int64 ``[N]`` with values in ``0..9``
    * optionally ``test_images`` / ``test_labels`` in the same layout; without
      them the last 20% of the samples become the test split.

    ``.pt`` files are read with ``weights_only=True`` (tensors only, no code).
    :func:`save_dataset` writes this format.

Images are fed to the model as ``float32`` in ``[-1, 1]`` with shape ``[N, 1, 28, 28]``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from ckptfix.errors import TrainingError

NUM_CLASSES = 10
IMAGE_SIZE = 28
PROBE_SEED = 1234
PROBE_SIZE = 8


@dataclass
class Dataset:
    """Uint8 images + int64 labels for both splits, and where they came from."""

    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    source: str

    def train_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The training split as the models take it."""
        return to_float(self.train_images), self.train_labels

    def test_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The test split as the models take it."""
        return to_float(self.test_images), self.test_labels


def to_float(images: torch.Tensor) -> torch.Tensor:
    """uint8 [N, 28, 28] -> float32 [N, 1, 28, 28] in [-1, 1]."""
    return (images.to(torch.float32).div(255.0).sub(0.5).div(0.5)).unsqueeze(1).contiguous()


def _prototypes(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    coarse = torch.rand(NUM_CLASSES, 1, 7, 7, generator=g)
    fine = torch.nn.functional.interpolate(coarse, size=(IMAGE_SIZE, IMAGE_SIZE), mode="bilinear", align_corners=False)
    return fine[:, 0]  # [10, 28, 28] in [0, 1]


def synthetic_images(n: int, seed: int, *, proto_seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` uint8 images and int64 labels; prototypes come from ``proto_seed``, samples from ``seed``."""
    protos = _prototypes(proto_seed)
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, NUM_CLASSES, (n,), generator=g, dtype=torch.int64)
    pad = 3
    padded = torch.nn.functional.pad(protos, (pad, pad, pad, pad), mode="replicate")[labels]  # [n, 34, 34]
    dy = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    dx = torch.randint(0, 2 * pad + 1, (n,), generator=g)
    ar = torch.arange(IMAGE_SIZE)
    rows = (ar[None, :] + dy[:, None])[:, :, None]
    cols = (ar[None, :] + dx[:, None])[:, None, :]
    imgs = padded[torch.arange(n)[:, None, None], rows, cols]
    contrast = 0.6 + 0.8 * torch.rand(n, 1, 1, generator=g)
    bright = 0.3 * (torch.rand(n, 1, 1, generator=g) - 0.5)
    imgs = (imgs - 0.5) * contrast + 0.5 + bright
    imgs = imgs + 0.35 * torch.randn(imgs.shape, generator=g)
    return (imgs.clamp(0, 1) * 255).round().to(torch.uint8), labels


def synthetic_dataset(seed: int = 0, n_train: int = 2048, n_test: int = 512) -> Dataset:
    """The default data set: deterministic for a given seed and sizes."""
    tr_x, tr_y = synthetic_images(n_train, seed * 2 + 1, proto_seed=seed)
    te_x, te_y = synthetic_images(n_test, seed * 2 + 2, proto_seed=seed)
    return Dataset(tr_x, tr_y, te_x, te_y, f"synthetic(seed={seed}, train={n_train}, test={n_test})")


#: ``--data digits``: the vendored real handwritten digits instead of a file
DIGITS = "digits"
DIGITS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "digits.csv.gz")
DIGITS_TEST = 360


def digits_dataset(seed: int = 0) -> Dataset:
    """The vendored 8x8 handwritten digits (module docstring), as 28x28 uint8, shuffled by ``seed``.

    Raises:
        TrainingError: the vendored file is missing or damaged (a broken install).
    """
    import csv
    import gzip

    try:
        with gzip.open(DIGITS_FILE, "rt", encoding="ascii") as f:
            rows = [[int(v) for v in row] for row in csv.reader(f) if row]
    except (OSError, ValueError, EOFError) as e:
        raise TrainingError(f"cannot read the bundled digits ({DIGITS_FILE}: {e}); reinstall ckptfix") from e
    if not rows or any(len(r) != 65 for r in rows):
        raise TrainingError(f"{DIGITS_FILE}: expected rows of 64 pixels and a label; reinstall ckptfix")
    table = torch.tensor(rows, dtype=torch.float32)
    small = table[:, :64].reshape(-1, 1, 8, 8) / 16.0
    big = torch.nn.functional.interpolate(small, size=(20, 20), mode="bilinear", align_corners=False)
    imgs = torch.nn.functional.pad(big, (4, 4, 4, 4))[:, 0]
    images = (imgs.clamp(0, 1) * 255).round().to(torch.uint8)
    labels = table[:, 64].to(torch.int64)
    perm = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(seed))
    images, labels = images[perm].contiguous(), labels[perm].contiguous()
    n_test = DIGITS_TEST
    return Dataset(
        images[:-n_test].contiguous(),
        labels[:-n_test].contiguous(),
        images[-n_test:].contiguous(),
        labels[-n_test:].contiguous(),
        f"digits(UCI 8x8, seed={seed}, train={images.shape[0] - n_test}, test={n_test})",
    )


def probe_batch(seed: int = PROBE_SEED, n: int = PROBE_SIZE) -> torch.Tensor:
    """The fixed probe input: ``n`` synthetic images as float32 [n, 1, 28, 28], from ``seed`` only."""
    imgs, _ = synthetic_images(n, seed, proto_seed=seed)
    return to_float(imgs)


def _check(images: torch.Tensor, labels: torch.Tensor, what: str, path: str) -> None:
    if (
        not isinstance(images, torch.Tensor)
        or images.dtype != torch.uint8
        or images.dim() != 3
        or tuple(images.shape[1:]) != (IMAGE_SIZE, IMAGE_SIZE)
    ):
        got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise TrainingError(f"{path}: {what}images must be uint8 [N, 28, 28], got {got}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != images.shape[0]:
        raise TrainingError(f"{path}: {what}labels must be a 1-D tensor with one label per image")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= NUM_CLASSES):
        raise TrainingError(f"{path}: {what}labels must be in 0..{NUM_CLASSES - 1}")


def load_dataset(path: str) -> Dataset:
    """Read a ``.pt`` or ``.npz`` file in the documented format (see the module docstring).

    Returns:
        The data set (a fifth of the samples held out for testing when the file has no test split).

    Raises:
        CheckpointNotFoundError: the file does not exist.
        TrainingError: it cannot be read or is not in the format.
    """
    if not os.path.exists(path):
        from ckptfix.errors import CheckpointNotFoundError

        raise CheckpointNotFoundError(f"data file not found: {path}")
    try:
        if path.endswith(".npz"):
            import numpy as np

            with np.load(path, allow_pickle=False) as z:
                raw = {k: torch.from_numpy(z[k].copy()) for k in z.files}
        else:
            raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise TrainingError(
            f"cannot read data file {path}: {e}; expected a .pt (torch.save of a dict) or .npz with "
            "'images' uint8 [N,28,28] and 'labels' int64 [N]"
        ) from e
    if not isinstance(raw, dict) or "images" not in raw or "labels" not in raw:
        raise TrainingError(
            f"{path}: expected a dict with 'images' and 'labels' (optionally 'test_images'/'test_labels')"
        )
    images, labels = raw["images"], raw["labels"]
    _check(images, labels, "", path)
    labels = labels.to(torch.int64)
    if "test_images" in raw and "test_labels" in raw:
        te_x, te_y = raw["test_images"], raw["test_labels"]
        _check(te_x, te_y, "test_", path)
        te_y = te_y.to(torch.int64)
        tr_x, tr_y = images, labels
    else:
        n_test = max(1, images.shape[0] // 5)
        if images.shape[0] - n_test < 1:
            raise TrainingError(f"{path}: need at least 2 samples")
        tr_x, tr_y = images[:-n_test], labels[:-n_test]
        te_x, te_y = images[-n_test:], labels[-n_test:]
    return Dataset(tr_x.contiguous(), tr_y.contiguous(), te_x.contiguous(), te_y.contiguous(), f"file({path})")


def save_dataset(ds: Dataset, path: str) -> None:
    """Write ``ds`` in the ``--data`` format (``.pt`` or ``.npz`` by extension), atomically.

    Raises:
        OutputError: the file cannot be written.
    """
    from ckptfix.files.atomic import atomic_output

    d = {
        "images": ds.train_images,
        "labels": ds.train_labels,
        "test_images": ds.test_images,
        "test_labels": ds.test_labels,
    }
    with atomic_output(path) as f:
        if path.endswith(".npz"):
            import numpy as np

            np.savez(
                f,
                images=ds.train_images.numpy(),
                labels=ds.train_labels.numpy(),
                test_images=ds.test_images.numpy(),
                test_labels=ds.test_labels.numpy(),
            )
        else:
            torch.save(d, f)
