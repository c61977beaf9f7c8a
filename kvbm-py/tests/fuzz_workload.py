"""Randomized workloads for the differential engine test.

A case is a batch of token-id prompts whose prefixes form a random tree
(shared stems, siblings, exact duplicates, a prompt that is a prefix of
another) and a schedule: the prompts arrive in waves (a wave is one
``generate()`` call; the engine drains between waves), each prompt at a
random step of its wave, and a few are aborted a step or two after they
arrive. Everything follows from the seed, so a failing case is re-run
from its seed alone.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

BLOCK = 32
#: The engine's longest sequence (prompt and output).
MAX_MODEL_LEN = 512
#: Token ids are drawn from [3, VOCAB) (0-2 are special in the tiny model).
VOCAB = 512
#: The most tokens a case's prompts generate, unless a run says otherwise.
MAX_TOKENS = 12


@dataclass
class Arrival:
    """One request of a wave."""

    #: Index into the case's prompts.
    prompt: int
    #: Engine steps after the wave started when it is added.
    at_step: int
    #: Engine steps after it was added when it is aborted (None: never).
    abort_after: int | None
    #: Tokens to generate (greedy, EOS ignored).
    max_tokens: int


@dataclass
class Case:
    """A seed's prompts and their schedule."""

    seed: int
    prompts: list[list[int]]
    waves: list[list[Arrival]]

    def to_json(self) -> dict:
        return {"seed": self.seed, "prompts": self.prompts, "waves": [[asdict(a) for a in w] for w in self.waves]}


def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def _length(rng: random.Random, low: int, high: int) -> int:
    """A length in [low, high], a whole number of blocks half of the time
    (the last block full, or not)."""
    n = rng.randint(low, high)
    if rng.random() < 0.5:
        n = max(BLOCK, n - n % BLOCK)
    return n


def make_case(seed: int, max_tokens: int = MAX_TOKENS) -> Case:
    """The case of `seed`: 4 to 8 prompts over 1 to 3 stems, each
    generating 1 to `max_tokens` tokens."""
    rng = random.Random(seed)
    longest = MAX_MODEL_LEN - max_tokens
    stems = [_tokens(rng, _length(rng, BLOCK, 288)) for _ in range(rng.randint(1, 3))]
    prompts: list[list[int]] = []
    for _ in range(rng.randint(4, 8)):
        kind = rng.random()
        if prompts and kind < 0.15:
            prompts.append(list(rng.choice(prompts)))  # an exact duplicate
        elif prompts and kind < 0.3:
            other = rng.choice(prompts)  # a prefix of another prompt
            prompts.append(other[: max(1, _length(rng, 1, len(other)))])
        elif prompts and kind < 0.45:
            other = rng.choice(prompts)  # another's prefix, then its own tail
            keep = _length(rng, 1, len(other))
            prompts.append(other[:keep] + _tokens(rng, rng.randint(1, max(1, longest - keep))))
        else:
            stem = rng.choice(stems) if rng.random() < 0.85 else []
            tail = rng.randint(1, max(1, longest - len(stem)))
            prompts.append(stem + _tokens(rng, min(tail, 200)))
    prompts = [p[:longest] for p in prompts]
    order = list(range(len(prompts)))
    rng.shuffle(order)
    waves: list[list[Arrival]] = []
    while order:
        take = rng.randint(1, len(order))
        wave = []
        for i in order[:take]:
            abort = rng.choice([1, 2]) if rng.random() < 0.12 else None
            at = 0 if rng.random() < 0.6 else rng.randint(1, 4)
            wave.append(Arrival(i, at, abort, rng.randint(1, max_tokens)))
        waves.append(wave)
        order = order[take:]
    return Case(seed, prompts, waves)


def repro_case(num_prompts: int) -> Case:
    """The reported failure: prompts sharing a 256-token prefix (the first
    two 404 and 477 tokens long), all in one ``generate()``."""
    rng = random.Random(29)
    stem = _tokens(rng, 256)
    lengths = [404, 477, 300, 350, 420, 460][:num_prompts]
    prompts = [stem + _tokens(rng, n - 256) for n in lengths]
    return Case(-num_prompts, prompts, [[Arrival(i, 0, None, 16) for i in range(num_prompts)]])
