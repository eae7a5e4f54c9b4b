"""The parts of LongSpark inside vLLM (`transformers_longspark.vllm`) that need no engine: the paged KV cache read
back from vLLM's CPU kernel layouts (in block-table order; unknown layouts refused by name), the fix of vLLM's CPU
`expand_batch_to_tokens`, and the proposer's errors that name the fix.

These run everywhere, except the check against vLLM's own cache writer: vLLM runs in its own environment
(`scripts/install_vllm.sh` makes `.venv-vllm/`; `LONGSPARK_VLLM_PYTHON` points at another interpreter), and that test
is skipped with the reason without it. The end-to-end tests are in `test_vllm.py`.
"""

from __future__ import annotations

import inspect
import subprocess
from types import SimpleNamespace

import pytest
import torch

from helpers import VLLM_PYTHON, pack_blocks, requires_vllm
from transformers_longspark.vllm import DRAFTER_ENV, LongSparkProposer, PagedRequestRows, unpack_blocks
from transformers_longspark.vllm.cpu_sampling import expand_batch_to_tokens


@pytest.mark.parametrize("layout", ["vec", "amx"])
def test_unpack_blocks_inverts_the_kernel_layouts(layout):
    torch.manual_seed(0)
    keys, values = torch.randn(2, 64, 32), torch.randn(2, 64, 32)
    blocks = pack_blocks(keys, values, layout, block_size=32)
    unpacked_keys, unpacked_values = unpack_blocks(blocks, layout)
    assert torch.equal(unpacked_keys, keys) and torch.equal(unpacked_values, values)


def test_paged_rows_follow_the_block_table():
    torch.manual_seed(0)
    keys, values = torch.randn(2, 96, 32), torch.randn(2, 96, 32)  # three blocks of 32 rows, in token order
    blocks = pack_blocks(keys, values, "vec", block_size=32)
    cache = torch.zeros(5, 2, 32, 64)
    cache[[3, 0, 4]] = blocks  # physical blocks 3, 0, 4 hold the request's blocks 0, 1, 2
    rows = PagedRequestRows({7: (cache, "vec")}, [3, 0, 4], num_rows=90, dtype=torch.float32)
    for n in (90, 40, 1):
        window_keys, window_values = rows.last_rows(7, n)
        assert torch.equal(window_keys[0], keys[:, 90 - n : 90])
        assert torch.equal(window_values[0], values[:, 90 - n : 90])
    assert rows.last_rows(7, 0)[0].shape == (1, 2, 0, 32)


def test_unknown_layouts_are_refused_by_name():
    with pytest.raises(ValueError, match="'neon' layout"):
        unpack_blocks(torch.zeros(1, 1, 32, 64), "neon")


def test_cpu_expand_fix_repeats_each_requests_value_over_its_positions():
    """`fix_cpu_expand`'s replacement of vLLM's `expand_batch_to_tokens` (whose CPU fallback returns uninitialized
    memory): request `i` owns positions `[cu[i - 1], cu[i])`, a request may own none, `replace_from` -> `replace_to`."""
    cu = torch.tensor([2, 2, 5, 6], dtype=torch.int32)
    temperatures = expand_batch_to_tokens(torch.tensor([0.7, 1.3, 0.0, 2.0]), cu, 6, replace_from=0, replace_to=1)
    assert temperatures.dtype == torch.float32 and temperatures.tolist() == pytest.approx([0.7, 0.7, 1, 1, 1, 2])
    top_k = expand_batch_to_tokens(torch.tensor([5, 0, 7, 9], dtype=torch.int32), cu, 6)
    assert top_k.dtype == torch.int32 and top_k.tolist() == [5, 5, 7, 7, 7, 9]


def fake_vllm_config(hf_config, num_speculative_tokens: int):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, dtype=torch.float32, model="target"),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
    )


def test_proposer_errors_name_the_fix(tmp_path, monkeypatch):
    from helpers import make_drafter, make_target

    target = make_target("llama")
    make_drafter(target).save_pretrained(tmp_path)
    monkeypatch.delenv(DRAFTER_ENV, raising=False)
    with pytest.raises(ValueError, match=f"set {DRAFTER_ENV}="):
        LongSparkProposer(fake_vllm_config(target.config, 4))
    monkeypatch.setenv(DRAFTER_ENV, str(tmp_path))
    with pytest.raises(ValueError, match="num_speculative_tokens=9"):
        LongSparkProposer(fake_vllm_config(target.config, 9))
    other = make_target("llama", vocab_size=80)
    with pytest.raises(ValueError, match="vocab_size"):
        LongSparkProposer(fake_vllm_config(other.config, 4))


@requires_vllm
def test_paged_rows_match_vllm_cache_writer():
    """vLLM's own kernel writes known rows (fp32 `vec`, bf16 `amx` and `vec`, and `vec16`: what vLLM picks for block
    sizes that are not a multiple of 32 or head sizes that are a multiple of 16 but not 32, in fp32, bf16 and fp16);
    the reader returns them exactly, across three blocks and from within a block."""
    script = inspect.cleandoc("""
        import torch, vllm._custom_ops as ops
        from transformers_longspark.vllm import PagedRequestRows
        cases = [(torch.float32, "vec", 128, 64), (torch.bfloat16, "amx", 128, 64), (torch.bfloat16, "vec", 128, 64),
                 (torch.float32, "vec16", 16, 64), (torch.bfloat16, "vec16", 16, 64), (torch.float32, "vec16", 128, 48),
                 (torch.float16, "vec16", 32, 48), (torch.bfloat16, "vec16", 128, 80)]
        unsupported = []
        for dtype, layout, block, head in cases:
            total = 3 * block - 7  # the last block partly filled
            cache = torch.zeros(6, 3, block, 2 * head, dtype=dtype)
            key_cache, value_cache = cache.view(6, 3, 2 * block, head).chunk(2, dim=2)
            keys, values = torch.randn(total, 3, head, dtype=dtype), torch.randn(total, 3, head, dtype=dtype)
            blocks = torch.tensor([4, 1, 3])
            slots = blocks[torch.arange(total) // block] * block + torch.arange(total) % block
            try:
                ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, layout)
            except RuntimeError as error:  # e.g. no AVX-512 here: "Unsupported CPU attention configuration"
                if "Unsupported CPU attention configuration" not in str(error):
                    raise
                unsupported.append((str(dtype), layout, block, head))
                continue
            rows = PagedRequestRows({0: (cache, layout)}, blocks, total, dtype)
            for n in (total, 2 * block, block - 3, 1):
                k, v = rows.last_rows(0, n)
                assert torch.equal(k[0], keys[total - n:].transpose(0, 1)), (layout, block, head, n)
                assert torch.equal(v[0], values[total - n:].transpose(0, 1)), (layout, block, head, n)
        print(len(unsupported), len(cases), unsupported)
        print("ok")
    """)
    done = subprocess.run([str(VLLM_PYTHON), "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
    num_unsupported, num_cases, unsupported = done.stdout.strip().splitlines()[-2].split(" ", 2)
    if num_unsupported == num_cases:
        pytest.skip(f"vLLM's CPU cache writer supports none of the layouts on this CPU: {unsupported}")
