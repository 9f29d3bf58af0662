"""The seeded, synthetic workloads of ``loadtest.bench specdecode`` (no data
set can be downloaded here), all chat prompts for SmolLM2's template:

- ``copy``: answers that reuse the prompt's text (rename a function in a
  generated Python module, repeat a paragraph with one word replaced, fix
  the typos of a paragraph). Speculation settings were tuned on it.
- ``heldout``: copy-heavy too, but written apart from ``copy`` and never
  tuned on: other templates, vocabularies and tasks (code written out again
  with a comment added, a dated sentence or an address extracted, an email
  copied with its greeting changed, misspelt lines corrected one by one).
- ``repeat``: the same questions asked again by other requests, as agents
  and retries do: a few open questions, each sent ``REPEATS`` times, every
  ask after the first coming after the first has finished at one stream.
- ``chat``: open questions (stories, explanations, tips).
"""
import random
from typing import List

WORDS = ("river stone garden window lantern harbor meadow engine pocket ladder violin orchard canyon "
         "compass blanket thunder marble feather anchor candle").split()
VERBS = ("collects builds opens carries paints follows guards measures returns watches").split()
STEMS = ("collect build open carry paint follow guard measure return watch").split()
TOPICS = ("a lighthouse keeper", "the history of tea", "how bridges carry weight", "a trip to the mountains",
          "learning to play chess", "why the sky is blue", "a robot that learns to cook", "saving money",
          "the life of a honeybee", "a city under the sea", "how vaccines work", "a lost umbrella")
REPEATS = 3


def chat(text: str) -> str:
    return f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n"


# ---------------------------------------------------------------- copy (the tuning workload)

def _module(rng: random.Random, functions: int) -> (str, List[str]):
    names, lines = [], []
    for _ in range(functions):
        a, b = rng.sample(WORDS, 2)
        name = f"{rng.choice(STEMS)}_{a}"
        names.append(name)
        lines += [f"def {name}({a}, {b}):", f'    """Return the {a} with the {b}."""',
                  f"    total = {a} + {b}", f"    return total * {rng.randint(2, 9)}", ""]
    return "\n".join(lines), names


def _paragraph(rng: random.Random, sentences: int) -> str:
    return " ".join(f"The {rng.choice(WORDS)} {rng.choice(VERBS)} the {rng.choice(WORDS)} near the "
                    f"{rng.choice(WORDS)}." for _ in range(sentences))


def _typos(rng: random.Random, text: str) -> str:
    words = text.split(" ")
    for i in rng.sample(range(len(words)), max(1, len(words) // 8)):
        w = words[i]
        if len(w) > 3:
            j = rng.randrange(1, len(w) - 2)
            words[i] = w[:j] + w[j + 1] + w[j] + w[j + 2:]
    return " ".join(words)


def copy_prompts(n: int, seed: int) -> List[str]:
    """Prompts whose answers copy most of their text."""
    rng, out = random.Random(seed), []
    for i in range(n):
        kind = i % 3
        if kind == 0:
            code, names = _module(rng, 3)
            out.append(chat(f"Rename the function {names[0]} to {names[0]}_v2 and return the whole code:\n\n{code}"))
        elif kind == 1:
            text = _paragraph(rng, 4)
            old, new = rng.choice(text.split(" ")[1:3]), rng.choice(WORDS)
            out.append(chat(f"Repeat this text exactly, but write '{new}' instead of '{old}':\n\n{text}"))
        else:
            out.append(chat(f"Fix the spelling mistakes in this text and write it out again:\n\n"
                            f"{_typos(rng, _paragraph(rng, 4))}"))
    return out


# ---------------------------------------------------------------- heldout (never tuned on)

FIRST = ("Amara Lindqvist Tomasz Okafor Priya Delacroix Mateo Nakamura Ingrid Osei Yusuf Moreau Leila "
         "Brennan Kofi Haldane Sofia Varga").split()
CITIES = ("Lisbon Nairobi Osaka Quito Tallinn Hobart Tucson Bergen Accra Porto Leeds Dakar").split()
STREETS = ("Harbour Lane", "Mill Road", "Orchard Street", "Station Square", "Quay Walk", "Chapel Row")
PLACES = ("bakery library station harbour market museum clinic theatre").split()
DETAILS = ("opens at six", "closes early on Sundays", "sells rye bread and plum cake", "has a blue door",
           "hires students every summer", "stands beside the old bridge", "lends bicycles to visitors")
MONTHS = ("January March April June September November").split()
ARGS = ("values", "factor", "shift", "limit", "scores", "weights", "items", "step")
MISSPELT = {"the": "teh", "river": "rivver", "evening": "evenning", "bridge": "brigde", "children": "childrin",
            "window": "windwo", "morning": "mornign", "quietly": "quietley", "garden": "gardne"}
SUBJECTS = ("the spring workshop", "the roof repairs", "the school trip", "the new website", "the choir concert")


def _functions(rng: random.Random) -> str:
    blocks = []
    for _ in range(2):
        name, (a, b) = f"{rng.choice(['scale', 'offset', 'clip', 'blend'])}_{rng.choice(ARGS)}", rng.sample(ARGS, 2)
        blocks.append(f"def {name}({a}, {b}):\n    result = []\n    for v in {a}:\n"
                      f"        result.append(v {rng.choice('+-*')} {b})\n    return result\n")
    return "\n".join(blocks)


def _dated_text(rng: random.Random) -> str:
    place, other = rng.sample(PLACES, 2)
    return (f"The {place} {rng.choice(DETAILS)}. On {rng.randint(1, 28)} {rng.choice(MONTHS)} "
            f"{rng.randint(1950, 2020)} the {other} was closed for repairs. Today the {other} "
            f"{rng.choice(DETAILS)}.")


def _email(rng: random.Random) -> (str, str):
    sender, reader = rng.sample(FIRST, 2)
    body = (f"Hello {reader},\nthank you for the quick reply. The invoice for {rng.choice(SUBJECTS)} is attached, "
            f"and the payment is due on {rng.randint(1, 28)} {rng.choice(MONTHS)}.\nBest regards,\n{sender}")
    return body, f"Dear {rng.choice(['Ms', 'Mr', 'Dr'])} {rng.choice(FIRST)}"


def _sentence(rng: random.Random) -> str:
    words = ["the", rng.choice(["children", "river", "bridge", "garden", "window"]),
             rng.choice(["shines", "waits", "sings", "sleeps"]),
             rng.choice(["quietly", "every evening", "in the morning"])]
    return " ".join(words).capitalize() + "."


def heldout_prompts(n: int, seed: int) -> List[str]:
    """Copy-heavy prompts written apart from ``copy_prompts``: other tasks,
    templates and words (the module's docstring)."""
    rng, out = random.Random(seed + 1000), []
    for i in range(n):
        kind = i % 4
        if kind == 0:   # a code edit: the code again, with a line added
            out.append(chat(f"Here is my code:\n\n```python\n{_functions(rng)}```\n\nPlease write it out again "
                            f"with the comment # reviewed by {rng.choice(FIRST)} at the top."))
        elif kind == 1:   # extraction: one sentence or an address out of a text
            if rng.random() < 0.5:
                out.append(chat(f"Which sentence in this text mentions a date? Copy it exactly.\n\n{_dated_text(rng)}"))
            else:
                out.append(chat(f"Extract the address from this message and write it on its own line:\n"
                                f"Hi {rng.choice(FIRST)}, the parcel goes to {rng.randint(2, 99)} {rng.choice(STREETS)}, "
                                f"{rng.choice(CITIES)} {rng.randint(1000, 9999)}. Please call before noon."))
        elif kind == 2:   # a rewrite: an email with its greeting changed
            body, greeting = _email(rng)
            out.append(chat(f"Copy the email below, but change the greeting to '{greeting}':\n\n{body}"))
        else:   # a rewrite: spelling fixed line by line
            lines = []
            for k in range(4):
                words = _sentence(rng).split(" ")
                lines.append(f"{k + 1}. " + " ".join(MISSPELT.get(w.lower(), w) if rng.random() < 0.5 else w
                                                     for w in words))
            out.append(chat("Correct the spelling and write each line again:\n" + "\n".join(lines)))
    return out


# ---------------------------------------------------------------- repeat and chat

QUESTIONS = ("What is a good way to start learning to cook?", "Why do cats purr?",
             "How does a refrigerator keep food cold?", "What should I pack for a day hike?",
             "How do plants make their food?", "Why is exercise good for the heart?",
             "How does a bicycle stay upright?", "What makes a good night's sleep?")


def repeat_prompts(n: int, seed: int) -> List[str]:
    """``n`` requests over ``n // REPEATS`` questions, each asked ``REPEATS``
    times; the asks of one question are spread apart, each after its first."""
    rng = random.Random(seed + 2000)
    questions = rng.sample(QUESTIONS, max(1, n // REPEATS))
    order = [q for q in questions] + [q for _ in range(REPEATS - 1) for q in rng.sample(questions, len(questions))]
    return [chat(q) for q in (order * (n // len(order) + 1))[:n]]


def chat_prompts(n: int, seed: int) -> List[str]:
    rng = random.Random(seed + 1)
    forms = ("Write a short story about {}.", "Explain {} to a child.", "Give me three tips about {}.")
    return [chat(rng.choice(forms).format(rng.choice(TOPICS))) for _ in range(n)]


WORKLOADS = {"copy": copy_prompts, "heldout": heldout_prompts, "repeat": repeat_prompts, "chat": chat_prompts}
