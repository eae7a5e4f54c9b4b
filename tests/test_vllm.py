"""LongSpark inside vLLM (`transformers_longspark.vllm`): exact outputs, and the same drafts as the transformers path.

vLLM runs in its own environment (`scripts/install_vllm.sh` makes `.venv-vllm/`; `LONGSPARK_VLLM_PYTHON` points at
another interpreter), driven through `python -m transformers_longspark.vllm.run`; the transformers reference runs
here. Without that environment the end-to-end tests are skipped with the reason; the layout unpacking and the
proposer's errors are tested everywhere.
"""

from __future__ import annotations

import inspect
import json
import os
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from transformers_longspark.vllm import DRAFTER_ENV, LongSparkProposer, PagedRequestRows, unpack_blocks

REPO = Path(__file__).resolve().parents[1]
VLLM_PYTHON = Path(os.environ.get("LONGSPARK_VLLM_PYTHON", REPO / ".venv-vllm" / "bin" / "python"))
requires_vllm = pytest.mark.skipif(
    not VLLM_PYTHON.exists(),
    reason=f"vLLM is not installed: {VLLM_PYTHON} does not exist (`bash scripts/install_vllm.sh` makes it, or set "
    "LONGSPARK_VLLM_PYTHON)",
)
MAX_TOKENS = 40


def pack_blocks(keys: torch.Tensor, values: torch.Tensor, layout: str, block_size: int) -> torch.Tensor:
    """Reference writer (the formulas of vLLM's CPU kernels): `(h, n * block_size, d)` K/V -> raw blocks."""
    heads, rows, head_dim = keys.shape
    n = rows // block_size
    blocks = torch.empty(n, heads, block_size, 2 * head_dim, dtype=keys.dtype)
    flat = blocks.view(n, heads, 2, block_size * head_dim)
    for b in range(n):
        for h in range(heads):
            k, v = keys[h, b * block_size : (b + 1) * block_size], values[h, b * block_size : (b + 1) * block_size]
            for t in range(block_size):
                for d in range(head_dim):
                    if layout == "amx":
                        k_at = (t // 16) * 16 * head_dim + (d // 2) * 32 + (t % 16) * 2 + d % 2
                        v_at = (d // 16) * block_size * 16 + (t // 2) * 32 + (d % 16) * 2 + t % 2
                    else:
                        k_at, v_at = d * block_size + t, t * head_dim + d
                    flat[b, h, 0, k_at], flat[b, h, 1, v_at] = k[t, d], v[t, d]
    return blocks


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


def fake_vllm_config(hf_config, num_speculative_tokens: int):
    return SimpleNamespace(
        model_config=SimpleNamespace(hf_config=hf_config, dtype=torch.float32, model="target"),
        speculative_config=SimpleNamespace(num_speculative_tokens=num_speculative_tokens),
    )


def test_proposer_errors_name_the_fix(tmp_path, monkeypatch):
    from conftest import make_drafter, make_target

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
    """vLLM's own kernel writes known rows (fp32 `vec`, bf16 `amx` and `vec`); the reader returns them exactly."""
    script = inspect.cleandoc("""
        import torch, vllm._custom_ops as ops
        from transformers_longspark.vllm import PagedRequestRows
        for dtype, layout in [(torch.float32, "vec"), (torch.bfloat16, "amx"), (torch.bfloat16, "vec")]:
            cache = torch.zeros(6, 3, 128, 128, dtype=dtype)
            key_cache, value_cache = cache.view(6, 3, 256, 64).chunk(2, dim=2)
            keys, values = torch.randn(300, 3, 64, dtype=dtype), torch.randn(300, 3, 64, dtype=dtype)
            blocks = torch.tensor([4, 1, 3])
            slots = blocks[torch.arange(300) // 128] * 128 + torch.arange(300) % 128
            ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, layout)
            rows = PagedRequestRows({0: (cache, layout)}, blocks, 300, dtype)
            for n in (300, 256, 1):
                k, v = rows.last_rows(0, n)
                assert torch.equal(k[0], keys[300 - n:].transpose(0, 1)), (layout, n)
                assert torch.equal(v[0], values[300 - n:].transpose(0, 1)), (layout, n)
        print("ok")
    """)
    done = subprocess.run([str(VLLM_PYTHON), "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]


def prompt_ids(tokenizer) -> list[list[int]]:
    """Requests of different lengths: two chats, and two stdlib files cut to 250 and 1,010 tokens (several cache
    blocks, a full recent window, chunked prefill; both grow into a new 128-row block while decoding)."""
    import fractions
    import json as json_module

    chats = ["What is 17 * 23? Answer briefly.", "Write a Python function that reverses a linked list."]
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True, return_dict=True)["input_ids"] for q in chats]  # fmt: skip
    for module, length in ((json_module.decoder, 250), (fractions, 1010)):
        prompts.append(tokenizer(inspect.getsource(module), add_special_tokens=False)["input_ids"][:length])
    return prompts


def preemption_prompt_ids(tokenizer) -> list[list[int]]:
    """Four 230-token code prompts: two 128-row blocks each at admission, a third once ~20 tokens are generated."""
    import argparse
    import fractions
    import json as json_module
    import textwrap

    modules = (json_module.decoder, fractions, argparse, textwrap)
    return [tokenizer(inspect.getsource(m), add_special_tokens=False)["input_ids"][:230] for m in modules]


def run_vllm(tmp: Path, name: str, **options) -> dict:
    out = tmp / f"{name}.json"
    command = [str(VLLM_PYTHON), "-m", "transformers_longspark.vllm.run", "--out", str(out)]
    for key, value in options.items():
        command += [f"--{key.replace('_', '-')}", *(str(v) for v in (value if isinstance(value, list) else [value]))]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert done.returncode == 0, f"{name} failed:\n{done.stderr[-5000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The same requests through plain vLLM and vLLM + LongSpark: fp32 and bf16, one request at a time and all at
    once, with chunked prefill; and four requests that crowd a KV cache too small for them (preemption)."""
    pytest.importorskip("gguf")
    if not VLLM_PYTHON.exists():
        pytest.skip(requires_vllm.kwargs["reason"])
    from transformers_longspark.loading import SHIPPED_DRAFTER_DIR, load_smollm2, smollm2_dir

    target, tokenizer = load_smollm2()  # also writes the plain safetensors folder vLLM loads
    tmp = tmp_path_factory.mktemp("vllm")
    prompts, crowded = prompt_ids(tokenizer), preemption_prompt_ids(tokenizer)
    (tmp / "prompts.json").write_text(json.dumps(prompts))
    (tmp / "crowded.json").write_text(json.dumps(crowded))
    common = dict(target=smollm2_dir(), prompts=tmp / "prompts.json", max_tokens=MAX_TOKENS)
    longspark = dict(method="longspark", drafter=SHIPPED_DRAFTER_DIR)
    both = ["single", "concurrent"]
    # 128-row blocks of 30 layers x 2 x 3 heads x 64 fp32 values; vLLM keeps one block aside. The four crowded
    # requests take the other 8 at admission (two each); each needs a third while decoding, so vLLM preempts some.
    small_cache = 9 * 128 * 30 * 2 * 3 * 64 * 4
    crowded_options = dict(common, prompts=tmp / "crowded.json")
    return {
        "prompts": prompts, "target": target, "tokenizer": tokenizer,
        "plain": run_vllm(tmp, "plain", method="plain", rounds=both, max_num_batched_tokens=512, **common),
        "longspark": run_vllm(tmp, "longspark", rounds=both, max_num_batched_tokens=512, **longspark, **common),
        "plain_bf16": run_vllm(tmp, "plain_bf16", method="plain", dtype="bfloat16", logprobs=5, **common),
        "longspark_bf16": run_vllm(tmp, "longspark_bf16", dtype="bfloat16", **longspark, **common),
        "crowded_plain": run_vllm(tmp, "crowded_plain", method="plain", **crowded_options),
        "crowded": run_vllm(tmp, "crowded", kv_cache_bytes=small_cache, max_model_len=512, **longspark,
                            **crowded_options),
    }  # fmt: skip


@requires_vllm
@pytest.mark.parametrize("rounds", ["single", "concurrent"])
def test_vllm_longspark_greedy_equals_plain_vllm(served, rounds):
    plain, speculative = served["plain"]["rounds"][rounds], served["longspark"]["rounds"][rounds]
    assert speculative["token_ids"] == plain["token_ids"]
    assert speculative["accepted_tokens"] > 0  # the drafts were verified, and some kept


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@requires_vllm
def test_vllm_longspark_bf16_parts_from_plain_vllm_only_at_ties(served):
    """bf16 serving (the KV cache in the AMX tile layout here). The proposer only chooses which tokens vLLM verifies,
    but vLLM's bf16 forward over a verified block and its one-token decode step round differently (plain vLLM's own
    one-at-a-time and all-at-once runs differ too), so greedy outputs may part where the target's best tokens are
    within rounding: bf16 logits between 16 and 32 move in steps of 1/8, and the two paths differ by a few steps.
    Up to there they are identical, and the token taken there is one of plain vLLM's top 5, within 4 steps (0.5 nats)
    of its best. (The proposer only chooses which tokens are verified: drafting from a wrongly read cache would show
    as acceptance, which must stay within 20% of the fp32 run's.)"""
    plain, speculative = served["plain_bf16"]["rounds"]["concurrent"], served["longspark_bf16"]["rounds"]["concurrent"]
    fp32 = served["longspark"]["rounds"]["concurrent"]
    acceptance = speculative["accepted_tokens"] / speculative["drafts"]
    assert acceptance >= 0.8 * fp32["accepted_tokens"] / fp32["drafts"] > 0
    for request, (plain_ids, speculative_ids) in enumerate(zip(plain["token_ids"], speculative["token_ids"])):
        position = first_difference(plain_ids, speculative_ids)
        if position is None:
            continue
        top = dict(plain["top_logprobs"][request][position])
        taken = speculative_ids[position]
        assert taken in top and max(top.values()) - top[taken] <= 0.5, (request, position, top, taken)


@requires_vllm
def test_vllm_preempted_requests_rebuild_their_state(served):
    result = served["crowded"]
    assert result["rounds"]["concurrent"]["token_ids"] == served["crowded_plain"]["rounds"]["concurrent"]["token_ids"]
    built = sum(entry["state_built"] for entry in result["draft_log"])
    requests = 1 + len(result["rounds"]["concurrent"]["token_ids"])  # and the warm-up request
    assert built > requests, "no request lost its state: the small cache did not preempt any"


@requires_vllm
def test_vllm_drafts_equal_the_transformers_path(served):
    """Round by round, the proposer drafts what `generate(assistant_model=drafter)` drafts for the same context
    (same drafter, same target), so both verify the same blocks and tau is the same."""
    from transformers_longspark.generation import LongSparkCandidateGenerator
    from transformers_longspark.loading import load_drafter

    target = served["target"]
    drafter, _ = load_drafter(target)
    single = served["longspark"]["rounds"]["single"]
    log: dict[str, list[dict]] = {}
    for entry in served["longspark"]["draft_log"]:  # vLLM's internal ids are "<request id>-<random suffix>"
        log.setdefault(entry["request_id"].rsplit("-", 1)[0], []).append(entry)
    recorded: list[tuple[int, list[int]]] = []
    original = LongSparkCandidateGenerator.propose

    def recording_propose(self, input_ids, context, num_tokens):
        ids, logits = original(self, input_ids, context, num_tokens)
        recorded.append((input_ids.shape[1] - 1, ids[0, input_ids.shape[1] :].tolist()))
        return ids, logits

    LongSparkCandidateGenerator.propose = recording_propose
    try:
        for prompt, request_id, vllm_ids in zip(served["prompts"], single["request_ids"], single["token_ids"]):
            recorded.clear()
            ids = torch.tensor([prompt])
            output = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter,
                                     do_sample=False, max_new_tokens=MAX_TOKENS)  # fmt: skip
            assert output[0, len(prompt) :].tolist() == vllm_ids
            vllm_rounds = {e["num_rows"]: e["drafts"] for e in log[request_id]}
            assert recorded, "the transformers path drafted nothing"
            for num_rows, drafts in recorded:
                # transformers stops drafting at max_new_tokens; vLLM's scheduler cuts the block instead.
                assert vllm_rounds[num_rows][: len(drafts)] == drafts, (request_id, num_rows)
    finally:
        LongSparkCandidateGenerator.propose = original

