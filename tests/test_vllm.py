"""LongSpark inside vLLM (`transformers_longspark.vllm`): exact outputs, and the same drafts as the transformers path.

vLLM runs in its own environment (`scripts/install_vllm.sh` makes `.venv-vllm/`; `LONGSPARK_VLLM_PYTHON` points at
another interpreter), driven through `python -m transformers_longspark.vllm.run`; the transformers reference runs
here. Without that environment the end-to-end tests are skipped with the reason; the layout unpacking and the
proposer's errors are tested everywhere (`test_vllm_paged_kv.py`).

Six engines serve everything (`served`): plain vLLM and LongSpark in fp32 (greedy rounds one request at a time and
all at once, and a sampled round), in bf16 (on CPUs with AMX: `AMX_KV_LAYOUT`), and with a KV cache too small for
their requests (preemption). The fp32 and preemption engines draft with the shipped drafter with its lookup source
on (`lookup_min_match=2`), the bf16 one with the shipped drafter's lookup source off.
"""

from __future__ import annotations

import contextlib
import inspect
import itertools
import json
import os
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest
import torch

from helpers import VLLM_PYTHON, requires_vllm
from transformers_longspark.inference.planning import RoundPlanner

MAX_TOKENS = 40
# Per request of `prompt_ids` (two chats, two code files): all at once, the requests finish at different steps, so
# vLLM condenses its batch (a later request moves into a finished one's place) while the others decode.
REQUEST_MAX_TOKENS = [16, 40, 28, MAX_TOKENS]
NUM_SPECULATIVE = 7  # run.py's default: the shipped drafter's block size
SAMPLES = 200  # sampled requests per prompt and temperature
SAMPLE_TOKENS = 3
CONTROL_TEMPERATURE = 0.5  # the negative control: LongSpark at another temperature than plain vLLM's 1.0
# vLLM keeps a bf16 KV cache in its own (AMX tile) layout only on CPUs with AMX; elsewhere bf16 uses the "vec" layout
# of the fp32 engines, and is emulated (slower than fp32), so its two engines (~2.5 minutes here) would add nothing
# but rounding. Every layout's unpacking is also tested without an engine (`test_vllm_paged_kv.py`).
AMX_KV_LAYOUT = torch.cpu._is_amx_tile_supported()


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


STORY = (
    "A small maintenance robot lives alone in an abandoned space station orbiting a distant planet. Every day it "
    "repairs the same corridors, talks to the plants in the greenhouse and watches the stars through a cracked window. "
    "The robot has never left the station, and it is not sure it remembers how to fly the old shuttle in the hangar. "
    "Its only friend is a talking coffee machine. One morning, a signal arrives from the planet below. Write a short "
    "story about what the robot does next, in three paragraphs, for young readers."
)
NUMBERS = ["one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def sampled_prompt_ids(tokenizer) -> list[list[int]]:
    """The sampled round's prompts, over 128 tokens (vLLM shares their first cache block among the requests, so each
    computes only its tail): a chat whose first tokens vary (the drafter proposes after them), and code that repeats
    itself (most samples continue it, and the lookup source proposes the rest of a line)."""
    chat = [{"role": "user", "content": STORY}]
    story = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=True, return_dict=True)
    code = "".join(f"def add_{word}(x):\n    return x + {n}\n\n\n" for n, word in enumerate(NUMBERS, 1))
    return [story["input_ids"], tokenizer(code + "def", add_special_tokens=False)["input_ids"]]


def drafter_copy(folder: Path, **settings) -> Path:
    """A copy of the shipped drafter with `settings` in its generation config."""
    from transformers_longspark.loading import SHIPPED_DRAFTER_DIR

    shutil.copytree(SHIPPED_DRAFTER_DIR, folder)
    config = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**config, **settings}, indent=2))
    return folder


def lookup_drafter_dir(folder: Path) -> Path:
    """The shipped drafter with its lookup source matching from 2 tokens (`lookup_min_match=2`), proposing at most
    the `NUM_SPECULATIVE` tokens vLLM verifies, so that both paths propose the same continuations, and its cost model
    off: vLLM reports no verification back to the proposer, which therefore proposes every round, as the
    transformers path then does."""
    costs_off = dict(calibrate_costs=False, draft_round_cost=0.0, verify_round_cost=0.0, verify_token_cost=0.0)
    return drafter_copy(folder, lookup_min_match=2, lookup_num_tokens=NUM_SPECULATIVE, **costs_off)


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
    """The same requests through plain vLLM and vLLM + LongSpark: fp32 (one request at a time and all at once, with
    chunked prefill and different max_tokens; then sampled requests, LongSpark also at the control temperature) and
    bf16; and four requests that crowd a KV cache too small for them (preemption)."""
    pytest.importorskip("gguf")
    if not VLLM_PYTHON.exists():
        pytest.skip(requires_vllm.kwargs["reason"])
    from transformers_longspark.loading import load_smollm2, smollm2_dir

    target, tokenizer = load_smollm2()  # also writes the plain safetensors folder vLLM loads
    tmp = tmp_path_factory.mktemp("vllm")
    prompts, crowded = prompt_ids(tokenizer), preemption_prompt_ids(tokenizer)
    for name, ids in (("prompts", prompts), ("crowded", crowded), ("sampled", sampled_prompt_ids(tokenizer))):
        (tmp / f"{name}.json").write_text(json.dumps(ids))
    drafter_dir = lookup_drafter_dir(tmp / "lookup-drafter")
    common = dict(target=smollm2_dir(), prompts=tmp / "prompts.json", max_tokens=REQUEST_MAX_TOKENS)
    longspark = dict(method="longspark", drafter=drafter_dir)
    both = ["single", "concurrent"]
    sampled = dict(sampled_prompts=tmp / "sampled.json", samples=SAMPLES, sample_tokens=SAMPLE_TOKENS)
    # 128-row blocks of 30 layers x 2 x 3 heads x 64 fp32 values; vLLM keeps one block aside. The four crowded
    # requests take the other 8 at admission (two each); each needs a third while decoding, so vLLM preempts some.
    small_cache = 9 * 128 * 30 * 2 * 3 * 64 * 4
    crowded_options = dict(common, prompts=tmp / "crowded.json", max_tokens=MAX_TOKENS)
    return {
        "prompts": prompts, "crowded_prompts": crowded, "target": target, "tokenizer": tokenizer,
        "drafter_dir": drafter_dir,
        "plain": run_vllm(tmp, "plain", method="plain", rounds=both, max_num_batched_tokens=512, **sampled, **common),
        "longspark": run_vllm(tmp, "longspark", rounds=both, max_num_batched_tokens=512, seed=1,
                              sample_temperatures=[1.0, CONTROL_TEMPERATURE], **sampled, **longspark, **common),
        **({
            "plain_bf16": run_vllm(tmp, "plain_bf16", method="plain", dtype="bfloat16", logprobs=5, **common),
            "longspark_bf16": run_vllm(tmp, "longspark_bf16", dtype="bfloat16", method="longspark",
                                       drafter=drafter_copy(tmp / "no-lookup", lookup_min_match=0), **common),
        } if AMX_KV_LAYOUT else {}),
        "crowded_plain": run_vllm(tmp, "crowded_plain", method="plain", **crowded_options),
        "crowded": run_vllm(tmp, "crowded", kv_cache_bytes=small_cache, max_model_len=512, **longspark,
                            **crowded_options),
    }  # fmt: skip


def rounds_by_request(result: dict) -> dict[str, list[dict]]:
    """The proposer's log of one engine, per request id as `generate` returns it (vLLM's internal ids are "<request
    id>-<random suffix>"), in order."""
    log: dict[str, list[dict]] = {}
    for entry in result["draft_log"]:
        log.setdefault(entry["request_id"].rsplit("-", 1)[0], []).append(entry)
    return log


def accepted_per_round(result: dict, request_ids: list[str], source: str) -> list[int]:
    """Drafts accepted in each proposal from `source` to the requests `request_ids`, read off the log: a proposal at
    `num_rows` whose next one (same request, state kept) is at `next` had `next - num_rows - 1` drafts accepted."""
    log, accepted = rounds_by_request(result), []
    for request_id in request_ids:
        for entry, after in itertools.pairwise(log.get(request_id, [])):
            if entry["source"] == source and not after["state_built"]:
                accepted.append(after["num_rows"] - entry["num_rows"] - 1)
    return accepted


@requires_vllm
@pytest.mark.parametrize("rounds", ["single", "concurrent"])
def test_vllm_longspark_greedy_equals_plain_vllm(served, rounds):
    plain, speculative = served["plain"]["rounds"][rounds], served["longspark"]["rounds"][rounds]
    assert speculative["token_ids"] == plain["token_ids"]
    assert speculative["accepted_tokens"] > 0  # the drafts were verified, and some kept


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


@requires_vllm
@pytest.mark.skipif(not AMX_KV_LAYOUT, reason="no AMX: vLLM's bf16 KV cache is in the fp32 engines' layout here")
def test_vllm_longspark_bf16_parts_from_plain_vllm_only_at_ties(served):
    """bf16 serving (the KV cache in the AMX tile layout), with the shipped drafter, lookup off. The
    proposer only chooses which tokens vLLM verifies, but vLLM's bf16 forward over a verified block and its one-token
    decode step round differently (plain vLLM's own one-at-a-time and all-at-once runs differ too), so greedy outputs
    may part where the target's best tokens are within rounding: bf16 logits between 16 and 32 move in steps of 1/8,
    and the two paths differ by a few steps. Up to there they are identical, and the token taken there is one of
    plain vLLM's top 5, within 4 steps (0.5 nats) of its best. (Drafting from a wrongly read cache would show as
    acceptance: the drafts accepted per drafted block must stay within 20% of the fp32 run's drafted blocks'.)"""
    plain, speculative = served["plain_bf16"]["rounds"]["concurrent"], served["longspark_bf16"]["rounds"]["concurrent"]
    assert {entry["source"] for entry in served["longspark_bf16"]["draft_log"]} == {"drafter"}
    fp32_ids = served["longspark"]["rounds"]["concurrent"]["request_ids"]
    bf16 = accepted_per_round(served["longspark_bf16"], speculative["request_ids"], "drafter")
    fp32 = accepted_per_round(served["longspark"], fp32_ids, "drafter")
    assert sum(bf16) / len(bf16) >= 0.8 * sum(fp32) / len(fp32) > 0
    for request, (plain_ids, speculative_ids) in enumerate(zip(plain["token_ids"], speculative["token_ids"])):
        position = first_difference(plain_ids, speculative_ids)
        if position is None:
            continue
        top = dict(plain["top_logprobs"][request][position])
        taken = speculative_ids[position]
        assert taken in top and max(top.values()) - top[taken] <= 0.5, (request, position, top, taken)


class FirstRoundDone(Exception):
    """Ends a `generate` call once its first round is recorded (`recorded_rounds(first_only=True)`)."""


@contextlib.contextmanager
def recorded_rounds(first_only: bool = False):
    """Records the transformers path's rounds inside the block: `(num_rows, anchor, drafts, from_lookup)` of each
    round with a proposal (`DraftSession.draft_round`; with `first_only`, the first one ends the `generate` call)."""
    from transformers_longspark.inference.planning import Source
    from transformers_longspark.inference.session import DraftSession

    recorded: list[tuple[int, int, list[int], bool]] = []
    original = DraftSession.draft_round

    def recording_round(self, requests, planners, read_context):
        proposal = original(self, requests, planners, read_context)
        length, k = int(requests.lengths[0]), int(proposal.num_drafted[0])
        if k:  # the last rounds may have no room left
            anchor, drafts = int(requests.sequences[0, length - 1]), proposal.tokens[0, :k].tolist()
            recorded.append((length - 1, anchor, drafts, proposal.sources[0] is Source.LOOKUP))
            if first_only:
                raise FirstRoundDone
        return proposal

    DraftSession.draft_round = recording_round
    try:
        yield recorded
    finally:
        DraftSession.draft_round = original


def load_lookup_drafter(served):
    from transformers_longspark.loading import load_drafter

    drafter, _ = load_drafter(served["target"], served["drafter_dir"])
    assert drafter.generation_config.lookup_min_match == 2
    drafter.linear_dtype = torch.float32  # the proposer's linear layers run in fp32: the same argmax drafts
    return drafter


def greedy_generate(target, drafter, tokens: list[int], max_new_tokens: int) -> list[int]:
    """`generate(assistant_model=drafter)` greedy on `tokens`: the new tokens."""
    ids = torch.tensor([tokens])
    output = target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=drafter, do_sample=False,
                             max_new_tokens=max_new_tokens)  # fmt: skip
    return output[0, len(tokens) :].tolist()


@requires_vllm
def test_vllm_drafts_equal_the_transformers_path(served, monkeypatch):
    """Round by round, the proposer proposes what `generate(assistant_model=drafter)` proposes for the same context
    (same drafter with lookup on, same target), from the same source (drafted block or lookup continuation; the code
    prompts repeat themselves, so both occur), so both verify the same blocks and tau is the same. Checked for the
    requests one at a time and for all at once with different max_tokens, where vLLM's batch condenses and reorders
    as requests finish and the last prompt is still in chunked prefill while the others decode: each proposal must
    be its own request's, whatever its place in the batch."""
    target, drafter = served["target"], load_lookup_drafter(served)
    result = served["longspark"]
    log = rounds_by_request(result)
    sources = Counter()
    # vLLM reports no verification back to the proposer; the transformers path's source choice gets none either, so
    # both choose from the same (empty) history: the lookup continuation on a match, else the drafter.
    monkeypatch.setattr(RoundPlanner, "record", lambda self, source, proposed, accepted: None)
    for n, (prompt, max_tokens) in enumerate(zip(served["prompts"], REQUEST_MAX_TOKENS)):
        with recorded_rounds() as recorded:
            output = greedy_generate(target, drafter, prompt, max_tokens)
        assert recorded, "the transformers path drafted nothing"
        for round_name in ("single", "concurrent"):
            request_id = result["rounds"][round_name]["request_ids"][n]
            assert output == result["rounds"][round_name]["token_ids"][n]
            vllm_rounds = {e["num_rows"]: e for e in log[request_id]}
            for num_rows, anchor, drafts, from_lookup in recorded:
                entry = vllm_rounds[num_rows]
                # transformers stops drafting at max_new_tokens; vLLM's scheduler cuts the block instead.
                assert entry["anchor"] == anchor and entry["drafts"][: len(drafts)] == drafts, (request_id, num_rows)
                assert entry["source"] == ("lookup" if from_lookup else "drafter"), (request_id, num_rows)
                sources[round_name, entry["source"]] += 1
    assert all(sources[name, source] > 0 for name in ("single", "concurrent") for source in ("drafter", "lookup"))
    concurrent_ids = result["rounds"]["concurrent"]["request_ids"]
    places = [{e["batch_index"] for e in log[request_id]} for request_id in concurrent_ids]
    assert any(len(p) > 1 for p in places), "no request changed its place in vLLM's batch"


@requires_vllm
def test_vllm_preempted_requests_rebuild_their_state(served):
    """Four requests crowd a KV cache too small for them: vLLM preempts some (their state and lookup index are
    dropped) and recomputes them later (rebuilt from the cache rows and the whole token history). The outputs equal
    plain vLLM's, and every proposal, before and after preemption, equals the transformers path's for the same
    tokens: `generate(assistant_model=drafter)` on the request's first `num_rows` tokens proposes, in its first
    round, what the proposer proposed at `num_rows` (a state built from those rows, as a rebuilt one is; one kept
    since admission has absorbed the same rows step by step)."""
    result = served["crowded"]
    assert result["rounds"]["concurrent"]["token_ids"] == served["crowded_plain"]["rounds"]["concurrent"]["token_ids"]
    built = sum(entry["state_built"] for entry in result["draft_log"])
    requests = 1 + len(result["rounds"]["concurrent"]["token_ids"])  # and the warm-up request
    assert built > requests, "no request lost its state: the small cache did not preempt any"
    target, drafter, log = served["target"], load_lookup_drafter(served), rounds_by_request(result)
    concurrent, compared = result["rounds"]["concurrent"], Counter()
    for n, request_id in enumerate(concurrent["request_ids"]):
        tokens, rebuilt = served["crowded_prompts"][n] + concurrent["token_ids"][n], False
        for k, entry in enumerate(log[request_id]):
            rebuilt |= k > 0 and entry["state_built"]
            if entry["num_rows"] >= len(tokens):  # after the last step: its anchor is a token max_tokens cut
                continue
            with recorded_rounds(first_only=True) as recorded, contextlib.suppress(FirstRoundDone):
                greedy_generate(target, drafter, tokens[: entry["num_rows"]], NUM_SPECULATIVE + 2)
            ((num_rows, anchor, drafts, from_lookup),) = recorded
            assert (num_rows, anchor) == (entry["num_rows"], entry["anchor"]), request_id
            assert entry["drafts"] == drafts, (request_id, num_rows)
            assert entry["source"] == ("lookup" if from_lookup else "drafter"), (request_id, num_rows)
            compared[rebuilt, entry["source"]] += 1
    assert compared[True, "drafter"] + compared[True, "lookup"] > 0, "no proposal after a rebuilt state compared"
    assert compared[False, "lookup"] + compared[True, "lookup"] > 0 and compared[False, "drafter"] > 0


def chi_square_p(first: list[tuple[int, ...]], second: list[tuple[int, ...]]) -> float:
    """p-value of the chi-square test that two samples of outcomes come from one law (outcomes seen fewer than 10
    times in both samples together are pooled, so that each cell expects about 5 or more)."""
    from scipy.stats import chi2_contingency

    counts = [Counter(first), Counter(second)]
    total = counts[0] + counts[1]
    common = [outcome for outcome, n in total.items() if n >= 10]
    table = [[c[o] for o in common] + [sum(c.values()) - sum(c[o] for o in common)] for c in counts]
    if table[0][-1] + table[1][-1] == 0:
        table = [row[:-1] for row in table]
    return float(chi2_contingency(table).pvalue)


@requires_vllm
def test_vllm_longspark_sampling_follows_plain_vllms_law(served):
    """Temperature 1, from engines seeded apart (plain vLLM 0, LongSpark 1): the first two and three tokens of
    LongSpark's samples (the second and third went through its proposals, drafted or looked up, and vLLM's rejection
    sampler) follow plain vLLM's law, by a chi-square test on 200 samples per prompt (p > 1e-3, four tests). Negative
    control: LongSpark at temperature 0.5 is told apart from plain vLLM at 1 (p < 1e-6). (Without `fix_cpu_expand`,
    vLLM 0.32's CPU sampler verifies against garbage logits: the second token after "In" was " a" in every sample.)"""
    plain, speculative = served["plain"]["sampled"], served["longspark"]["sampled"]
    control = speculative[str(CONTROL_TEMPERATURE)]
    p_values = {}
    for prompt, reference in enumerate(plain["1.0"]["token_ids"]):
        outputs, wrong = speculative["1.0"]["token_ids"][prompt], control["token_ids"][prompt]
        assert len(reference) == len(outputs) == SAMPLES and {len(o) for o in outputs} == {SAMPLE_TOKENS}
        for k in (2, 3):
            first_k = [[tuple(o[:k]) for o in sample] for sample in (reference, outputs, wrong)]
            p_values[prompt, k] = chi_square_p(first_k[0], first_k[1]), chi_square_p(first_k[0], first_k[2])
    assert all(same > 1e-3 and different < 1e-6 for same, different in p_values.values()), p_values
    # The samples went through verification: drafts of both sources were proposed, and accepted as often as
    # sampling allows (about 0.2 drafted and over 1 looked-up tokens per proposal here; vLLM's CPU sampler accepts
    # almost none without `fix_cpu_expand`, about 0.02 per proposal).
    request_ids = list(itertools.chain.from_iterable(speculative["1.0"]["request_ids"]))
    for source in ("drafter", "lookup"):
        accepted = accepted_per_round(served["longspark"], request_ids, source)
        assert len(accepted) > 0 and sum(accepted) / len(accepted) > 0.1, (source, Counter(accepted))
