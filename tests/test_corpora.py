"""Plain-text corpora: sources, packing, the weighted mixture, training on text, grown draft vocabularies."""

import json
import os
from pathlib import Path

import pytest
import torch

from helpers import make_drafter, make_target, tiny_config, write_records
from transformers_longspark.benchmarks.prompts import long_context_prompts, short_prompts
from transformers_longspark.training.corpora import (
    DataMixture,
    DataSource,
    data_sources,
    is_held_out,
    load_source,
    pack_documents,
)
from transformers_longspark.training.data import Sequence
from transformers_longspark.training.distillation import sample_anchors
from transformers_longspark.training.run import Trainer, TrainingConfig, build_drafter

EOS = 0


class CharTokenizer:
    """Token id = 1 + byte % 63 (ids 1..63 of the 64-token test targets; 0 is EOS); chats are rendered plainly."""

    eos_token_id = EOS

    def __call__(self, texts, add_special_tokens=False, verbose=False):
        assert not add_special_tokens
        return {"input_ids": [[1 + b % 63 for b in text.encode()] for text in texts]}

    def apply_chat_template(self, messages, tokenize=False):
        return "".join(f"<{m['role']}>{m['content']}" for m in messages)


def write_text(path: Path, records) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "part-00000.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def test_packing_keeps_every_token_in_order_with_separators():
    documents = [[1, 2, 3], [4] * 7, [5, 6], [7] * 9]
    sequences = pack_documents(documents, max_seq_len=8, separator=EOS)
    stream = [t for d in documents for t in [*d, EOS]]  # 25 tokens: three full sequences and 1 left over (< 4)
    assert [len(s.ids) for s in sequences] == [8, 8, 8]
    assert torch.cat([s.ids for s in sequences]).tolist() == stream[:24]
    assert all(s.anchor_start == 1 and s.prompt_length == 4 for s in sequences)
    tail = pack_documents([[1] * 12], max_seq_len=8, separator=EOS)  # 13 tokens: the 5-token tail is kept
    assert [len(s.ids) for s in tail] == [8, 5]


def test_anchors_of_packed_text_cover_every_position_with_a_predecessor():
    sequence = pack_documents([list(range(1, 20))], max_seq_len=20, separator=EOS)[0]
    anchors = sample_anchors(sequence, 100, torch.Generator().manual_seed(0))
    assert anchors.tolist() == list(range(1, 19))  # t in [1, T - 2]
    with pytest.raises(ValueError, match="anchor_start >= 1"):
        Sequence(torch.arange(5), prompt_length=0)


def test_sources_from_config_values(tmp_path):
    assert data_sources("data/a") == [DataSource("data/a")]
    parsed = data_sources(["data/a", {"path": "data/b", "weight": 3, "max_tokens": 10}])
    assert parsed[1] == DataSource("data/b", weight=3, max_tokens=10)
    with pytest.raises(ValueError, match="did you mean 'weight'"):
        data_sources([{"path": "x", "wieght": 2}])
    with pytest.raises(ValueError, match="weight must be > 0"):
        DataSource("x", weight=0)
    with pytest.raises(ValueError, match="format 'csv'"):
        DataSource("x", format="csv")


def test_formats_are_recognised(tmp_path):
    regenerated = write_records(tmp_path / "regenerated")
    text = write_text(tmp_path / "text", [{"id": "a", "text": "hello world"}])
    chats = write_text(tmp_path / "chats", [{"messages": [{"role": "user", "content": "hi"}]}])
    files = tmp_path / "files"
    files.mkdir()
    (files / "a.py").write_text("x = 1\n")
    odd = write_text(tmp_path / "odd", [{"body": "no text field"}])
    assert DataSource(str(regenerated)).resolved_format() == "regenerated"
    assert DataSource(str(text)).resolved_format() == DataSource(str(chats)).resolved_format() == "text"
    assert DataSource(str(files)).resolved_format() == "files"
    with pytest.raises(ValueError, match="cannot tell the format"):
        DataSource(str(odd)).resolved_format()
    with pytest.raises(FileNotFoundError, match=r"does not exist|not found|No such"):
        DataSource(str(tmp_path / "missing")).resolved_format()


def test_text_chats_and_files_are_tokenized_and_packed(tmp_path):
    tokenizer = CharTokenizer()
    text = write_text(tmp_path / "text", [{"id": "a", "text": "abcdef"}, {"id": "b", "text": "ghij"}])
    [sequence] = load_source(DataSource(str(text)), tokenizer, max_seq_len=16)  # a 12-token tail: kept
    assert sequence.ids.tolist() == [1 + b % 63 for b in b"abcdef"] + [EOS] + [1 + b % 63 for b in b"ghij"] + [EOS]

    chats = write_text(tmp_path / "chats", [{"messages": [{"role": "user", "content": "q"},
                                                          {"role": "assistant", "content": "a"}]}])  # fmt: skip
    [chat] = load_source(DataSource(str(chats)), tokenizer, max_seq_len=32)
    assert chat.ids.tolist() == tokenizer(["<user>q<assistant>a"])["input_ids"][0] + [EOS]

    files = tmp_path / "files"
    (files / "pkg").mkdir(parents=True)
    (files / "pkg" / "b.py").write_text("bb\n")
    (files / "a.py").write_text("aa\n")
    (files / "data.bin").write_bytes(b"\x00\x01\xff")  # binary: skipped
    (files / "notes.txt").write_text("skipped by the glob")
    [code] = load_source(DataSource(str(files), glob="**/*.py"), tokenizer, max_seq_len=12)
    assert code.ids.tolist() == [1 + b % 63 for b in b"aa\n"] + [EOS] + [1 + b % 63 for b in b"bb\n"] + [EOS]

    [limited] = load_source(DataSource(str(text), max_tokens=3), tokenizer, max_seq_len=7)
    assert len(limited.ids) == 7  # stops after the first document (6 tokens + EOS)
    with pytest.raises(ValueError, match="fewer than 32 tokens"):
        load_source(DataSource(str(text)), tokenizer, max_seq_len=64)
    with pytest.raises(ValueError, match="needs the target's tokenizer"):
        load_source(DataSource(str(text)), None, 64)


def test_mixture_is_deterministic_weighted_and_split_across_processes(tmp_path):
    tokenizer = CharTokenizer()
    a = write_text(tmp_path / "a", [{"text": "a" * 39} for _ in range(20)])  # 20 sequences of "a"
    b = write_text(tmp_path / "b", [{"text": "b" * 39} for _ in range(20)])
    mixture = DataMixture([DataSource(str(a), weight=3), DataSource(str(b), weight=1)], tokenizer, max_seq_len=40)
    assert len(mixture) == 40

    def draws(n, seed=0, process=0, processes=1):
        stream = mixture.micro_batches(1, seed, process, processes)
        return [chr(int(next(stream)[0].ids[0]) - 1 + 63) for _ in range(n)]

    first = draws(400)
    assert first == draws(400)
    assert 0.68 < first.count("a") / 400 < 0.82
    assert draws(50, seed=1) != first[:50]
    # Two processes draw the same source each micro-batch (same chooser) but disjoint sequences of it.
    stream0, stream1 = mixture.micro_batches(1, 0, 0, 2), mixture.micro_batches(1, 0, 1, 2)
    for _ in range(8):
        s0, s1 = next(stream0)[0], next(stream1)[0]
        assert s0.ids[0] == s1.ids[0] and s0 is not s1


def test_training_on_text_sources_runs_logs_throughput_and_measures_tau_on_text(tmp_path):
    target = make_target("llama")
    text = write_text(tmp_path / "text", [{"text": "def f(x):\n    return x + 1\n" * 3} for _ in range(6)])
    config = tiny_config(tmp_path, max_steps=2, tau_prompts=1, eval_every=2, tau_new_tokens=4,
                         train_data=[str(write_records(tmp_path / "chat")), {"path": str(text), "weight": 2}],
                         eval_data=[{"path": str(text)}])  # fmt: skip
    trainer = Trainer(config, target=target, tokenizer=CharTokenizer())
    assert len(trainer.train_data.sequences) == 2 and trainer.eval_sequences[0].anchor_start == 1
    trainer.train()
    log = [json.loads(line) for line in (tmp_path / "run" / "log.jsonl").read_text().splitlines()]
    assert all(r["target_tokens_per_s"] > 0 for r in log) and "eval_tau" in log[-1]


def test_a_draft_vocabulary_grows_keeping_its_markov_rows(tmp_path):
    target = make_target("llama")
    small = make_drafter(target, markov_rank=8).with_draft_vocab(torch.arange(10, 20))
    grown = small.with_draft_vocab(torch.tensor([15, 3, 11, 40]))
    torch.testing.assert_close(grown.markov_proj.weight[[0, 2]], small.markov_proj.weight[[5, 1]])
    assert grown.markov_proj.weight[[1, 3]].abs().sum() == 0  # tokens the small drafter could not propose

    small.save_pretrained(tmp_path / "small")
    base = tiny_config(tmp_path)
    config = TrainingConfig(**{**base.__dict__, "init_drafter": str(tmp_path / "small"),
                               "drafter": {"draft_vocab_size": 16}})  # fmt: skip
    sequences = [Sequence(torch.tensor([50, 50, 51, 5]), 1)]
    drafter = build_drafter(config, target, sequences)
    vocab = set(drafter.draft_vocab.tolist())
    assert set(range(10, 20)) <= vocab and {50, 51} <= vocab and len(vocab) == 16
    config.drafter = {"draft_vocab_size": 8}
    with pytest.raises(ValueError, match="can only grow"):
        build_drafter(config, target, sequences)


class PrefixTokenizer:
    def __call__(self, text, add_special_tokens=False, verbose=False):
        return {"input_ids": list(range(len(text) // 3))}


def test_long_benchmark_prompts_are_held_out_of_the_corpora():
    prompts = long_context_prompts(PrefixTokenizer(), lengths=[4096, 8192], num_prompts=4)
    names = [p["name"].split(".py")[0] + ".py" for p in prompts]
    assert len(set(names)) == 4
    assert all(is_held_out(f"python/stdlib/{name}", 15.0) for name in names)
    assert all(os.path.exists(os.path.join(os.path.dirname(os.__file__), name)) for name in names)


def test_curve_prompts_cut_the_same_files_at_every_length():
    prompts = long_context_prompts(PrefixTokenizer(), lengths=[1024, 256, 4096], num_prompts=2, every_length=True)
    assert [p["length"] for p in prompts] == [256, 1024, 4096] * 2
    for file in (prompts[:3], prompts[3:]):
        assert len({p["name"].split(".py")[0] for p in file}) == 1
        assert all(len(p["input_ids"]) == p["length"] for p in file)
        assert all(p["input_ids"] == file[-1]["input_ids"][: p["length"]] for p in file)  # prefixes of one text
    assert prompts[0]["name"] != prompts[3]["name"]


class ChatTemplateTokenizer:
    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, enable_thinking=False):
        return "".join(m["content"] for m in messages)

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [1 + b % 63 for b in text.encode()]}


def test_short_prompts_of_chosen_sources_only(tmp_path):
    sources = ["gsm8k", "mmath-en", "stdlib-code"]
    chat = [{"role": "user", "content": "q"}]
    records = [{"id": i, "source": sources[i % 3], "messages": chat} for i in range(9)]
    write_text(tmp_path, records)
    mixed = short_prompts(ChatTemplateTokenizer(), 6, tmp_path)
    assert [p["source"] for p in mixed] == sources * 2  # interleaved by source
    code = short_prompts(ChatTemplateTokenizer(), 6, tmp_path, sources=["stdlib-code"])
    assert [p["name"] for p in code] == ["stdlib-code-2", "stdlib-code-5", "stdlib-code-8"]
    write_text(tmp_path, records[:2])
    with pytest.raises(ValueError, match="No held-out short prompts of the sources stdlib-code"):
        short_prompts(ChatTemplateTokenizer(), 6, tmp_path, sources=["stdlib-code"])
