"""A deterministic toy English corpus generated from templates.

Everything comes from the seed: the world's facts (what each animal eats,
where it lives, its color) are drawn once, then documents are sampled from a
few templates (stories, facts, counting, weekdays, chat turns). The text is
low-entropy on purpose: a tiny model learns it in minutes, and its greedy
continuations are predictable enough for an MTP head to be trained to draft
them.
"""

import random
from dataclasses import dataclass

EOS = "<|endoftext|>"
USER = "<|user|>"
ASSISTANT = "<|assistant|>"
SYSTEM = "<|system|>"
GMASK = "[gMASK]"
SOP = "<sop>"
SPECIAL_TOKENS = [EOS, GMASK, SOP, SYSTEM, USER, ASSISTANT]

ANIMALS = [
    "fox", "cat", "dog", "owl", "bear", "wolf", "duck", "frog", "horse",
    "mouse", "goat", "sheep", "tiger", "rabbit", "eagle", "whale"
]
COLORS = ["red", "brown", "black", "white", "gray", "green", "golden"]
FOODS = [
    "berries", "fish", "grass", "seeds", "apples", "insects", "carrots",
    "nuts", "corn"
]
PLACES = [
    "forest", "river", "farm", "mountain", "field", "lake", "garden", "cave"
]
ADJS = ["quick", "lazy", "small", "big", "old", "young", "quiet", "happy"]
VERBS = ["jumped over", "ran past", "looked at", "walked to", "slept near"]
THINGS = ["fence", "tree", "stone", "bridge", "house", "hill", "road"]
TIMES = ["in the morning", "at night", "after lunch", "before dawn"]
DAYS = [
    "monday", "tuesday", "wednesday", "thursday", "friday", "saturday",
    "sunday"
]
ONES = [
    "zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
    "nine", "ten", "eleven", "twelve", "thirteen", "fourteen", "fifteen",
    "sixteen", "seventeen", "eighteen", "nineteen"
]
TENS = ["", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy",
        "eighty", "ninety"]


def number_words(n: int) -> str:
    if not 0 <= n < 100:
        raise ValueError(f"number_words supports 0..99, got {n}")
    if n < 20:
        return ONES[n]
    tens, ones = divmod(n, 10)
    return TENS[tens] if ones == 0 else f"{TENS[tens]} {ONES[ones]}"


@dataclass(frozen=True)
class World:
    """Fixed facts every document agrees on."""

    food: dict[str, str]
    home: dict[str, str]
    color: dict[str, str]

    @classmethod
    def sample(cls, rng: random.Random) -> "World":
        return cls(
            food={a: rng.choice(FOODS) for a in ANIMALS},
            home={a: rng.choice(PLACES) for a in ANIMALS},
            color={a: rng.choice(COLORS) for a in ANIMALS},
        )


def _story(rng: random.Random, w: World) -> str:
    sentences = []
    for _ in range(rng.randint(2, 4)):
        a = rng.choice(ANIMALS)
        sentences.append(
            f"the {rng.choice(ADJS)} {w.color[a]} {a} {rng.choice(VERBS)} "
            f"the {rng.choice(THINGS)} {rng.choice(TIMES)}.")
    return " ".join(sentences)


def _facts(rng: random.Random, w: World) -> str:
    a = rng.choice(ANIMALS)
    return (f"the {a} is {w.color[a]}. the {a} lives in the {w.home[a]}. "
            f"every day the {a} eats {w.food[a]} in the {w.home[a]}.")


def _counting(rng: random.Random, w: World) -> str:
    start = rng.randint(0, 80)
    stop = start + rng.randint(4, 12)
    words = ", ".join(number_words(n) for n in range(start, min(stop, 99)))
    return f"let us count from {number_words(start)}: {words}."


def _days(rng: random.Random, w: World) -> str:
    i = rng.randrange(7)
    n = rng.randint(3, 9)
    seq = ", ".join(DAYS[(i + j) % 7] for j in range(n))
    return (f"after {DAYS[i]} comes {DAYS[(i + 1) % 7]}. the days go: "
            f"{seq}.")


def _chat(rng: random.Random, w: World) -> str:
    a = rng.choice(ANIMALS)
    question, answer = rng.choice([
        (f"what does the {a} eat?", f"the {a} eats {w.food[a]}."),
        (f"where does the {a} live?",
         f"the {a} lives in the {w.home[a]}."),
        (f"what color is the {a}?", f"the {a} is {w.color[a]}."),
    ])
    return f"{USER}\n{question}{ASSISTANT}\n{answer}"


TEMPLATES = (_story, _facts, _counting, _days, _chat)


def documents(seed: int, count: int) -> list[str]:
    """``count`` documents, identical for the same seed on any machine."""
    rng = random.Random(seed)
    world = World.sample(rng)
    return [rng.choice(TEMPLATES)(rng, world) for _ in range(count)]


def heldout_prompts(seed: int, train_docs: list[str],
                    count: int) -> list[str]:
    """Prompts cut from documents of the same world that training never saw.

    The held-out documents come from a separate stream of the same world; a
    candidate is kept only when no training document starts with it, so the
    exact prompt text is unseen (the world's facts are shared on purpose).
    """
    rng = random.Random(seed)
    world = World.sample(rng)  # same world: same first draws as documents()
    cut_rng = random.Random(seed * 7919 + 1)
    seen = set(train_docs)
    prefixes = {d[:48] for d in train_docs}
    prompts: list[str] = []
    while len(prompts) < count:
        doc = cut_rng.choice(TEMPLATES)(cut_rng, world)
        if doc in seen or doc[:48] in prefixes:
            continue
        words = doc.split(" ")
        prompt = " ".join(words[:max(3, len(words) // 3)])
        if prompt not in prompts and not any(
                d.startswith(prompt) for d in train_docs):
            prompts.append(prompt)
    return prompts
