"""Reading a GGUF once per conversion instead of three times.

transformers builds a model from a GGUF in three passes (the config, the tokenizer, the weights), and each pass
parses the whole file's metadata again with `gguf.GGUFReader`: for SmolLM2's 49k-token vocabulary about 8 s of
CPU each. Its tensor-name map (`gguf.get_tensor_name_map`) is rebuilt for every module of the model (about 400
times, 28 ms each). Both are pure functions of their arguments and transformers only reads what they return,
so while `parsed_once()` is active the gguf module hands out one reader per file and one map per architecture.
transformers looks both names up in the gguf module at call time; were it ever to bind them elsewhere, the
context would simply save nothing (the result is the same either way: tests/learn/test_model_families.py).
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_lock = threading.Lock()  # one conversion patches the module at a time; a second waits for the first


@contextmanager
def parsed_once() -> Iterator[None]:
    """Within the block, `gguf.GGUFReader(path)` returns one read-only (memory-mapped) reader per path and
    `gguf.get_tensor_name_map` one map per (architecture, blocks); both are put back afterwards."""
    import gguf

    with _lock:
        reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
        readers: dict[str, Any] = {}

        def one_reader(path: str | Path, mode: str = "r") -> Any:
            if mode != "r":  # a writable map is never shared
                return reader_class(path, mode)
            key = str(Path(path).resolve())
            if key not in readers:
                readers[key] = reader_class(path, mode)
            return readers[key]

        gguf.GGUFReader, gguf.get_tensor_name_map = one_reader, functools.lru_cache(maxsize=None)(name_map)
        try:
            yield
        finally:
            gguf.GGUFReader, gguf.get_tensor_name_map = reader_class, name_map
