"""Adapters on a frozen base (``[adapter]``): LoRA's modules and hooks (``lora.py``), their
update and checkpointed state (``train.py``), peft's adapter directories in and out
(``peft_io.py``)."""

from .lora import LoRA, find_targets
from .train import ADAPTER_FILE, AdapterUpdate

__all__ = ["LoRA", "find_targets", "AdapterUpdate", "ADAPTER_FILE"]
