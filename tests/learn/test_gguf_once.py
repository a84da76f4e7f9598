"""One GGUF parse per conversion (node/learn/gguf_once.py): the same reader and name map within the block,
fresh ones outside it, never a shared writable map, and the gguf module as it was afterwards, also after an
error. That a conversion gives the same weights and tokenizer either way: `python -m scripts.bench.convert`."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from node.learn.gguf_once import parsed_once


def _tiny_gguf(path):
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.name", "tiny")
    writer.add_tensor("token_embd.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_one_reader_per_file_and_one_name_map_inside_the_block_only(tmp_path):
    first, second = _tiny_gguf(tmp_path / "a.gguf"), _tiny_gguf(tmp_path / "b.gguf")
    reader_class, name_map = gguf.GGUFReader, gguf.get_tensor_name_map
    arch = gguf.MODEL_ARCH.LLAMA
    with parsed_once():
        reader = gguf.GGUFReader(first)
        assert gguf.GGUFReader(str(tmp_path / "." / "a.gguf")) is reader  # the same file, however named
        assert gguf.GGUFReader(second) is not reader
        assert gguf.GGUFReader(first, "r+") is not reader  # a writable map is its own
        assert reader.get_tensor(0).data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        assert gguf.get_tensor_name_map(arch, 2) is gguf.get_tensor_name_map(arch, 2)
        assert gguf.get_tensor_name_map(arch, 2) is not gguf.get_tensor_name_map(arch, 3)
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)
    assert gguf.GGUFReader(first) is not gguf.GGUFReader(first)
    with pytest.raises(RuntimeError, match="mid-conversion"), parsed_once():
        raise RuntimeError("mid-conversion")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == (reader_class, name_map)


def test_transformers_reads_a_gguf_through_the_patch(tmp_path, monkeypatch):
    """transformers looks GGUFReader up in the gguf module at each call: two metadata loads (what its config
    and tokenizer passes do) construct one reader within the block. Were it to bind the name at import, this
    fails, where the conversion would still work and only lose its speed."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = _tiny_gguf(tmp_path / "a.gguf")
    made = []

    class Counting(gguf.GGUFReader):
        def __init__(self, *args, **kwargs):
            made.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", Counting)
    with parsed_once():
        first, second = load_gguf_checkpoint(str(path)), load_gguf_checkpoint(str(path))
    assert len(made) == 1 and first["config"] == second["config"] and first["config"]["model_type"] == "llama"
    load_gguf_checkpoint(str(path))
    assert len(made) == 2  # outside the block: a reader of its own
