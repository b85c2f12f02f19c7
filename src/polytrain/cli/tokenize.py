"""``polytrain tokenize``: a token file (``--data tokens:FILE.bin``) from text, JSON Lines, Parquet or a saved
dataset, tokenized in parallel processes (:mod:`polytrain.data.pretokenize`)."""

from __future__ import annotations

import argparse
from typing import Any

DESCRIPTION = """\
Tokenize documents into a token file for 'polytrain train --data tokens:FILE.bin': each document's tokens
followed by the tokenizer's end-of-document token, as uint16 (or uint32 for a vocabulary over 65,536),
with FILE.bin.json beside it (dtype, tokenizer, vocabulary, documents). A document is a whole text file, a
JSON Lines line's --field, a Parquet row's --field column, or a row of a dataset saved with datasets'
save_to_disk. Chunks of the inputs are tokenized by --workers processes; an interrupted run, started again
with the same arguments, continues where it stopped, and the file is the same whatever --workers."""

EXAMPLES = """\
examples:
  polytrain tokenize corpus.jsonl --tokenizer text --output corpus.bin
  polytrain tokenize shards/*.parquet --tokenizer llama-dir/ --field content --output train.bin --workers 8
  polytrain train --data tokens:corpus.bin,seq_len=256 --tokenizer text --pack
"""


def add_parser(sub: Any) -> None:
    parser = sub.add_parser("tokenize", help="write a token file from text, JSON Lines or Parquet",
                            description=DESCRIPTION, epilog=EXAMPLES,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("inputs", nargs="+", metavar="INPUT",
                        help="text, JSON Lines (.jsonl) or Parquet files, or a saved dataset's directory")
    parser.add_argument("--tokenizer", required=True, metavar="DIR|FILE",
                        help="a tokenizer.json, a directory holding one, a SentencePiece .model, or 'text'")
    parser.add_argument("--output", "-o", required=True, metavar="FILE.bin", help="the token file to write")
    parser.add_argument("--field", default="text", help="the JSON field or column holding the text (default: text)")
    parser.add_argument("--split", default=None, help="a saved DatasetDict's split (default: train)")
    parser.add_argument("--dtype", choices=("uint16", "uint32"), default=None,
                        help="token width (default: uint16 when the vocabulary fits, else uint32)")
    parser.add_argument("--workers", type=int, default=None, metavar="N",
                        help="tokenizing processes (default: one per CPU, at most one per chunk)")
    parser.add_argument("--progress", choices=("auto", "off"), default="auto",
                        help="a bar on a terminal, a line per tenth otherwise (default), or nothing")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from polytrain.data.pretokenize import bar, tokenize_files
    from polytrain.errors import ConfigError

    if args.workers is not None and args.workers < 1:
        raise ConfigError(f"--workers must be >= 1, got {args.workers}")
    progress = bar("tokenize") if args.progress == "auto" else None
    meta = tokenize_files(args.inputs, args.tokenizer, args.output, field=args.field, split=args.split,
                          dtype=args.dtype, workers=args.workers, progress=progress)
    print(f"wrote {args.output}: {meta['tokens']:,} {meta['dtype']} tokens, {meta['documents']:,} documents, "
          f"vocabulary {meta['vocab_size']:,} (end-of-document id {meta['eos_id']})")
    return 0
