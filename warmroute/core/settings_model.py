"""The base of every settings model: fields documented by the docstring under them, values fixed once built.

A setting is one line (its type, default and bounds) and the docstring below it, which becomes its description
(pydantic's attribute docstrings) and so its flag's help and its row in docs/configuration.md, with the docstring's
line breaks folded into spaces.
"""

from __future__ import annotations

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
            cls.model_rebuild(force=True)
