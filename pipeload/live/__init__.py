"""Live weight transfer: a trainer's sharded weights into other ranks' buffers (:func:`.api.transfer`)."""

from .api import TransferError, TransferStats, transfer
from .record import Recorded, record_slices
from .stream import stream

__all__ = ["transfer", "stream", "record_slices", "Recorded", "TransferStats", "TransferError"]
