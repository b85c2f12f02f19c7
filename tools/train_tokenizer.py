"""Train the shipped tokenizer (``--tokenizer text``) on the shipped text: ``src/polytrain/data/text_tokenizer.json``.

Run once; polytrain never trains a tokenizer at run time. A byte-level BPE (GPT-2's scheme: any UTF-8 text
encodes, nothing is unknown) of 1,024 tokens, the first of them ``<|endoftext|>`` (id 0, the end-of-document
token), trained with Hugging Face ``tokenizers`` on the training split of ``--data text`` (the first 90 % of
*The Devil's Dictionary*), so the test split stays unseen:

    python tools/train_tokenizer.py            # needs: pip install tokenizers

The trainer is deterministic: the same text gives the same file.
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from polytrain.data.text import TEST_FRACTION, shipped_text  # noqa: E402

OUT = ROOT / "src" / "polytrain" / "data" / "text_tokenizer.json"
VOCAB = 1024
EOS = "<|endoftext|>"


def train(text: str, vocab: int = VOCAB):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=[EOS], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(text.split("\n\n"), trainer=trainer)
    return tokenizer


def main() -> None:
    data = shipped_text()
    text = data[: int(len(data) * (1 - TEST_FRACTION))].decode("utf-8")
    tokenizer = train(text)
    OUT.write_text(tokenizer.to_str(pretty=False) + "\n", encoding="utf-8")
    ids = tokenizer.encode(text).ids
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): vocabulary {tokenizer.get_vocab_size()}, "
          f"{len(text.encode())} training bytes -> {len(ids)} tokens ({len(text.encode()) / len(ids):.2f} bytes/token)")


if __name__ == "__main__":
    main()
