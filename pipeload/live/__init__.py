"""Live weight transfer: a trainer's sharded weights into other ranks' buffers (:func:`.api.transfer`)."""

from .api import TransferError, TransferStats, transfer

__all__ = ["transfer", "TransferStats", "TransferError"]
