"""Token ids packed as bytes: little-endian uint32, 4 bytes an id.

``CompletionServed`` (from v5) and ``Episode`` (from v8) carry the prompt's few hundred token ids this way,
in ``prompt_token_ids_packed``: fastavro writes an ``array<int>`` item by item (two thirds of encoding a
completion, measured in issue 32), bytes in one copy. New writers leave the old ``prompt_token_ids`` array
empty, which readers of the older versions already take as "not recorded: re-encode the prompt"; events
written before carry their ids in the array. ``prompt_ids`` reads either, and is what every reader calls.

The streams worker's internal topics and tables are JSON: there the packed ids travel as base64 text
(``packed_text``, called by ``streams.app.plain``), and ``packed_field`` turns them back into bytes.
"""

from __future__ import annotations

import base64
import binascii
import sys
from array import array
from typing import Any, Iterable, Mapping

import numpy as np

PACKED = "prompt_token_ids_packed"
"""The field that holds the packed prompt ids, in CompletionServed and Episode."""
DTYPE = np.dtype("<u4")
# array('I') is the same layout on a little-endian host with 4-byte ints (everywhere tabloop runs), and
# builds from a list of ints 3x faster than numpy; elsewhere numpy does the byte order.
_ARRAY_IS_UINT32_LE = sys.byteorder == "little" and array("I").itemsize == 4


def pack_ids(ids: Iterable[int]) -> bytes:
    """Token ids as little-endian uint32 bytes. OverflowError for an id outside 0 .. 2**32 - 1."""
    if isinstance(ids, np.ndarray):
        if ids.size and (ids.min() < 0 or ids.max() > 0xFFFF_FFFF):
            raise OverflowError("token ids must be in 0 .. 2**32 - 1")
        return ids.astype(DTYPE).tobytes()
    if _ARRAY_IS_UINT32_LE:
        return array("I", ids).tobytes()
    return np.asarray(list(ids), dtype=DTYPE).tobytes()


def unpack_ids(data: bytes | bytearray | memoryview) -> np.ndarray:
    """Packed ids as a read-only uint32 array (a view of ``data``, no copy). ValueError: not whole ids."""
    if len(data) % DTYPE.itemsize:
        raise ValueError(f"packed token ids are 4 bytes each; got {len(data)} bytes")
    return np.frombuffer(data, dtype=DTYPE)


def packed_field(value: Any) -> bytes:
    """The packed ids as bytes, however a record holds them: bytes (decoded events), base64 text (the
    streams worker's JSON), a list of ints (a history table's ``Array(UInt32)`` column), or nothing."""
    if not value:
        return b""
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str):
        try:
            return base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"{PACKED} as text must be base64: {exc}") from None
    return pack_ids(value)


def packed_text(data: bytes) -> str:
    """Packed ids as base64 text, for JSON (Faust's would write the bytes' repr); ``packed_field`` reads it."""
    return base64.b64encode(data).decode("ascii")


def prompt_ids(record: Mapping[str, Any]) -> list[int]:
    """The prompt token ids of a CompletionServed or Episode record, whichever field holds them; [] when
    neither does (not recorded: re-encode the prompt)."""
    packed = record.get(PACKED)
    if packed:
        return unpack_ids(packed_field(packed)).tolist()
    return list(record.get("prompt_token_ids") or ())
