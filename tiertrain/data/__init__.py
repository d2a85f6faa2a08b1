"""Training data: the bundled corpus, tokenizers, token files and the batch sampler."""

from .loader import ByteTokenizer, Corpus, EvalSet, bundled_corpus_path, load_tokenizer, open_corpus
from .tokens import TokenFileError, read_tokens, write_tokens

__all__ = [
    "ByteTokenizer",
    "Corpus",
    "EvalSet",
    "bundled_corpus_path",
    "load_tokenizer",
    "open_corpus",
    "TokenFileError",
    "read_tokens",
    "write_tokens",
]
