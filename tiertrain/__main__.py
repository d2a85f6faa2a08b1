"""``python -m tiertrain`` (what ``torchrun ... -m tiertrain train`` starts on every rank)."""

from .cli import console

console()
