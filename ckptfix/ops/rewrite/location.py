"""Storage location tags (``cuda:7``, ``cpu``): parsing ``--map-location`` and re-tagging storages."""

from __future__ import annotations

from typing import Callable, Iterable

from ckptfix.errors import UnsupportedError
from ckptfix.formats import CheckpointFile, Format


def parse_map_location(spec: str | None) -> Callable[[str], str] | None:
    """``"cpu"`` -> every tag becomes cpu; ``"cuda:7=cuda:0,cuda:1=cpu"`` -> those tags only.

    Args:
        spec: the ``--map-location`` text, or None.

    Returns:
        location tag -> new tag, or None when ``spec`` is empty.

    Raises:
        UnsupportedError: not ``FROM=TO`` pairs, or a device torch.load does not know.
    """
    if not spec:
        return None
    if "=" not in spec:
        target = _check_device(spec.strip(), spec)
        return lambda loc: target
    table = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        a, eq, b = part.partition("=")
        if not eq or not a.strip():
            raise UnsupportedError(
                f"--map-location {spec!r}: {part.strip()!r} is not FROM=TO; write it like "
                "'cpu' or 'cuda:7=cuda:0,cuda:1=cpu'"
            )
        table[a.strip()] = _check_device(b.strip(), spec)
    return lambda loc: table.get(loc, loc)


#: device types torch.load can restore a storage to (its location tags)
_DEVICE_TYPES = (
    "cpu",
    "cuda",
    "mps",
    "meta",
    "xpu",
    "hpu",
    "mtia",
    "xla",
    "maia",
    "ipu",
    "privateuseone",
    "npu",
    "mlu",
    "musa",
)  # the last: common out-of-tree (privateuse1) backends


def _check_device(dev: str, spec: str) -> str:
    """``dev`` if torch.load can restore a storage tagged with it, else an error (an unloadable file otherwise)."""
    kind, _, index = dev.partition(":")
    if kind not in _DEVICE_TYPES or (index and not index.isdigit()) or dev.endswith(":"):
        raise UnsupportedError(
            f"--map-location {spec!r}: {dev!r} is not a device torch.load knows (cpu, cuda, "
            "cuda:N, mps, xpu:N ...); write it like 'cpu' or 'cuda:7=cuda:0,cuda:1=cpu'"
        )
    return dev


def relocate(cf: CheckpointFile, map_location: str | None) -> dict[str, str]:
    """Re-tag ``cf``'s storages (in memory) as ``map_location`` says.

    Args:
        cf: the checkpoint read from disk.
        map_location: the ``--map-location`` text, or None.

    Returns:
        ``{old tag: new tag}`` of the tags changed.

    Raises:
        UnsupportedError: a safetensors file (no tags), or a bad ``map_location``.
    """
    relocate = parse_map_location(map_location)
    relocated: dict[str, str] = {}
    if relocate is None:
        return relocated
    if cf.format == Format.SAFETENSORS:
        raise UnsupportedError("safetensors files carry no device tags; --map-location does not apply")
    for st in cf.storages.values():
        new = relocate(st.location)
        if new != st.location:
            relocated[st.location] = new
            st.location = new
    return relocated


def kept_device_note(cfs: Iterable[CheckpointFile], *, hint: str = "pass --map-location cpu to retag") -> str | None:
    """The note a rewrite adds when its output keeps storage tags other than ``cpu`` (``cuda:3``, ``mps``).

    Keeping them is right (the file is what the user saved), but plain ``torch.load`` of it on a machine
    without that device fails "Attempting to deserialize object on a CUDA device": the user is told,
    as ``inspect`` does, and how to retag.

    Args:
        cfs: the checkpoint(s) written, their storages as tagged in the output (after :func:`relocate`).
        hint: how to retag, in the words of the command (``--map-location cpu`` for the renaming commands).

    Returns:
        ``"storages stay on cuda:3; pass --map-location cpu to retag"``, or None when every tag is ``cpu``.
    """
    tags = sorted({st.location for cf in cfs for st in cf.storages.values() if st.location and st.location != "cpu"})
    if not tags:
        return None
    return f"storages stay on {', '.join(tags)}; {hint}"
