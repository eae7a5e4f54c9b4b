"""Two speculative `generate` threads on one target (and one drafter) at once.

`test_reliability.py` runs one speculative and one plain thread. Here both threads decode speculatively, and their
first calls are made to overlap whatever the scheduler does: the first thread's call starts, the second's starts
during it, and the first ends while the second is still drafting; then each thread makes more calls freely. One
call ending must neither close the other's hidden-state hooks (its drafts would then read stale boundary states:
each thread's proposals must be those of a sequential run), nor restore the attention implementation or the linear
layers under it (each thread's every verification forward must run the grouped kernel), nor leave anything switched
once both are done.
"""

from __future__ import annotations

import threading

import torch

from helpers import make_bigram_target, make_oracle_drafter
from transformers_longspark.inference import session, verification

CALLS = {"first": ([5, 9, 28, 3], 16, 6), "second": ([7, 1, 40, 22, 13, 2], 40, 3)}  # prompt, new tokens, calls
WAIT_S = 60  # a bound on the waits of the orchestration (a deadlock fails the test instead of hanging it)


def run_calls(target, drafter, kind: str, calls: int | None = None) -> list[torch.Tensor]:
    prompt, new_tokens, all_calls = CALLS[kind]
    prompt, calls = torch.tensor([prompt]), all_calls if calls is None else calls
    return [target.generate(prompt, max_new_tokens=new_tokens, assistant_model=drafter) for _ in range(calls)]


def test_two_speculative_threads_keep_their_own_hooks_and_fast_path(monkeypatch):
    target = make_bigram_target("qwen3", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 3 != 0, block_size=4)
    proposals, draft_round = {}, session.DraftSession.draft_round  # thread -> the tokens of each proposal
    kinds = {}  # thread -> kind, for the two threads
    first_started, second_started, first_done = threading.Event(), threading.Event(), threading.Event()

    def spy_round(self, requests, planners, read_context):
        proposal = draft_round(self, requests, planners, read_context)
        mine = proposals.setdefault(threading.get_ident(), [])
        mine.append(proposal.tokens[0, : int(proposal.num_drafted[0])])
        kind = kinds.get(threading.get_ident())
        if kind == "first" and len(mine) == 1:  # the first call drafts: let the second call start, wait for it
            first_started.set()
            assert second_started.wait(WAIT_S)
        elif kind == "second" and len(mine) == 1:  # both calls draft: wait until the first one has ended
            second_started.set()
            assert first_done.wait(WAIT_S)
        return proposal

    monkeypatch.setattr(session.DraftSession, "draft_round", spy_round)
    expected = {}
    for kind in CALLS:  # sequential runs: the outputs and proposals of each kind alone
        outputs = run_calls(target, drafter, kind)
        expected[kind] = (outputs, proposals.pop(threading.get_ident()))

    attention = target.model.layers[0].self_attn
    forwards, grouped = {}, {}  # thread -> forwards of layer 0's attention of at most MAX_FOLDED_QUERIES tokens
    kernel = verification.grouped_verification_attention

    def count_forwards(module, args, kwargs):
        if kwargs["hidden_states"].shape[1] <= verification.MAX_FOLDED_QUERIES:
            forwards[threading.get_ident()] = forwards.get(threading.get_ident(), 0) + 1

    def spy_kernel(module, query, *args, **kwargs):
        if module is attention:
            grouped[threading.get_ident()] = grouped.get(threading.get_ident(), 0) + 1
        return kernel(module, query, *args, **kwargs)

    monkeypatch.setattr(verification, "grouped_verification_attention", spy_kernel)
    handle = attention.register_forward_pre_hook(count_forwards, with_kwargs=True)
    results, errors, idents = {}, [], {}

    def run(kind):
        idents[kind] = threading.get_ident()
        kinds[threading.get_ident()] = kind
        try:
            prompt, new_tokens, calls = CALLS[kind]
            if kind == "second":
                assert first_started.wait(WAIT_S)
            results[kind] = [target.generate(torch.tensor([prompt]), max_new_tokens=new_tokens,
                                             assistant_model=drafter)]  # fmt: skip
            if kind == "first":
                first_done.set()
            results[kind] += run_calls(target, drafter, kind, calls - 1)
        except BaseException as error:  # surfaced in the main thread
            errors.append(error)
            first_started.set(), second_started.set(), first_done.set()

    try:
        threads = [threading.Thread(target=run, args=(kind,)) for kind in CALLS]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        handle.remove()
    assert not errors, errors
    for kind, (outputs, kind_proposals) in expected.items():
        assert all(torch.equal(a, b) for a, b in zip(results[kind], outputs, strict=True)), kind
        seen = proposals[idents[kind]]
        assert len(seen) == len(kind_proposals) and all(torch.equal(a, b) for a, b in zip(seen, kind_proposals)), kind
        assert forwards[idents[kind]] > 0 and grouped.get(idents[kind], 0) == forwards[idents[kind]], kind
    assert target.config._attn_implementation == "sdpa"
    assert not any("forward" in m.__dict__ for model in (target, drafter) for m in model.modules())
