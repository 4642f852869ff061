"""What a rewrite did (:class:`RewriteReport`) and the transform it applies (:data:`Transform`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

#: a transform: state dict -> (new state dict, report object with to_dict()/summary())
Transform = Callable[[Mapping[str, Any]], "tuple[Mapping[str, Any], Any]"]


@dataclass
class RewriteReport:
    """What a rewrite did.  ``to_dict()`` is the ``--json`` document.

    Attributes:
        source: the input path.
        output: the file (or index) written; None when nothing needed to change.
        format_in: the input's format.
        format_out: the output's format.
        key_path: where the state dict sits.
        changed: whether anything was renamed or re-tagged.
        renamed: keys renamed.
        detail: the transform's own report.
        backup: the backup kept by ``in_place``.
        notes: sentences for the user.
        relocated: ``{old location tag: new}``.
    """

    source: str
    output: str | None
    format_in: str
    format_out: str | None
    key_path: list[str]
    changed: bool
    renamed: int
    detail: dict[str, Any]
    backup: str | None = None
    notes: list[str] = field(default_factory=list)
    relocated: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-ready data.

        Returns:
            Every field.
        """
        return dict(self.__dict__)


def detail(report: Any) -> dict[str, Any]:
    """A transform's report as a dict.

    Args:
        report: an object with ``to_dict()``, a mapping, or None.

    Returns:
        The dict (empty for None).
    """
    return report.to_dict() if hasattr(report, "to_dict") else dict(report or {})
