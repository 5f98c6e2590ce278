"""Small helpers every rule uses: integer checks and element sizes."""

from __future__ import annotations

from typing import Optional

from ..plan import ELEMENT_SIZE, PassThrough, Request, Unplanned, dtype_name


def is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def element_size(dtype: Optional[str]) -> int:
    if dtype is None:
        return 4  # torch's default dtype, float32
    size = ELEMENT_SIZE.get(dtype_name(dtype))
    if size is None:
        raise Unplanned(f"no element size known for dtype {dtype}")
    return size


def check_ints(req: Request, *names: str) -> Optional[PassThrough]:
    """A PassThrough for the first of ``names`` that is not a positive int (FlashInfer
    decides what such an argument means), else None."""
    for name in names:
        value = getattr(req, name)
        if not is_int(value):
            return PassThrough(f"{name}={value!r} is not an int; FlashInfer decides")
        if value <= 0:
            return PassThrough(f"{name}={value!r}; FlashInfer decides")
    return None
