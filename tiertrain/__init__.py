"""tiertrain: train language models larger than accelerator memory, states on SSD.

The Python API (imported on first use, so that ``import tiertrain`` stays cheap):
``tiertrain.train(config, *overrides)`` trains as ``tiertrain train`` does and returns the step
records; ``Trainer`` runs steps one at a time; ``Config`` / ``load_config`` build the config;
``evaluate``, ``generate``, ``prepare_examples`` and ``export`` (a checkpoint as a Hugging Face
model directory or a peft adapter: ``export(checkpoint, out)``) are the other commands' functions."""

import importlib

__version__ = "0.1.0"
__all__ = [
    "train",
    "Trainer",
    "Config",
    "load_config",
    "as_config",
    "evaluate",
    "generate",
    "Sampling",
    "prepare_examples",
    "export",
]

_WHERE = {
    "train": "api",
    "Trainer": "training.trainer",
    "Config": "config",
    "load_config": "config",
    "as_config": "config",
    "evaluate": "inference.evaluate",
    "generate": "inference.generate",
    "Sampling": "inference.generate",
    "prepare_examples": "data.prepare",
    "export": "checkpoint.export",
}


def __getattr__(name: str):
    if name in _WHERE:
        return getattr(importlib.import_module(f".{_WHERE[name]}", __name__), name)
    raise AttributeError(f"module 'tiertrain' has no attribute {name!r}")
