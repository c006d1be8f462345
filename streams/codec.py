"""The schemas' codec as a Faust codec, so Faust agents read and write tabloop events.

Use ``value_serializer=FAUST_CODEC_NAME`` on a Faust topic; values are
``schemas.events.Event`` objects, encoded in the configured wire format.
"""

from __future__ import annotations

from typing import Any

from faust.serializers import codecs

from schemas.codec import Codec
from schemas.events import Event

FAUST_CODEC_NAME = "tabloop"


class FaustEventCodec(codecs.Codec):
    def __init__(self, codec: Codec | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.codec = codec or Codec()

    def _dumps(self, obj: Any) -> bytes:
        if not isinstance(obj, Event):
            raise TypeError(f"the {FAUST_CODEC_NAME!r} codec writes schemas.events.Event, not {type(obj).__name__}")
        return self.codec.encode(obj)

    def _loads(self, s: bytes) -> Event:
        return self.codec.decode(s)


def register_faust_codec(codec: Codec | None = None) -> FaustEventCodec:
    """Register (or re-register with another wire format) the tabloop codec with Faust."""
    faust_codec = FaustEventCodec(codec)
    codecs.register(FAUST_CODEC_NAME, faust_codec)
    return faust_codec
