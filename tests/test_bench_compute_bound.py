"""bench/compute_bound.py's arithmetic (its run end to end: stage 12's dry run in
tests/test_gpu_window.py): the shapes' parameter counts, which decide whether plain PyTorch's
states fit the device, are transformers' own."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))

import compute_bound as cb  # noqa: E402


@pytest.mark.parametrize("name", ["qwen2.5-3b", "llama3-8b", "40x3584", "2x256", "qwen2:2x256"])
def test_a_shapes_parameters_are_the_models_transformers_builds(tmp_path, name):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = cb.shape_of(name)
    cb.write_config(shape, 2048, str(tmp_path))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(str(tmp_path)))
    assert cb.params_of(shape) == sum(p.numel() for p in model.parameters())
    if name == "qwen2.5-3b":
        assert 3.0e9 < cb.params_of(shape) < 3.2e9 and model.config.tie_word_embeddings


def test_an_unknown_shape_names_the_ones_there_are():
    with pytest.raises(SystemExit, match=r"--shape '3b': one of qwen2.5-3b, llama3-8b or \[FAMILY:\]LAYERSxWIDTH"):
        cb.shape_of("3b")
