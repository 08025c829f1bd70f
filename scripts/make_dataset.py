#!/usr/bin/env python
"""Turn text into a Megatron indexed dataset (.bin/.idx) with an offline byte-level tokenizer.

    python scripts/make_dataset.py --output data/pydoc            # CPython's docs, no download
    python scripts/make_dataset.py --output data/mine --input a.txt b.txt

Then train with ``--data-path data/pydoc --tokenizer-type ByteTokenizer``.
Each input file (or each pydoc topic) is one document.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from megatron_seq1f1b.trainer.data import ByteTokenizer, pydoc_corpus, write_indexed


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="output prefix (writes .bin and .idx)")
    parser.add_argument("--input", nargs="*", help="text files (default: CPython's pydoc topics)")
    args = parser.parse_args(argv)
    if args.input:
        documents = [Path(path).read_text(encoding="utf-8", errors="replace") for path in args.input]
    else:
        documents = pydoc_corpus()
    prefix = write_indexed(documents, args.output, ByteTokenizer())
    tokens = sum(len(doc.encode("utf-8")) + 1 for doc in documents)
    print(f"wrote {prefix}.bin/.idx: {len(documents)} documents, {tokens} byte tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
