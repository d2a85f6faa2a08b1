"""Gradient compression between the trainer and the update engines."""

from .topk import pack, payload_bytes, topk_decode, topk_encode, unpack

__all__ = ["topk_encode", "topk_decode", "pack", "unpack", "payload_bytes"]
