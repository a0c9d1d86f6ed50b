"""The tiny model as an OpenAI client meets it: every id it can generate decodes to text, and
the CLI says where the model is and what it accepts (``tiny_model`` NOTE 2-3).

A client once met a 644-token tokenizer for 2,048 logits: most generated ids decoded to
nothing, so answers came back empty.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def test_every_id_of_the_vocabulary_decodes_to_text(tiny_model: Path) -> None:
    from transformers import AutoTokenizer

    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    tok = AutoTokenizer.from_pretrained(str(tiny_model))
    assert vocab == 2048 and len(tok) == vocab
    special = set(tok.all_special_ids)
    assert special == {0, 1, 2, 3}
    empty = [i for i in range(vocab) if i not in special and tok.decode([i]) == ""]
    assert empty == []
    # The filler words are whole words: text that merely contains one keeps its BPE tokens
    # and every text round-trips.
    text = "Read the file, run the tests, kabo and report: kabolt."
    assert tok.decode(tok.encode(text)) == text


def test_the_cli_prints_the_folder_and_what_a_client_needs(
        tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from lmcache_histate.backends.demo.tiny_model import main

    assert main(["--cache-dir", str(tiny_model.parent)]) == 0
    out, err = capsys.readouterr()
    assert out == f"{tiny_model}\n"
    assert "vocabulary 2,048, tokenizer 2,048 tokens" in err
    assert "positions 8,192" in err and '--hf-overrides \'{"max_position_embeddings"' in err
    assert f"histate serve {tiny_model}" in err
