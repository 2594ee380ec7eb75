"""What the settings sections share: the section base class and the parsers of single values.

`Section` makes every settings group frozen, closed to unknown fields and reads an empty string
as "unset" for optional fields; the parsers turn the environment's strings (device lists, comma
lists) into the values the sections check. The sections themselves are settings/sections.py's.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, model_validator


def parse_device_list(value: Any) -> tuple[str, ...]:
    """`"0,1,2"` / `"cpu"` / `"cuda:3"` -> `("cuda:0", "cuda:1", "cuda:2")` / `("cpu",)` / ...

    Only the syntax is checked here; devices.parse_device checks that a device exists.
    """
    items = value.split(",") if isinstance(value, str) else list(value)
    devices = tuple(canonical_device(str(item).strip().lower()) for item in items)
    if not devices:
        raise ValueError("needs at least one device, e.g. 0,1 or cpu")
    # a GPU appears once per list; cpu may repeat (each entry is one more CPU worker thread)
    duplicates = sorted({d for d in devices if devices.count(d) > 1 and d != "cpu"})
    if duplicates:
        raise ValueError(f"lists {', '.join(duplicates)} more than once")
    return devices


def canonical_device(item: str) -> str:
    """`"3"` / `"cuda"` / `"cuda:3"` / `"cpu"` -> `"cuda:3"` / `"cuda:0"` / ... (syntax only)."""
    if item == "cpu":
        return "cpu"
    index = "0" if item == "cuda" else item.removeprefix("cuda:")
    if not index.isdigit():
        raise ValueError(f"{item!r} is not a device: use GPU indices such as 0,1,2 or cpu")
    return f"cuda:{int(index)}"


def parse_int_list(value: Any) -> Any:
    """`"1,9,17"` -> (1, 9, 17); other values as they are (pydantic checks them)."""
    if isinstance(value, str):
        return tuple(int(part) for part in value.split(",") if part.strip())
    return value


class Section(BaseModel):
    """A settings group: frozen, no unknown fields, empty strings mean None for optional fields."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_attribute_docstrings=True)

    @model_validator(mode="before")
    @classmethod
    def _empty_means_unset(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        unset = {k for k, f in cls.model_fields.items() if f.default is None}
        return {key: None if value == "" and key in unset else value for key, value in data.items()}
