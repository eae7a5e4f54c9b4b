"""A config value of the wrong type is refused when the config is read, naming the field (before any model loads)."""

import pytest

from transformers_longspark.training.run import TrainingConfig


def write(tmp_path, text: str):
    path = tmp_path / "run.yaml"
    path.write_text("output_dir: runs/x\ntrain_data: data.jsonl\n" + text)
    return path


@pytest.mark.parametrize(
    ("line", "field"),
    [
        ("max_steps: lots", "max_steps"),
        ("learning_rate: fast", "learning_rate"),
        ("init_from_target: 3", "init_from_target"),
        ("seed: 1.5", "seed"),
        ("target: 7", "target"),
    ],
)
def test_a_wrong_typed_value_is_refused_naming_its_field(tmp_path, line, field):
    with pytest.raises(ValueError, match=rf"{field} must be"):
        TrainingConfig.from_file(write(tmp_path, line + "\n"))


def test_values_of_the_right_types_are_read(tmp_path):
    config = TrainingConfig.from_file(write(tmp_path, "learning_rate: 1\nnum_threads: null\nmax_steps: 5\n"))
    assert (config.learning_rate, config.num_threads, config.max_steps) == (1, None, 5)
