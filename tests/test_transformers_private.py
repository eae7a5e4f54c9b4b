"""The fence around transformers' private API (`transformers_private.py`): the supported range is checked loudly."""

import pytest
from transformers.generation.utils import GenerationMixin

from transformers_longspark import transformers_private
from transformers_longspark.transformers_private import ALLOW_UNTESTED_ENV, SUPPORTED_TRANSFORMERS, check_transformers


def test_the_installed_transformers_is_supported():
    check_transformers()


@pytest.mark.parametrize("version", ["5.10.0", "5.23.9", SUPPORTED_TRANSFORMERS[1], "6.2.0"])
def test_a_version_outside_the_range_is_refused_with_the_fix(version, monkeypatch):
    monkeypatch.delenv(ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(RuntimeError, match=rf"transformers {version}\b.*pip install 'transformers>="):
        check_transformers(version)
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    check_transformers(version)  # let through on request; the wrapped methods are still checked


def test_a_missing_wrapped_method_is_refused_even_when_allowed(monkeypatch):
    monkeypatch.setenv(ALLOW_UNTESTED_ENV, "1")
    monkeypatch.delattr(GenerationMixin, "_assisted_decoding")
    with pytest.raises(RuntimeError, match="_assisted_decoding"):
        check_transformers("7.0.0")


def test_only_the_wrapped_methods_can_be_patched():
    with pytest.raises(ValueError, match="generate"):
        transformers_private.patch_generation_methods({"generate": lambda *args: None})
