"""Pick the freest GPU in-process *before* CUDA starts, fall back to the CPU when there is none.

    python examples/pick_gpu_then_train.py

pick_gpu() sets CUDA_VISIBLE_DEVICES (by UUID) and CUDA_DEVICE_ORDER=PCI_BUS_ID in
os.environ; it must run before anything initialises CUDA, so torch is imported after it.
"""

from ckptfix import pick_gpu
from ckptfix.errors import GpuToolingError, NoGpuError, NoGpuFitsError

try:
    chosen = pick_gpu(n=1, min_free="2GiB")
    print("using GPU", chosen)
    device = "cuda:0"  # the chosen GPU is the only one this process sees
except (GpuToolingError, NoGpuError, NoGpuFitsError) as e:
    print(f"no usable GPU ({e}); training on the CPU")
    device = "cpu"

import torch  # noqa: E402 - after pick_gpu on purpose

x = torch.randn(64, 64, device=device)
print("matmul ok on", device, float((x @ x).sum()) == float((x @ x).sum()))
