"""Package data: ``corpus.txt``, the original English text the demo tokenizer is trained on."""
from __future__ import annotations

from pathlib import Path

CORPUS_PATH = Path(__file__).with_name("corpus.txt")


def corpus_text() -> str:
    return CORPUS_PATH.read_text(encoding="utf-8")
