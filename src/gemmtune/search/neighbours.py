"""Neighbourhoods for descent from the named fields of each config."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

from gemmtune.search.budget import C

_MISSING = object()


def neighbours_by_fields(space: Sequence[C], fields: Callable[[C], Mapping[str, object]]
                         ) -> Callable[[C], list[C]]:
    """Neighbours of c = the configs in ``space`` whose fields differ from c's in exactly one field."""
    # field values need not be hashable, so neighbours are found by a scan rather than an index
    rows = [(config, dict(fields(config))) for config in dict.fromkeys(space)]

    def neighbours(config: C) -> list[C]:
        mine = dict(fields(config))
        return [other for other, theirs in rows if _differences(mine, theirs) == 1]

    return neighbours


def _differences(a: dict[str, object], b: dict[str, object]) -> int:
    return sum(a.get(name, _MISSING) != b.get(name, _MISSING) for name in a.keys() | b.keys())
