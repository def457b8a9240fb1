"""What a policy learned, as plain data: the contract between learning code and the state file.

A *learner* (a policy, or a part of one: `SpeedCalibration`, `AcceptanceModel`, `PrefixIndex`)
has two methods:

- `state() -> dict`: what it learned, as JSON-ready plain data (str keys, lists, str, int,
  float, bool, None), copied (never a live reference: the caller may encode it in another
  thread while the learner goes on learning), with a `version` of its own layout;
- `load_state(state)`: take such data back. It raises `ValueError` (here `StateError`) on data
  it cannot take -- another version, other dimensions (other parameters), wrong types,
  non-finite numbers -- and then leaves itself unchanged: everything is checked before
  anything is assigned. Loading what `state()` returned makes the learner predict exactly as
  it did (floats round-trip through JSON exactly).

Policies stay pure: the file (reading, writing, sizes, versions of the file, which policy a
state belongs to) is `controller.proxy.learned_state`'s. The helpers below check plain data;
`pack` / `unpack` carry a long array of numbers as one base64 string of little-endian values
(exact, and cheap to encode: a content model's 16k weights as JSON floats cost the encoder a
few hundred milliseconds, as one string well under one).
"""

from __future__ import annotations

import base64
import binascii
import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

if TYPE_CHECKING:
    import numpy as np


class StateError(ValueError):
    """Learned state a learner cannot take (it stays unchanged)."""


@runtime_checkable
class Learner(Protocol):
    def state(self) -> dict[str, Any]: ...

    def load_state(self, state: Mapping[str, Any]) -> None: ...


def learner(obj: object) -> Learner | None:
    """`obj` if it can save and load what it learned, else None."""
    return obj if isinstance(obj, Learner) else None


def check_version(state: object, what: str, version: int) -> Mapping[str, Any]:
    """`state` as a mapping whose `version` is `version` (StateError otherwise)."""
    if not isinstance(state, Mapping):
        raise StateError(f"{what}: expected an object, got {type(state).__name__}")
    if state.get("version") != version:
        raise StateError(f"{what}: layout version {state.get('version')!r}, this code reads {version}")
    return state


def field(state: Mapping[str, Any], key: str, what: str) -> Any:
    if key not in state:
        raise StateError(f"{what}: missing {key!r}")
    return state[key]


def number(x: object, what: str) -> float:
    """A finite number (bools are not numbers here)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise StateError(f"{what}: expected a finite number, got {x!r}"[:200])
    return float(x)


def count(x: object, what: str) -> int:
    """A non-negative integer."""
    if isinstance(x, bool) or not isinstance(x, int) or x < 0:
        raise StateError(f"{what}: expected a non-negative integer, got {x!r}"[:200])
    return x


def numbers(x: object, what: str, length: int | None = None) -> list[float]:
    """A list of finite numbers (of `length` when given)."""
    if not isinstance(x, list):
        raise StateError(f"{what}: expected a list")
    if length is not None and len(x) != length:
        raise StateError(f"{what}: {len(x)} values where {length} are expected (other parameters?)")
    return [number(v, what) for v in x]


def items(x: object, what: str, width: int) -> list[list[Any]]:
    """A list of lists of `width` entries each (their types are the caller's to check)."""
    if not isinstance(x, list) or not all(isinstance(r, list) and len(r) == width for r in x):
        raise StateError(f"{what}: expected a list of {width}-entry lists")
    return x


Packed = Literal["<f8", "<i8", "<u8"]
"""How `pack` stores numbers: 64-bit floats, signed or unsigned integers, little-endian."""


def pack(values: Sequence[float] | Sequence[int] | np.ndarray, dtype: Packed) -> str:
    """`values` as one base64 string of `dtype` (ValueError/OverflowError when they do not fit)."""
    import numpy as np  # here, not at import: calibration imports this module, and a compiled
    # calibration is loaded where a broken build's imports are undone (simulator/native.py)

    return base64.b64encode(np.asarray(values, dtype=dtype).tobytes()).decode("ascii")


def unpack(data: object, dtype: Packed, what: str, length: int | None = None) -> list[Any]:
    """The numbers `pack` stored (of `length` when given; floats finite, integers >= 0 for
    "<i8"), as Python floats or ints."""
    import numpy as np

    if not isinstance(data, str):
        raise StateError(f"{what}: expected a base64 string")
    try:
        raw = base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError, ValueError):
        raise StateError(f"{what}: not base64") from None
    if len(raw) % 8:
        raise StateError(f"{what}: not a whole number of 8-byte values")
    array = np.frombuffer(raw, dtype=dtype)
    if length is not None and len(array) != length:
        raise StateError(f"{what}: {len(array)} values where {length} are expected (other parameters?)")
    if dtype == "<f8" and not bool(np.isfinite(array).all()):
        raise StateError(f"{what}: expected finite numbers")
    if dtype == "<i8" and bool((array < 0).any()):
        raise StateError(f"{what}: expected non-negative integers")
    values: list[Any] = array.tolist()
    return values
