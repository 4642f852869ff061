"""Load any checkpoint into a plain model, in a script -- a drop-in for torch.load.

    python examples/load_any_checkpoint.py CKPT            # on one process
    torchrun --nproc-per-node 2 examples/load_any_checkpoint.py CKPT   # each rank on its own device

Works for DataParallel / DDP / torch.compile / Lightning checkpoints, files saved on
cuda:7 loaded on a CPU-only box, legacy files, safetensors, DCP directories.
"""

import sys

import torch

from ckptfix import load_checkpoint
from ckptfix.train.models import build_model


def main(path: str) -> None:
    model = build_model("lenet", 0)
    # "auto" = cuda:$LOCAL_RANK under torchrun, cuda:0 on a GPU box, else cpu.
    ck = load_checkpoint(path, map_location="auto", model=model)
    model.load_state_dict(ck.state_dict)  # strict: keys were aligned to the model
    print(
        f"loaded {len(ck.state_dict)} tensors from {ck.format} file (state dict at "
        f"{'/'.join(ck.key_path) or 'top level'}); alignment: {ck.alignment.summary()}"
    )
    if ck.remapped:
        print(f"device tags remapped: {ck.remapped}")
    if ck.stubbed_globals:
        print(f"globals kept as inert placeholders: {ck.stubbed_globals}")
    print(f"epoch in checkpoint: {ck.get('epoch')}")
    model.eval()
    with torch.no_grad():
        print("output on zeros:", model(torch.zeros(1, 1, 28, 28)).argmax().item())


if __name__ == "__main__":
    main(sys.argv[1])
