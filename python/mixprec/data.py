"""mixprec.data: the training data of `mixprec train` for Python loops: the embedded corpus (a
seeded English-like grammar, no download) or a text, tokenised and split as the C++ engine does
(docs/data.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np

from . import _args, _core


@dataclass(frozen=True)
class Dataset:
    train: np.ndarray        # uint32 token ids of the training split
    validation: np.ndarray   # uint32 token ids of the held-out split (the last fraction)
    vocab: List[str]         # id -> token text (id 0 is "<unk>")
    source: str              # where the text came from, e.g. "default corpus (seed 1, 2000000 tokens)"

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)


def corpus(*, tokens: int = 2_000_000, seed: int = 1, vocab: str = "word:1024",
           validation_fraction: float = 0.1, context: int = 64) -> Dataset:
    """The embedded default corpus of `mixprec train` (the same text, vocabulary and split for
    the same arguments). ValueError with the core's message for a bad argument."""
    return _dataset(None, seed, tokens, vocab, validation_fraction, context)


def from_text(text: str, *, vocab: str = "word:1024", validation_fraction: float = 0.1,
              context: int = 64) -> Dataset:
    """A text tokenised as `mixprec train --data FILE` does; RuntimeError for text too short."""
    if not isinstance(text, str):
        raise TypeError(f"text: expected a str, found {type(text).__name__}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"text: not valid UTF-8 text (a lone surrogate at offset {e.start})") from None
    return _dataset(text, 1, 1, vocab, validation_fraction, context)


def _dataset(text: Optional[str], seed: int, tokens: int, vocab: str, validation_fraction: float,
             context: int) -> Dataset:
    tokens, seed, context = (_args.uint64(what, v) for what, v in (("tokens", tokens), ("seed", seed),
                                                                     ("context", context)))
    if not isinstance(vocab, str):
        raise TypeError(f"vocab: expected a str such as 'word:1024' or 'char', found {type(vocab).__name__}")
    validation_fraction = _args.real("validation_fraction", validation_fraction)
    train, val, words, source = _core.dataset(text, seed, tokens, vocab, validation_fraction, context)
    return Dataset(train, val, list(words), source)


def batch(tokens: np.ndarray, batch_size: int, context: int, rng: np.random.Generator):
    """Random windows of `tokens`: inputs (batch_size, context) and targets shifted by one, int64."""
    if tokens.size < context + 1:
        raise ValueError(f"tokens: expected at least context + 1 = {context + 1} tokens, found {tokens.size}")
    starts = rng.integers(0, tokens.size - context, batch_size)
    idx = starts[:, None] + np.arange(context + 1)[None, :]
    windows = tokens[idx].astype(np.int64)
    return windows[:, :-1], windows[:, 1:]
