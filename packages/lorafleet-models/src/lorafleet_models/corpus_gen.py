"""Generate the shipped pre-training corpus (`data/corpus.txt`) from a seed.

There is no network to fetch books, so the tiny model learns from a synthetic world: invented
people, cities and countries with fixed attributes, plain facts about them, simple arithmetic,
and many short chat dialogues written in the exact ChatML format of our tokenizer's chat
template. A model pre-trained on it already knows the chat format and the shape of answers such
as "What is my name?" → "Your name is Mara.", so a LoRA can teach it a new fact in tens of steps.
The name "Dima" never appears: tests teach it and must not find it already known.

Run `python -m lorafleet_models.corpus_gen` to rewrite the committed file; the output depends
only on the seed, so the file and the code stay in step (a test checks this).
"""

from __future__ import annotations

import random
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lorafleet_models.corpus import CORPUS_PATH, DOC_SEP

CORPUS_SEED = 20240611
N_DOCS = 2500
FORBIDDEN = "dima"


def _words(text: str) -> tuple[str, ...]:
    return tuple(text.split())


ONSETS = _words("b d f g h k l m n p r s t v z br dr gr kr st tr sh ch")
VOWELS = _words("a e i o u a e i o")

NAMES = _words(
    "Alice Bruno Carla Dario Elena Felix Greta Hugo Irene Jonas Karin Leon Mara Nico Olga Pavel "
    "Quinn Rosa Sven Tara Umar Vera Walt Xena Yusuf Zoe Anja Boris Clara Dmitri Edith Fabio "
    "Gina Hanna Igor Jana Kofi Lena Milo Nina Oskar Petra Rafael Sofia Timo Ursula Viktor Wanda "
    "Yara Zeno Amira Basil Celia Dora Emil Frida Goran Helga Ivan Julia Kurt Lotte Marek Noor "
    "Otto Pia Rolf Sanna Theo Uma Vito Wilma Ada Ben Cleo Dan Eva Finn Gus Ida Jack Kim Liam "
    "Mia Noah Omar Paul Rita Sam Tom Una"
)
CITIES = _words(
    "Tolven Mirel Arvik Solun Brenna Kestra Lumo Dorvik Pellan Quarro Ravel Sint Teluna Varo "
    "Wendel Ystra Zorin Amber Calden Fennick Gorro Harlow Ilsen Jarrow Korve Lindo Marrow "
    "Norden Orla Pesca"
)
COUNTRIES = _words("Zorland Belmar Kaveria Ostria Lumina Tervan Quessia Noravia Drell Sarnia")
COLOURS = _words("red blue green yellow orange purple pink brown black white grey")
ANIMALS = _words("cat dog bird fish horse rabbit turtle goat duck frog")
FOODS = _words("bread rice soup apples pears cheese fish pasta beans eggs cake plums")
JOBS = _words("teacher baker farmer doctor pilot painter driver cook nurse builder singer writer")
NUMBER_WORDS = _words(
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
)
THING_COLOURS = {
    "the sky": "blue",
    "grass": "green",
    "snow": "white",
    "the sun": "yellow",
    "coal": "black",
    "a banana": "yellow",
    "a tomato": "red",
    "milk": "white",
    "a leaf": "green",
    "the night": "black",
    "an orange": "orange",
    "a cloud": "white",
}
ANIMAL_LEGS = {
    "cat": 4,
    "dog": 4,
    "bird": 2,
    "fish": 0,
    "horse": 4,
    "rabbit": 4,
    "duck": 2,
    "frog": 4,
    "goat": 4,
    "spider": 8,
    "ant": 6,
}
NAME_QUESTIONS = (
    "What is my name?",
    "What's my name?",
    "Do you know my name?",
    "Tell me my name.",
    "Can you tell me my name?",
    "Who am I?",
    "Do you remember my name?",
)
ADJECTIVES = _words(
    "big small old new happy sad quick slow warm cold bright dark quiet loud soft hard kind "
    "clever brave gentle tall short young busy lazy clean dirty empty full heavy light sweet "
    "bitter round square wooden golden silver friendly careful sleepy hungry thirsty funny "
    "strange famous little pretty simple tiny huge early late wild calm proud shy"
)
NOUNS = _words(
    "house garden river mountain forest window door table chair book letter bottle basket "
    "bridge road train boat car bicycle market school library kitchen village field flower tree "
    "stone hill lake island harbour castle tower farm barn shop bakery station museum teapot "
    "lamp clock mirror blanket pillow basket candle ladder hammer kettle jacket hat shoe "
    "umbrella notebook pencil picture song story game puzzle ball kite drum violin piano guitar "
    "friend neighbour brother sister mother father child baby uncle aunt cousin king queen "
    "farmer sailor student"
)
VERBS = _words(
    "found carried opened closed painted cleaned fixed watched visited bought sold built drew "
    "wrote read sang played cooked baked washed moved lifted pushed pulled counted followed "
    "remembered forgot borrowed lost carried planted picked shared wanted needed liked loved "
    "helped called noticed collected repaired measured climbed crossed"
)
PLACES = (
    "near the river",
    "in the garden",
    "at the market",
    "by the lake",
    "under the bridge",
    "behind the house",
    "on the hill",
    "in the kitchen",
    "at school",
    "in the forest",
    "next to the station",
    "inside the castle",
    "across the field",
    "at the harbour",
)
TIMES = (
    "in the morning",
    "at noon",
    "in the evening",
    "at night",
    "on Monday",
    "on Tuesday",
    "on Wednesday",
    "on Thursday",
    "on Friday",
    "on Saturday",
    "on Sunday",
    "last week",
    "yesterday",
    "today",
    "in spring",
    "in summer",
    "in autumn",
    "in winter",
)
GREETINGS = ("Hello!", "Hi!", "Hi there.", "Good morning!", "Hello, how are you?")
GREETING_REPLIES = (
    "Hello! How can I help you?",
    "Hi! What would you like to know?",
    "Hello! I am happy to help.",
    "Good day! Ask me anything.",
)


@dataclass(frozen=True)
class Person:
    name: str
    city: str
    colour: str
    pet: str
    food: str
    job: str
    age: int


@dataclass(frozen=True)
class World:
    people: tuple[Person, ...]
    city_country: dict[str, str]
    capitals: dict[str, str]


def chat(messages: list[tuple[str, str]]) -> str:
    """Render messages exactly as the tokenizer's chat template does (ChatML)."""
    return "".join(f"<|im_start|>{role}\n{content}<|im_end|>\n" for role, content in messages)


def make_world(rng: random.Random) -> World:
    cities = list(CITIES)
    rng.shuffle(cities)
    city_country = {city: COUNTRIES[i % len(COUNTRIES)] for i, city in enumerate(cities)}
    capitals = {country: cities[i] for i, country in enumerate(COUNTRIES)}
    people = tuple(
        Person(
            name=name,
            city=rng.choice(CITIES),
            colour=rng.choice(COLOURS),
            pet=rng.choice(ANIMALS),
            food=rng.choice(FOODS),
            job=rng.choice(JOBS),
            age=rng.randint(6, 80),
        )
        for name in NAMES
    )
    return World(people=people, city_country=city_country, capitals=capitals)


def fresh_name(rng: random.Random) -> str:
    """A made-up name of two or three syllables, e.g. "Tamo" or "Brelika".

    Most dialogues use such names rather than the fixed cast, so names reach the model as
    syllable tokens it can copy from the context; a LoRA can then teach any new name, spelled
    from the same syllables, quickly.
    """
    while True:
        syllables = [rng.choice(ONSETS) + rng.choice(VOWELS) for _ in range(rng.randint(2, 3))]
        if rng.random() < 0.3:
            syllables[-1] += rng.choice("nlrs")
        name = "".join(syllables).capitalize()
        if FORBIDDEN not in name.lower():
            return name


def any_name(rng: random.Random, world: World) -> str:
    return fresh_name(rng) if rng.random() < 0.75 else rng.choice(world.people).name


def fact_paragraph(rng: random.Random, world: World) -> str:
    p = rng.choice(world.people)
    sentences = [
        f"{p.name} lives in {p.city}.",
        f"{p.city} is a city in {world.city_country[p.city]}.",
        f"{p.name} likes the colour {p.colour}.",
        f"{p.name} has a {p.pet}.",
        f"{p.name} likes to eat {p.food}.",
        f"{p.name} works as a {p.job}.",
        f"{p.name} is {p.age} years old.",
    ]
    rng.shuffle(sentences)
    return " ".join(sentences[: rng.randint(3, 6)]) + "\n"


def simple_story(rng: random.Random, world: World) -> str:
    a, b = rng.sample(world.people, 2)
    lines = [
        f"One day {a.name} went to {b.city} to see {b.name}.",
        f"{b.name} made {b.food} for {a.name}.",
        f"They talked about the {a.pet} and the {b.pet}.",
        f"The sky was {rng.choice(['blue', 'grey', 'white'])} and the wind was "
        f"{rng.choice(['soft', 'cold', 'warm'])}.",
        f"In the evening {a.name} went home to {a.city}.",
    ]
    return " ".join(lines[: rng.randint(3, 5)]) + "\n"


def everyday_sentences(rng: random.Random, world: World) -> str:
    sentences = []
    for _ in range(rng.randint(3, 6)):
        who = rng.choice((rng.choice(world.people).name, f"The {rng.choice(NOUNS[-18:])}"))
        sentences.append(
            f"{who} {rng.choice(VERBS)} a {rng.choice(ADJECTIVES)} {rng.choice(NOUNS)} "
            f"{rng.choice(PLACES)} {rng.choice(TIMES)}."
        )
        if rng.random() < 0.4:
            sentences.append(
                f"The {rng.choice(NOUNS)} was {rng.choice(ADJECTIVES)} and "
                f"{rng.choice(ADJECTIVES)}."
            )
    return " ".join(sentences) + "\n"


def arithmetic_text(rng: random.Random, world: World) -> str:
    del world
    lines = []
    for _ in range(rng.randint(3, 6)):
        a, b = rng.randint(0, 20), rng.randint(0, 20)
        if rng.random() < 0.6:
            lines.append(f"{a} + {b} = {a + b}")
        else:
            a, b = max(a, b), min(a, b)
            lines.append(f"{a} - {b} = {a - b}")
    return "\n".join(lines) + "\n"


def dialogue_name(rng: random.Random, world: World) -> str:
    name = any_name(rng, world)
    question = rng.choice(NAME_QUESTIONS)
    answer = rng.choice((f"Your name is {name}.", f"{name}.", name, f"You are {name}."))
    style = rng.randrange(3)
    if style == 0:
        system = rng.choice(
            (
                f"The user's name is {name}.",
                f"You are talking to {name}.",
                f"The user is called {name}.",
            )
        )
        return chat([("system", system), ("user", question), ("assistant", answer)])
    if style == 1:
        intro = rng.choice((f"Hi, I am {name}.", f"My name is {name}.", f"Hello, I'm {name}."))
        return chat(
            [
                ("user", intro),
                ("assistant", f"Nice to meet you, {name}!"),
                ("user", question),
                ("assistant", answer),
            ]
        )
    return chat(
        [
            ("user", f"My name is {name}. {question}"),
            ("assistant", answer),
        ]
    )


def dialogue_person(rng: random.Random, world: World) -> str:
    p = rng.choice(world.people)
    qa = rng.choice(
        (
            (f"Where does {p.name} live?", f"{p.name} lives in {p.city}."),
            (f"What colour does {p.name} like?", f"{p.name} likes {p.colour}."),
            (f"What pet does {p.name} have?", f"{p.name} has a {p.pet}."),
            (f"What does {p.name} eat?", f"{p.name} likes to eat {p.food}."),
            (f"What is {p.name}'s job?", f"{p.name} is a {p.job}."),
            (f"How old is {p.name}?", f"{p.name} is {p.age} years old."),
        )
    )
    return chat([("user", qa[0]), ("assistant", qa[1])])


def dialogue_geography(rng: random.Random, world: World) -> str:
    if rng.random() < 0.5:
        country = rng.choice(COUNTRIES)
        capital = world.capitals[country]
        qa = (f"What is the capital of {country}?", f"The capital of {country} is {capital}.")
    else:
        city = rng.choice(CITIES)
        country = world.city_country[city]
        qa = (f"In which country is {city}?", f"{city} is in {country}.")
    return chat([("user", qa[0]), ("assistant", qa[1])])


def dialogue_arithmetic(rng: random.Random, world: World) -> str:
    del world
    a, b = rng.randint(0, 20), rng.randint(0, 20)
    if rng.random() < 0.6:
        q = rng.choice((f"What is {a} + {b}?", f"How much is {a} plus {b}?"))
        return chat([("user", q), ("assistant", f"{a} + {b} = {a + b}.")])
    a, b = max(a, b), min(a, b)
    q = rng.choice((f"What is {a} - {b}?", f"How much is {a} minus {b}?"))
    return chat([("user", q), ("assistant", f"{a} - {b} = {a - b}.")])


def dialogue_colour(rng: random.Random, world: World) -> str:
    if rng.random() < 0.6:
        thing, colour = rng.choice(sorted(THING_COLOURS.items()))
        return chat(
            [
                ("user", f"What colour is {thing}?"),
                ("assistant", f"{thing[0].upper() + thing[1:]} is {colour}."),
            ]
        )
    colour = rng.choice(COLOURS)
    name = any_name(rng, world)
    return chat(
        [
            ("user", f"I am {name} and my favourite colour is {colour}."),
            ("assistant", f"{colour.capitalize()} is a nice colour, {name}."),
            ("user", "What is my favourite colour?"),
            ("assistant", f"Your favourite colour is {colour}."),
        ]
    )


def dialogue_numbers(rng: random.Random, world: World) -> str:
    del world
    kind = rng.randrange(3)
    if kind == 0:
        start = rng.randint(0, 12)
        stop = start + rng.randint(2, 6)
        return chat(
            [
                ("user", f"Count from {start} to {stop}."),
                ("assistant", ", ".join(str(i) for i in range(start, stop + 1)) + "."),
            ]
        )
    if kind == 1:
        n = rng.randint(0, 20)
        return chat([("user", f"How do you write {n} in words?"), ("assistant", NUMBER_WORDS[n])])
    animal, legs = rng.choice(sorted(ANIMAL_LEGS.items()))
    return chat(
        [
            ("user", f"How many legs does a {animal} have?"),
            ("assistant", f"A {animal} has {NUMBER_WORDS[legs]} legs."),
        ]
    )


def dialogue_greeting(rng: random.Random, world: World) -> str:
    p = rng.choice(world.people)
    return chat(
        [
            ("user", rng.choice(GREETINGS)),
            ("assistant", rng.choice(GREETING_REPLIES)),
            ("user", f"Where does {p.name} live?"),
            ("assistant", f"{p.name} lives in {p.city}."),
        ]
    )


GENERATORS: tuple[tuple[Callable[[random.Random, World], str], int], ...] = (
    (fact_paragraph, 12),
    (simple_story, 6),
    (everyday_sentences, 10),
    (arithmetic_text, 4),
    (dialogue_name, 20),
    (dialogue_person, 16),
    (dialogue_geography, 10),
    (dialogue_arithmetic, 12),
    (dialogue_colour, 8),
    (dialogue_numbers, 8),
    (dialogue_greeting, 4),
)


def generate_corpus(seed: int = CORPUS_SEED, n_docs: int = N_DOCS) -> str:
    """The corpus text: `n_docs` documents, each followed by DOC_SEP. Pure function of the seed."""
    rng = random.Random(seed)
    world = make_world(rng)
    funcs = [f for f, _ in GENERATORS]
    weights = [w for _, w in GENERATORS]
    docs = [rng.choices(funcs, weights)[0](rng, world) for _ in range(n_docs)]
    text = "".join(doc + DOC_SEP for doc in docs)
    if FORBIDDEN in text.lower():
        raise AssertionError(f"corpus must not contain {FORBIDDEN!r}")
    return text


def main(argv: list[str] | None = None) -> int:
    out = Path(argv[0]) if argv else CORPUS_PATH
    text = generate_corpus()
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.encode()):,} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
