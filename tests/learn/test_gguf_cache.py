"""The engine's tokenizer metadata is parsed from the GGUF once and read back from the model cache unchanged."""

from __future__ import annotations

import json

import pytest

from node.learn.model_io import embedded_model_path
from node.learn.packaged import cache_dir, cached_json


def test_the_tokenizer_fields_come_back_from_the_cache_as_parsed(tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from node.learn.engines.gguf_export import template_fields

    monkeypatch.setenv("SAPO_MODEL_CACHE", str(tmp_path))
    parsed = template_fields(embedded_model_path())
    (cached,) = tmp_path.glob("gguf-tokenizer-*.json")
    assert template_fields(embedded_model_path()) == parsed  # values and GGUF types, read from the file
    keys = {k for k, _, _ in parsed}
    assert {"tokenizer.ggml.tokens", "tokenizer.ggml.merges"} <= keys and len(parsed[0][2]) >= 1
    cached.write_text("[1, 2")  # broken: parsed again and rewritten
    assert template_fields(embedded_model_path()) == parsed and json.loads(cached.read_text())


def test_cached_json_recomputes_what_is_missing_or_invalid(tmp_path, monkeypatch):
    monkeypatch.setenv("SAPO_MODEL_CACHE", str(tmp_path))
    calls = []

    def compute():
        calls.append(1)
        return {"n": len(calls)}

    assert cached_json("x.json", compute, lambda v: isinstance(v, dict)) == {"n": 1}
    assert cached_json("x.json", compute, lambda v: isinstance(v, dict)) == {"n": 1} and len(calls) == 1
    assert cached_json("x.json", compute, lambda v: v.get("n") == 2) == {"n": 2}  # not valid: computed again
    assert (cache_dir() / "x.json").exists() and not list(tmp_path.glob("*.tmp"))
