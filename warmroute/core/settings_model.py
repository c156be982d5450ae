"""The base of every settings model: fields documented by the docstring under them, values fixed once built.

A setting is one line (its type, default and bounds) and the docstring below it, which becomes its description
(pydantic's attribute docstrings) and so its flag's help and its row in docs/configuration.md, with the docstring's
line breaks folded into spaces.
"""

from __future__ import annotations

import re
from typing import Any

from pydantic import BaseModel, ConfigDict


class SettingsModel(BaseModel):
    """Settings read from flags, environment and files: unknown names refused, frozen (stages copy their values
    when built)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @classmethod
    def __pydantic_init_subclass__(cls, **kwargs: Any) -> None:
        super().__pydantic_init_subclass__(**kwargs)
        folded = False
        for field in cls.model_fields.values():
            if field.description and "\n" in field.description:
                field.description = " ".join(field.description.split())
                folded = True
        if folded:  # the JSON schema was built from the descriptions before folding
            cls.model_rebuild(force=True, raise_errors=False)  # a forward reference: rebuilt once defined


KiB, MiB, GiB = 1024, 1024**2, 1024**3
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]i?B?|B)?\s*$", re.IGNORECASE)


def parse_mapping(value: Any) -> Any:
    """NAME=VALUE,NAME=VALUE (a flag or env variable) into a dict; a mapping (YAML) as it is."""
    if not isinstance(value, str):
        return value
    out: dict[str, str] = {}
    for part in filter(None, (p.strip() for p in value.split(","))):
        name, eq, v = part.partition("=")
        if not eq or not name.strip():
            raise ValueError(f"expected NAME=VALUE,... but got {part!r}")
        out[name.strip()] = v.strip()
    return out


def parse_size(value: Any) -> Any:
    """'32MiB', '256 MiB', '64k', '1GiB' -> bytes; plain numbers pass through."""
    if not isinstance(value, str):
        return value
    m = _SIZE.match(value)
    if not m:
        return value  # let the int validator name the problem
    unit = (m.group(2) or "B").upper()[0]
    return int(float(m.group(1)) * {"B": 1, "K": KiB, "M": MiB, "G": GiB}[unit])
