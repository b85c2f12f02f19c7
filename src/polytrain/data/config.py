"""Settings for where training data comes from and how it is batched."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from polytrain.options import option, register_section


@register_section("data", "data", order=30)
@dataclass
class DataConfig:
    data: str = option("digits", "dataset: digits | synthetic[:k=v,...] | cifar10:DIR | text[:FILE][,seq_len=N] | "
                       "sentences:FILE | tokens:FILE.bin[,dtype=uint16|uint32,seq_len=N] | "
                       "hf:DIR|FILE.jsonl|FILE.parquet[,field=text,split=train] | package.module:factory",
                       metavar="NAME")
    tokenizer: str | None = option(None, "tokenize language-model text with this tokenizer: a tokenizer.json, a "
                                   "directory holding one (a Hugging Face model's), a SentencePiece .model, or "
                                   "'text' (the one shipped, trained on --data text); default: bytes",
                                   metavar="DIR|FILE")
    pack: bool = option(False, "pack documents into full sequences, attention and loss kept within each document "
                        "(language-model data with documents: hf:, tokens:, sentences:)")
    data_args: dict[str, Any] = option({}, "extra dataset argument (repeatable)", flag="--data-arg",
                                       metavar="KEY=VALUE", repeat=True)
    batch_size: int | None = option(64, "global batch size per optimizer step (split over the workers)",
                                    minimum=1, metavar="N")
    worker_batch_size: int | None = option(None, "examples per worker per step instead of a global --batch-size",
                                           minimum=1, metavar="N")
    data_workers: int = option(0, "DataLoader processes per worker for datasets that are not in memory",
                               minimum=0, metavar="N")
    log_example_ids: str | None = option(None, "append the dataset indices each step trained on to FILE, one JSON "
                                         "line per step (to audit that each example is used once per epoch)",
                                         metavar="FILE")
