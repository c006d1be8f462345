"""The contract: Avro event schemas, the codec, the topic catalog."""

from schemas.codec import (Codec, CorruptEventError, EventDecodeError, EventEncodeError, TruncatedEventError,
                           UnknownSchemaError)
from schemas.events import EVENT_TYPES, Event, new_event

__all__ = [
    "Codec", "CorruptEventError", "EventDecodeError", "EventEncodeError", "TruncatedEventError",
    "UnknownSchemaError", "EVENT_TYPES", "Event", "new_event",
]
