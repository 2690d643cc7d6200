"""The training rows' data: tests/train's `tokens` fixture (mega-tokenize over real text with the
tiny SentencePiece model of the root conftest: ids below 400), not a second copy of it."""

from train.conftest import tokens  # noqa: F401
