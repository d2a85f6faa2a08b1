"""tiertrain: train language models larger than accelerator memory, states on SSD."""

__version__ = "0.1.0"
