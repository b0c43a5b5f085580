"""Reports as data: a title, column names and rows of plain values (rendering lives in render.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Report:
    """One table a pass produced: plain values only, so it round-trips through JSON."""

    title: str
    columns: tuple[str, ...]
    rows: tuple[tuple[Any, ...], ...]
    notes: tuple[str, ...] = field(default=())

    def to_json(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "columns": list(self.columns),
            "rows": [list(r) for r in self.rows],
            "notes": list(self.notes),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Report:
        return cls(
            title=str(data["title"]),
            columns=tuple(data["columns"]),
            rows=tuple(tuple(r) for r in data["rows"]),
            notes=tuple(data.get("notes", ())),
        )

    def column(self, name: str) -> list[Any]:
        """Values of one column, top to bottom."""
        i = self.columns.index(name)
        return [r[i] for r in self.rows]
