"""Turn a training checkpoint into a release file: safetensors, prefixes stripped, verified.

    python examples/release_as_safetensors.py TRAINING_CKPT OUT.safetensors

The training wrapper (epoch, optimizer, scaler, args) is left out; its plain
values are recorded as metadata; tied weights are stored once.
"""

import sys

from safetensors.torch import load_file

from ckptfix import convert_to_safetensors
from ckptfix.train.models import build_model


def main(src: str, dst: str) -> None:
    report = convert_to_safetensors(src, dst, strip_prefix=True, force=True)
    print(f"wrote {report.to_dict().get('outputs') or dst}; verified={report.to_dict().get('verified')}")
    model = build_model("lenet", 0)
    model.load_state_dict(load_file(dst))  # plain safetensors, strict, no ckptfix needed to read it
    print("loads into a plain LeNet with strict=True")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
