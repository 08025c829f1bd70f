#!/usr/bin/env python
"""Turn text into a Megatron indexed dataset (.bin/.idx) with an offline byte-level tokenizer.

    python scripts/make_dataset.py --output data/pydoc            # CPython's docs, no download
    python scripts/make_dataset.py --output data/mine --input a.txt b.txt

Then train with ``--data-path data/pydoc --tokenizer-type ByteTokenizer``.
Each input file (or each pydoc topic) is one document. A file that cannot be read, or an
output that cannot be written, is one line on stderr and exit status 2.
"""

from __future__ import annotations

import warnings
from pathlib import Path

from megatron_seq1f1b.base.flags import ArgumentParser
from megatron_seq1f1b.trainer.data import ByteTokenizer, pydoc_corpus, write_indexed


def _import_megatron_quietly() -> None:
    """Megatron-Core warns on import that Transformer Engine, apex and absl are missing; its
    dataset writer needs none of them."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module=r"megatron\.core\.")
        import megatron.core.datasets.indexed_dataset  # noqa: F401


def main(argv=None) -> int:
    parser = ArgumentParser(prog="make_dataset.py", description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, help="output prefix (writes .bin and .idx)")
    parser.add_argument("--input", nargs="*", help="text files (default: CPython's pydoc topics)")
    args = parser.parse_args(argv)
    if args.input:
        documents = []
        for path in args.input:
            try:
                documents.append(Path(path).read_text(encoding="utf-8", errors="replace"))
            except OSError as exc:
                parser.error(f"--input {path}: {exc.strerror or exc}")
    else:
        documents = pydoc_corpus()
    _import_megatron_quietly()
    try:
        prefix = write_indexed(documents, args.output, ByteTokenizer())
    except OSError as exc:
        parser.error(f"--output {args.output}: {exc.strerror or exc} ({exc.filename})")
    tokens = sum(len(doc.encode("utf-8")) + 1 for doc in documents)
    print(f"wrote {prefix}.bin/.idx: {len(documents)} documents, {tokens} byte tokens")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
