"""Data (corpus, token files, prepare, sampler) and Hugging Face model directories."""

import numpy as np
import pytest
import torch
from reference import small_config

from tiertrain.cli import main
from tiertrain.config import ConfigError, DataConfig
from tiertrain.data import ByteTokenizer, Corpus, TokenFileError, read_tokens, write_tokens
from tiertrain.models import hf_config_from
from tiertrain.training.trainer import Trainer


def test_bundled_corpus_and_sampler_are_deterministic():
    c = Corpus(DataConfig(seq_len=16, micro_batch_size=3, micro_batches=2, seed=7))
    assert c.vocab_size == 256 and len(c.tokens) > 300_000
    a, b, other = c.batches(5), c.batches(5), c.batches(6)
    assert len(a) == 2 and a[0][0].shape == (3, 16)
    assert all(torch.equal(x, y) for (x, _), (y, _) in zip(a, b))
    assert not torch.equal(a[0][0], other[0][0])
    x, y = a[0]
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one
    text = ByteTokenizer().decode(x[0].tolist())
    assert isinstance(text, str) and len(text) > 0


def test_token_files_roundtrip_and_detect_damage(tmp_path):
    path = str(tmp_path / "t.bin")
    ids = np.arange(1000) % 300
    assert write_tokens(path, [ids[:400], ids[400:]], vocab_size=300) == 1000
    arr, vocab = read_tokens(path, verify=True)
    assert vocab == 300 and np.array_equal(np.asarray(arr), ids)
    raw = bytearray(open(path, "rb").read())
    raw[200] ^= 0xFF
    open(path, "wb").write(raw)
    with pytest.raises(TokenFileError, match="does not match its checksum"):
        read_tokens(path, verify=True)
    open(path, "wb").write(raw[:500])
    with pytest.raises(TokenFileError, match=r"is truncated: expected 2064 bytes, found 500"):
        read_tokens(path)
    (tmp_path / "x.bin").write_bytes(b"hello")
    with pytest.raises(TokenFileError, match="not a tiertrain token file"):
        read_tokens(str(tmp_path / "x.bin"))
    with pytest.raises(TokenFileError, match=r"token ids must be in \[0, 10\)"):
        write_tokens(str(tmp_path / "y.bin"), [np.array([3, 11])], vocab_size=10)


def _word_tokenizer(directory):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "in", "the", "beginning", "god", "created", "heaven", "and", "earth", "."]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(directory)


def test_prepare_with_a_local_tokenizer_then_train(tmp_path):
    text = tmp_path / "a.txt"
    text.write_text("in the beginning god created the heaven and the earth .\n" * 200)
    _word_tokenizer(tmp_path / "tok")
    out = tmp_path / "corpus.bin"
    assert main(["prepare", "--input", str(text), "--output", str(out), "--tokenizer", str(tmp_path / "tok")]) == 0
    arr, vocab = read_tokens(str(out), verify=True)
    assert vocab == 10 and len(arr) == 11 * 200 and list(arr[:4]) == [1, 2, 3, 4]
    cfg = small_config(tmp_path, layers=1, d=32, heads=2, steps=2)
    cfg.data = DataConfig(corpus=str(out), seq_len=16, micro_batch_size=2, micro_batches=1)
    with Trainer(cfg) as tr:
        tr.initialize(progress=False)
        assert tr.corpus.vocab_size == 10 and tr.train_step().loss > 0


def test_corpus_vocab_larger_than_model_is_refused(tmp_path):
    path = str(tmp_path / "big.bin")
    write_tokens(path, [np.arange(5000)], vocab_size=5000)
    cfg = small_config(tmp_path)
    cfg.data = DataConfig(corpus=path, seq_len=16, micro_batch_size=1, micro_batches=1)
    with pytest.raises(ConfigError, match=r"model.vocab_size = 256 is smaller than the corpus vocabulary \(5000\)"):
        Trainer(cfg)
    small = str(tmp_path / "small.bin")  # the training corpus fits; the evaluation corpus does not
    write_tokens(small, [np.arange(200)], vocab_size=256)
    cfg.data = DataConfig(corpus=small, eval_corpus=path, seq_len=16, micro_batch_size=1, micro_batches=1)
    cfg.train.eval_every = 1
    with pytest.raises(ConfigError, match=r"smaller than the evaluation corpus vocabulary \(5000\)"):
        Trainer(cfg)


@pytest.mark.parametrize("sharded", [False, True])
def test_train_from_a_local_hf_directory(tmp_path, sharded):
    from transformers import AutoModelForCausalLM

    cfg = small_config(tmp_path, kind="llama", layers=2, d=64, steps=2)
    torch.manual_seed(3)
    hf = AutoModelForCausalLM.from_config(hf_config_from(cfg.model))
    hf.save_pretrained(tmp_path / "hf", max_shard_size="100KB" if sharded else "1GB")
    assert (tmp_path / "hf" / ("model.safetensors.index.json" if sharded else "model.safetensors")).exists()
    cfg.model.hf_dir = str(tmp_path / "hf")
    with Trainer(cfg) as tr:
        assert "safetensors" in tr.source.describe
        tr.initialize(progress=False)
        got = tr.weights()
        from tiertrain.models import _hf_names

        names = _hf_names(tr.model)
        want = hf.state_dict()
        for ours, theirs in names.items():
            assert torch.equal(got[ours], want[theirs]), ours
        losses = [tr.train_step().loss for _ in range(2)]
        assert all(np.isfinite(losses))


def test_hf_directory_without_weights_is_explained(tmp_path):
    from transformers import AutoModelForCausalLM

    cfg = small_config(tmp_path, kind="llama", layers=1, d=32, heads=2)
    hf = AutoModelForCausalLM.from_config(hf_config_from(cfg.model))
    hf.config.save_pretrained(tmp_path / "cfgonly")
    cfg.model.hf_dir = str(tmp_path / "cfgonly")
    with pytest.raises(ConfigError, match=r"no model.safetensors\(.index.json\) there.*model.from_scratch = true"):
        Trainer(cfg)
    # the weights in pytorch_model.bin: told to convert them, not to train from random weights
    hf.config.save_pretrained(tmp_path / "bin")  # (transformers 5 writes safetensors only: torch.save as older ones)
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    cfg.model.hf_dir = str(tmp_path / "bin")
    with pytest.raises(ConfigError, match=r"there \(its weights are in pytorch_model.bin: convert them") as err:
        Trainer(cfg)
    assert "from_scratch" not in str(err.value)
    cfg.model.hf_dir = str(tmp_path / "cfgonly")
    cfg.model.from_scratch = True
    with Trainer(cfg) as tr:
        assert "random init" in tr.source.describe
