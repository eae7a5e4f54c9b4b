"""The confidence cuts keep sampling exact: a high-power check of one drafting round plus speculative sampling.

A drafter whose draft laws `q` are set by hand drafts for 200,000 requests at once (`draft_tokens`), the batched
verifier (`speculative_sampling`) accepts against hand-set target laws `p`, and the joint law of the first two emitted
tokens must be `p_1(a) p_2(b | a)`. The laws are chosen so that every cut rule matters: after `y_1 = 2` the second
position's confidence (largest probability) is below 0.3, after `y_1 = 1` the block product is near 0.25, and after
`y_1 = 0` a likely and an unlikely token share the second position, so a rule that cut on the drawn token's own
probability would propose `q_2` restricted to the likely one (the negative control shows the test sees that).
"""

from types import SimpleNamespace

import pytest
import torch
from scipy.stats import chisquare

from helpers import LAW_VOCAB, SAMPLING, chi_square_pvalue, exact_law, make_bigram_target, make_oracle_drafter
from transformers_longspark.context_state import DraftContext
from transformers_longspark.inference import drafting, session
from transformers_longspark.inference.batched import speculative_sampling
from transformers_longspark.inference.drafting import DraftRequests, DraftSettings, draft_tokens
from transformers_longspark.inference.planning import RoundPlanner, Source, SourceRecord

VOCAB, ANCHOR, DRAWS = 4, 4, 200_000
Q_FIRST = torch.tensor([0.5, 0.3, 0.15, 0.05])
Q_SECOND = torch.tensor(
    [  # q_2(. | y_1), row y_1
        [0.85, 0.1, 0.03, 0.02],  # confident, but y_2 = 1 has probability 0.1 < 0.3
        [0.2, 0.7, 0.05, 0.05],  # block product 0.3 * 0.7 = 0.21 < 0.25
        [0.25, 0.25, 0.25, 0.25],  # confidence 0.25 < 0.3
        [0.1, 0.1, 0.1, 0.7],
    ]
)
P_FIRST = torch.tensor([0.3, 0.3, 0.3, 0.1])
P_SECOND = torch.tensor(
    [  # p_2(. | t_1), row t_1
        [0.5, 0.5, 0.0, 0.0],
        [0.1, 0.2, 0.3, 0.4],
        [0.4, 0.3, 0.2, 0.1],
        [0.25, 0.25, 0.25, 0.25],
    ]
)


class HandSetDrafter:
    """What `draft_tokens` reads of a drafter, with draft laws set by hand: `q_1 = Q_FIRST` (the block forward) and
    `q_2 = Q_SECOND[y_1]` (the Markov correction, zero after the anchor)."""

    config = SimpleNamespace(block_size=3, mask_token_id=ANCHOR, vocab_size=VOCAB)

    def __call__(self, block_ids, context):
        base = torch.zeros(block_ids.shape[0], self.config.block_size, VOCAB)
        base[:, 0] = Q_FIRST.log()
        return SimpleNamespace(base_logits=base)

    def markov_correction(self, previous):
        table = torch.cat([Q_SECOND.log(), torch.zeros(1, VOCAB)])  # the anchor's row is neutral
        return table[previous]

    def to_target_vocab(self, logits):
        return logits

    def to_target_ids(self, columns):
        return columns


def emitted_pairs(token_threshold: float, block_threshold: float, cut=None) -> torch.Tensor:
    """`(DRAWS, 2)`: the first two tokens emitted after the anchor, by one drafting round, its verification and, where
    the round emitted only one token, an exact draw of the second from `p_2`. `cut` post-processes the drafts."""
    torch.manual_seed(0)
    sequences = torch.full((DRAWS, 3), ANCHOR)
    rows, lengths = torch.arange(DRAWS), torch.ones(DRAWS, dtype=torch.long)
    context = DraftContext(torch.zeros(DRAWS, 1), [], [], None, [], lengths)
    settings = DraftSettings(3, do_sample=True, token_threshold=token_threshold, block_threshold=block_threshold)
    proposal = draft_tokens(HandSetDrafter(), context, DraftRequests(sequences, rows, lengths, lengths + 1), settings)
    drafted, draft_logits, num_drafted = proposal.tokens, proposal.logits, proposal.num_drafted
    if cut is not None:
        num_drafted = cut(drafted, draft_logits, num_drafted)
    target_laws = torch.stack([P_FIRST.expand(DRAWS, -1), P_SECOND[drafted[:, 0]], P_SECOND[drafted[:, 1]]], dim=1)
    num_accepted, next_tokens = speculative_sampling(drafted, draft_logits, target_laws.log(), num_drafted)
    first = torch.where(num_accepted >= 1, drafted[:, 0], next_tokens)
    second = torch.where(num_accepted >= 2, drafted[:, 1], next_tokens)
    second = torch.where(num_accepted == 0, torch.multinomial(P_SECOND[first], 1)[:, 0], second)
    return torch.stack([first, second], dim=1), num_drafted


def pair_pvalue(pairs: torch.Tensor) -> float:
    counts = torch.bincount(pairs[:, 0] * VOCAB + pairs[:, 1], minlength=VOCAB**2).double()
    law = (P_FIRST[:, None] * P_SECOND).flatten().double()
    assert counts[law == 0].sum() == 0, "a pair of probability zero was emitted"
    return float(chisquare(counts[law > 0].numpy(), (law[law > 0] / law.sum() * DRAWS).numpy()).pvalue)


@pytest.mark.parametrize("thresholds", [(0.3, 0.25), (0.3, 0.0), (0.0, 0.25), (0.0, 0.0)])
def test_emitted_law_is_the_target_law_under_every_cut(thresholds):
    pairs, num_drafted = emitted_pairs(*thresholds)
    if thresholds != (0.0, 0.0):
        assert 0 < (num_drafted == 1).float().mean() < 1, "the cut must end some blocks and not others"
    assert pair_pvalue(pairs) > 1e-3


def cut_on_drawn_probability(drafted, draft_logits, num_drafted, threshold=0.3, position=1):
    """The biased rule (negative control): a block ends before the first draft from `position` on whose own draft
    probability is below the threshold."""
    if drafted.shape[1] <= position:
        return num_drafted
    q_drawn = draft_logits.softmax(-1).gather(-1, drafted[..., None])[..., 0]
    low = (q_drawn < threshold) & (torch.arange(drafted.shape[1]) >= position)
    first_low = torch.where(low.any(dim=1), low.long().argmax(dim=1), drafted.shape[1])
    return torch.minimum(num_drafted, first_low)


def test_a_cut_on_the_drawn_token_is_detected():
    pairs, _ = emitted_pairs(0.0, 0.0, cut=cut_on_drawn_probability)
    assert pair_pvalue(pairs) < 1e-6


# --- the same through generate(): a batch of copies of one prompt, the shipped SmolLM2 drafter's thresholds --------

COPIES = 30_000
SHIPPED_THRESHOLDS = (0.3, 0.25)


@pytest.fixture(scope="module")
def copies_setup():
    """A bigram target over 6 tokens and an overlapping drafter (Markov strength 1) whose second and third draft
    positions often hold a token of draft probability below 0.3 beside a likelier one: there a cut on the drawn token
    would bias the law."""
    target = make_bigram_target("llama", vocab_size=LAW_VOCAB, seed=3, temperature=0.05)
    drafter = make_oracle_drafter(target, strength=1.0, block_size=3, seed=5)
    drafter.generation_config.assistant_confidence_threshold = SHIPPED_THRESHOLDS[0]
    drafter.generation_config.block_confidence_threshold = SHIPPED_THRESHOLDS[1]
    prompt = torch.tensor([[1, 4, 2, 5]])
    return target, drafter, prompt, exact_law(target, prompt)


def first_three_counts(target, drafter, prompt) -> torch.Tensor:
    """Counts of the first three new tokens over `COPIES` sampled continuations (five are generated, so that the first
    round may draft a whole block)."""
    torch.manual_seed(0)
    batch = prompt.repeat(COPIES, 1)
    out = target.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=5, assistant_model=drafter,
                          **SAMPLING)  # fmt: skip
    a, b, c = out[:, prompt.shape[1] : prompt.shape[1] + 3].T
    return torch.bincount((a * LAW_VOCAB + b) * LAW_VOCAB + c, minlength=LAW_VOCAB**3).double()


def test_generate_law_with_the_shipped_thresholds(copies_setup):
    target, drafter, prompt, law = copies_setup
    counts = first_three_counts(target, drafter, prompt)
    stats = drafter.drafting_stats
    assert 1.3 < stats.drafted_tokens / stats.rounds < 2.5  # multi-token blocks, and blocks cut short
    assert chi_square_pvalue(counts, law) > 1e-3


def test_generate_law_detects_a_cut_on_the_drawn_token(copies_setup, monkeypatch):
    target, drafter, prompt, law = copies_setup

    def biased_draft_tokens(*args, **kwargs):
        proposal = draft_tokens(*args, **kwargs)
        proposal.num_drafted = cut_on_drawn_probability(proposal.tokens, proposal.logits, proposal.num_drafted)
        return proposal

    monkeypatch.setattr(drafting, "draft_tokens", biased_draft_tokens)
    assert chi_square_pvalue(first_three_counts(target, drafter, prompt), law) < 1e-6


# --- the lookup source: point-mass proposals, rounds switching between lookup and the drafter ------------------------


@pytest.fixture
def lookup_setup(copies_setup, monkeypatch):
    """The copies setup with lookup on, and a prompt that repeats itself: whether a round proposes the lookup
    continuation or a drafted block depends on what was sampled before it."""
    target, drafter, _, _ = copies_setup
    monkeypatch.setattr(drafter.generation_config, "lookup_min_match", 2, raising=False)
    monkeypatch.setattr(drafter.generation_config, "lookup_num_tokens", 4, raising=False)
    prompt = torch.tensor([[1, 4, 2, 5, 1, 4]])
    return target, drafter, prompt, exact_law(target, prompt)


def test_generate_law_with_lookup_proposals(lookup_setup):
    target, drafter, prompt, law = lookup_setup
    counts = first_three_counts(target, drafter, prompt)
    stats = drafter.drafting_stats
    assert 0.03 * stats.rounds < stats.lookup_rounds < stats.rounds  # rounds of both sources
    assert chi_square_pvalue(counts, law) > 1e-3


def counted_choices(monkeypatch, drafter_accepted: float) -> list[Source]:
    """Seeds every request's drafter record with `drafter_accepted` drafts accepted of 2 proposed per round, and
    returns the list that collects each round's source choice (`RoundPlanner.choose`)."""
    new_planner, choose, choices = DraftSettings.new_planner, RoundPlanner.choose, []

    def seeded(self, offset=0):
        planner = new_planner(self, offset)
        planner.records[Source.DRAFTER] = SourceRecord(accepted=drafter_accepted, proposed=2.0)
        return planner

    def recorded(self, continuation, can_draft, length=0, matched=0, room=None):
        choices.append(choose(self, continuation, can_draft, length, matched, room))
        return choices[-1]

    monkeypatch.setattr(DraftSettings, "new_planner", seeded)
    monkeypatch.setattr(RoundPlanner, "choose", recorded)
    return choices


def test_generate_law_when_past_rounds_choose_the_source(lookup_setup, monkeypatch):
    """The source of a request's next round depends on how many drafts its past rounds accepted (`planning.py`).
    With each request's drafter mean seeded at 0.5, the choice goes both ways in thousands of rounds, and the law is
    exact."""
    target, drafter, prompt, law = lookup_setup
    choices = counted_choices(monkeypatch, drafter_accepted=0.5)
    counts = first_three_counts(target, drafter, prompt)
    assert choices.count(Source.LOOKUP) > 1000 and choices.count(Source.DRAFTER) > 1000
    assert chi_square_pvalue(counts, law) > 1e-3


def test_generate_law_when_the_cost_model_skips_rounds(lookup_setup, monkeypatch):
    """With the cost model on, rounds whose sources do not repay their cost propose nothing (plain decoding steps),
    and a passed-over source is probed again: thousands of rounds of each of the three sources, and the law is
    exact."""
    target, drafter, prompt, law = lookup_setup
    monkeypatch.setattr(drafter.generation_config, "draft_round_cost", 0.2, raising=False)
    monkeypatch.setattr(drafter.generation_config, "verify_token_cost", 0.2, raising=False)
    # Seeded at (1 + 0.7) / (1 + 0.2 + 0.2 * 2) > 1, a drafter round that accepts nothing takes the drafter below 1.
    choices = counted_choices(monkeypatch, drafter_accepted=0.7)
    plans = []  # what each round ran: the batch check may overrule the rows' choices (`plan_round`)

    def recorded_plan(*args):
        plans.append(drafting.plan_round(*args))
        return plans[-1]

    monkeypatch.setattr(session, "plan_round", recorded_plan)
    counts = first_three_counts(target, drafter, prompt)
    ran = [source for plan in plans for source in plan.sources]
    assert all(ran.count(source) > 1000 for source in Source), {s: ran.count(s) for s in Source}
    assert choices.count(Source.NONE) > 1000  # the rows' own choices, not only a batch check, skip rounds
    stats = drafter.drafting_stats
    assert (stats.plain_rounds, stats.lookup_rounds) == (ran.count(Source.NONE), ran.count(Source.LOOKUP))
    assert chi_square_pvalue(counts, law) > 1e-3


def test_generate_law_when_past_rounds_choose_the_lookup_length(lookup_setup, monkeypatch):
    """A lookup round proposes the prefix of its continuation that its past rounds' continuation rate makes worth
    most (`RoundPlanner.lookup_length`): shorter prefixes and whole continuations, hundreds of each, and the law is
    exact."""
    target, drafter, prompt, law = lookup_setup
    monkeypatch.setattr(drafter.generation_config, "verify_round_cost", 0.05, raising=False)
    monkeypatch.setattr(drafter.generation_config, "verify_token_cost", 0.3, raising=False)
    new_planner, lookup_length, lengths = DraftSettings.new_planner, RoundPlanner.lookup_length, []

    def seeded(self, offset=0):
        """Lookup at rate 0.6 (2 of 3 tokens are worth most; the request's own rounds move it), a drafter that
        accepts nothing: the first round takes a lookup prefix."""
        planner = new_planner(self, offset)
        planner.records[Source.LOOKUP] = SourceRecord(accepted=1.5, proposed=3.0, rejected=1.0)
        planner.records[Source.DRAFTER] = SourceRecord(accepted=0.0, proposed=2.0, rejected=1.0)
        return planner

    def recorded(self, available, matched=0, length=0):
        lengths.append((available, lookup_length(self, available, matched, length)))
        return lengths[-1][1]

    monkeypatch.setattr(DraftSettings, "new_planner", seeded)
    monkeypatch.setattr(RoundPlanner, "lookup_length", recorded)
    counts = first_three_counts(target, drafter, prompt)
    shortened = sum(0 < chosen < available for available, chosen in lengths)
    whole = sum(chosen == available > 1 for available, chosen in lengths)
    assert shortened > 1000 and whole > 300, (shortened, whole)
    assert chi_square_pvalue(counts, law) > 1e-3


def test_generate_law_detects_lookup_proposals_under_a_wrong_law(lookup_setup, monkeypatch):
    """Negative control: lookup tokens handed to the verifier as if drawn from a uniform law."""
    target, drafter, prompt, law = lookup_setup
    uniform = lambda tokens, vocab_size: torch.zeros(*tokens.shape, vocab_size)  # noqa: E731
    monkeypatch.setattr(drafting, "point_mass_logits", uniform)
    assert chi_square_pvalue(first_three_counts(target, drafter, prompt), law) < 1e-6
