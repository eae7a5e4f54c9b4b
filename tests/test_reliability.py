"""A target shared by threads, generation interrupted mid-way, and many calls in a row leave no trace."""

import resource
import threading

import pytest
import torch
from transformers.generation.streamers import BaseStreamer

from helpers import make_bigram_target, make_oracle_drafter
from transformers_longspark.inference import verification

PROMPTS = [torch.tensor([[5, 9, 28, 3]]), torch.tensor([[7, 1, 40, 22, 13, 2]])]


@pytest.fixture
def pair():
    target = make_bigram_target("qwen3", vocab_size=64, seed=2)
    drafter = make_oracle_drafter(target, agree_on=lambda ids: ids % 3 != 0, block_size=4)
    return target, drafter


def forward_hooks(model: torch.nn.Module) -> int:
    return sum(len(module._forward_hooks) + len(module._forward_pre_hooks) for module in model.modules())


def test_plain_generate_in_another_thread_never_takes_the_fast_path(pair, monkeypatch):
    """One thread decodes speculatively (the target's attention switched for its calls), another runs plain `generate`
    on the same target meanwhile: each gets the outputs of a sequential run, and no forward of the plain thread ever
    runs the grouped verification kernel."""
    target, drafter = pair
    expected = {
        "speculative": [target.generate(prompt, assistant_model=drafter, max_new_tokens=24) for prompt in PROMPTS],
        "plain": [target.generate(prompt, max_new_tokens=24) for prompt in PROMPTS],
    }
    fast_threads = set()  # threads whose forwards ran the grouped kernel
    kernel = verification.grouped_verification_attention

    def spy(module, query, *args, **kwargs):
        if query.shape[2] <= verification.MAX_FOLDED_QUERIES:
            fast_threads.add(threading.get_ident())
        return kernel(module, query, *args, **kwargs)

    monkeypatch.setattr(verification, "grouped_verification_attention", spy)
    results = {"speculative": [], "plain": []}
    errors = []
    plain_thread_id = []

    def run(kind):
        try:
            if kind == "plain":
                plain_thread_id.append(threading.get_ident())
            for _ in range(15):
                for prompt in PROMPTS:
                    extra = {"assistant_model": drafter} if kind == "speculative" else {}
                    results[kind].append(target.generate(prompt, max_new_tokens=24, **extra))
        except Exception as error:  # surfaced in the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(kind,)) for kind in ("speculative", "plain")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    for kind in results:
        for i, output in enumerate(results[kind]):
            assert torch.equal(output, expected[kind][i % len(PROMPTS)]), kind
    assert fast_threads and plain_thread_id[0] not in fast_threads
    assert target.config._attn_implementation == "sdpa"


class InterruptingStreamer(BaseStreamer):
    """Raises after `after` calls to `put`, as a user's Ctrl-C inside a streaming callback would."""

    def __init__(self, after: int, error: type[BaseException]):
        self.calls, self.after, self.error = 0, after, error

    def put(self, value):
        self.calls += 1
        if self.calls > self.after:
            raise self.error("stop")

    def end(self):
        pass


@pytest.mark.parametrize("error", [KeyboardInterrupt, RuntimeError])
def test_an_interrupted_generate_leaves_target_and_drafter_as_before(pair, error):
    target, drafter = pair
    hooks, implementation = forward_hooks(target), target.config._attn_implementation
    with pytest.raises(error) as caught:  # kept, as an interactive session keeps `sys.last_traceback`
        target.generate(PROMPTS[0], max_new_tokens=40, assistant_model=drafter, streamer=InterruptingStreamer(3, error))
    assert forward_hooks(target) == hooks, "hooks outlive the call while its traceback is alive"
    assert caught.traceback
    assert target.config._attn_implementation == implementation
    stats = drafter.drafting_stats
    assert stats.rounds >= 2 and stats.drafted_tokens <= stats.rounds * drafter.config.block_size
    reference = target.generate(PROMPTS[0], max_new_tokens=20)
    assert torch.equal(target.generate(PROMPTS[0], max_new_tokens=20, assistant_model=drafter), reference)


def test_many_calls_in_a_row_leak_no_hooks_and_no_memory(pair):
    target, drafter = pair
    hooks = forward_hooks(target)

    def calls(n):
        for i in range(n):
            target.generate(PROMPTS[i % 2], max_new_tokens=16, assistant_model=drafter)
            assert forward_hooks(target) == hooks

    calls(20)  # warm up the allocator
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    calls(200)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 20 * 1024, f"peak RSS grew by {grown_kib} KiB over 200 calls"
