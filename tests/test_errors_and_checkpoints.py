"""Bad input raises a clear ValueError before any token is generated; checkpoints are safetensors-only."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel

from helpers import make_drafter, make_target
from transformers_longspark import LongSparkConfig, LongSparkDrafterModel


def no_forward(module, *args):
    raise AssertionError("the target ran before the input was validated")


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("hidden_size", 48, "hidden_size"),
        ("vocab_size", 65, "vocab_size"),
        ("num_key_value_heads", 4, "num_key_value_heads"),
        ("head_dim", 16, "head_dim"),
        ("target_layer_ids", [0, 2, 3], "beyond"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 5.0}, "rope_parameters"),
    ],
)
def test_mismatched_drafter_is_refused(field, value, message):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    if field == "target_layer_ids":
        drafter.config.num_target_layers = 8  # a drafter built for a deeper target
        value = [0, 3, 7]
    setattr(drafter.config, field, value)
    handle = target.model.register_forward_pre_hook(no_forward)
    with pytest.raises(ValueError, match=message) as error:
        target.generate(torch.randint(0, 64, (1, 5)), max_new_tokens=4, assistant_model=drafter)
    assert "from_target_config" in str(error.value)
    handle.remove()


def test_unsupported_target_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    target = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=4)).eval()
    with pytest.raises(ValueError, match="does not support targets of type 'gpt2'"):
        LongSparkConfig.from_target_config(target.config)
    drafter = make_drafter(make_target("llama"))
    with pytest.raises(ValueError, match="gpt2"):
        target.generate(torch.randint(0, 64, (1, 5)), max_new_tokens=4, assistant_model=drafter)


def test_sliding_window_that_evicts_prompt_rows_is_refused():
    target = make_target("qwen3", use_sliding_window=True, sliding_window=16, max_window_layers=0)
    drafter = make_drafter(target)
    with pytest.raises(ValueError, match="sliding-window"):
        target.generate(torch.randint(0, 64, (1, 40)), max_new_tokens=4, assistant_model=drafter)


def test_sliding_window_without_layer_types_is_refused():
    """Mistral sets `sliding_window` for every layer and has no `layer_types`; the check must see it there too."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=16)  # fmt: skip
    target = MistralForCausalLM(config).eval()
    handle = target.model.register_forward_pre_hook(no_forward)
    with pytest.raises(ValueError, match="sliding-window cache of 16 rows"):
        target.generate(torch.randint(0, 64, (1, 40)), max_new_tokens=4, assistant_model=make_drafter(target))
    handle.remove()


def test_paper_layer_selection():
    from transformers_longspark import select_target_layers

    assert select_target_layers(36) == [0, 9, 18, 26, 35]
    assert select_target_layers(40) == [0, 10, 20, 29, 39]
    assert select_target_layers(30) == [0, 7, 15, 22, 29]


def test_from_target_config_copies_the_target_and_accepts_overrides():
    target = make_target("qwen3", rope_parameters={"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0})
    config = LongSparkConfig.from_target_config(target.config, window_size=8, num_summary_queries=4)
    assert (config.hidden_size, config.num_key_value_heads, config.head_dim, config.vocab_size) == (32, 2, 8, 64)
    assert config.rope_parameters["factor"] == 2.0 and config.rope_parameters["rope_type"] == "linear"
    assert (config.window_size, config.num_summary_queries, config.block_size) == (8, 4, 7)
    assert config.target_layer_ids == [0, 1, 2, 3]  # 5 requested, clamped to the 4 target layers


def test_save_load_round_trip_gives_identical_proposals(tmp_path):
    target = make_target("qwen3")
    drafter = make_drafter(target)
    with torch.no_grad():
        drafter.markov_proj.weight.normal_()
    drafter.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    target_names = {name for name, _ in target.named_parameters()}
    assert not any("embed_tokens" in k or "lm_head" in k or k in target_names for k in weights)
    assert sum(t.numel() for t in weights.values()) == sum(p.numel() for p in drafter.parameters())

    loaded = AutoModel.from_pretrained(tmp_path)
    assert isinstance(loaded, LongSparkDrafterModel)
    assert isinstance(AutoConfig.from_pretrained(tmp_path), LongSparkConfig)
    prompt = torch.randint(0, 64, (1, 12))
    options = dict(max_new_tokens=16, do_sample=True, temperature=1.0)
    torch.manual_seed(0)
    first = target.generate(prompt, assistant_model=drafter, **options)
    torch.manual_seed(0)
    second = target.generate(prompt, assistant_model=loaded, **options)
    assert torch.equal(first, second)


def test_confidence_threshold_is_saved_with_the_drafter(tmp_path):
    drafter = make_drafter(make_target("qwen3"))
    drafter.generation_config.assistant_confidence_threshold = 0.25
    drafter.save_pretrained(tmp_path)
    assert LongSparkDrafterModel.from_pretrained(tmp_path).generation_config.assistant_confidence_threshold == 0.25


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.save_pretrained(tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["block_positions.weight"]
    weights["lm_head.weight"] = torch.zeros(3)
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    expected = r"missing keys: \['block_positions.weight'\].*unexpected keys: \['lm_head.weight'\]"
    with pytest.raises(ValueError, match=expected):
        LongSparkDrafterModel.from_pretrained(tmp_path)


def test_pickled_checkpoints_are_refused(tmp_path):
    drafter = make_drafter(make_target("llama"))
    drafter.config.save_pretrained(tmp_path)
    torch.save(drafter.state_dict(), tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="never unpickles"):
        LongSparkDrafterModel.from_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "longspark"


@pytest.mark.parametrize("fields, message", [({"block_size": 0}, "block_size"),
                                             ({"target_layer_ids": [0, 40]}, "beyond"),
                                             ({"num_attention_heads": 5}, "multiple")])  # fmt: skip
def test_invalid_config_is_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        LongSparkConfig(**fields)
