"""Fixtures shared by the emulated engine's tests."""

from __future__ import annotations

import pytest

from tokenizer_fixture import write_test_tokenizer
from warmroute.engine.tokenizer import PromptTokenizer


@pytest.fixture(scope="session")
def test_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> PromptTokenizer:
    """A real byte-level BPE tokenizer with a ChatML template, trained once per test session."""
    return PromptTokenizer(write_test_tokenizer(tmp_path_factory.mktemp("tokenizer")))
