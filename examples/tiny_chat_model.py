"""Make a small random Llama and a tokenizer with a chat template in a local directory, to
try fine-tuning without downloading anything (nothing here is reachable offline otherwise):

    python examples/tiny_chat_model.py runs/tiny-llama

The tokenizer is a byte-level BPE of 2,048 tokens trained here, in seconds, on the bundled
corpus and the example chats, with special tokens <|system|>, <|user|>, <|assistant|>,
<|end|> and </s>, and a chat template that renders each message as
`<|role|>\\ncontent<|end|>\\n`. The model: Llama, 4 layers, d_model 256, random weights."""

from __future__ import annotations

import argparse
import json
import os

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL = ["</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


def texts(here: str):
    from tiertrain.data import bundled_corpus_path

    with open(bundled_corpus_path(), encoding="utf-8") as f:
        yield from f
    for name in ("chat.jsonl", "chat_val.jsonl"):
        with open(os.path.join(here, name), encoding="utf-8") as f:
            for line in f:
                for m in json.loads(line)["messages"]:
                    yield m["content"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the directory to write (config.json, model.safetensors, tokenizer files)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--d-model", type=int, default=256)
    args = ap.parse_args()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts(os.path.dirname(os.path.abspath(__file__))), trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="</s>", pad_token="</s>", additional_special_tokens=SPECIAL[1:]
    )
    fast.chat_template = TEMPLATE
    fast.save_pretrained(args.out)

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=args.d_model,
        intermediate_size=args.d_model * 8 // 3,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.d_model // 64),
        max_position_embeddings=512,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        bos_token_id=fast.eos_token_id,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(args.out)
    print(
        f"wrote a {sum(p.numel() for p in model.parameters()) / 1e6:.1f} M-parameter Llama and a "
        f"{len(fast)}-token tokenizer with a chat template to {args.out}"
    )


if __name__ == "__main__":
    main()
