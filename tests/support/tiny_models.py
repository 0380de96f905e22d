"""What tests that load tiny models share: the weight scale that makes bugs visible, and quiet transformers."""

from __future__ import annotations

import logging

import pytest

INIT_STD = 0.1
"""With HF's default std of 0.02 attention is nearly uniform and some bugs move logits by little; 0.1 makes logits
O(1), so a wrong mask, rope or norm changes them by far more than a parity tolerance, and greedy choices are not
near-ties."""


@pytest.fixture(autouse=True, scope="session")
def quiet_transformers() -> None:
    """transformers' warnings and progress bars off, for the directories whose conftest imports this fixture
    (importing transformers costs seconds, so the other tests do not pay it)."""
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)
