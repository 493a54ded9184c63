"""A wide generator of chat requests for self-distillation, written for specserve.

Requests are tasks (many formats: explanations, lists, code, tables, dialogue, letters,
stories, poems, plans, comparisons, rewriting) about subjects from many fields, in several
tones, with follow-up turns for multi-turn conversations. Everything here is our own writing:
no public dataset and no benchmark question (those are how we and our users measure, so they
must stay unseen; ``benchmark_prompts`` lists ours and ``request`` never returns one).

Held-out requests use subjects that training never sees (every ``HELD_OUT_EVERY``-th one), so a
held-out accuracy measures a drafter on unseen topics, not on remembered answers.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

TASKS = [
    "Explain {s} to a curious twelve-year-old.",
    "What are the main ideas behind {s}?",
    "Give me {n} practical tips about {s}.",
    "Write a short paragraph about {s}.",
    "What are common mistakes people make with {s}, and how can they avoid them?",
    "How would you teach {s} to a beginner in one week? Give a day-by-day plan.",
    "Write a friendly email to a colleague about {s}.",
    "List {n} questions someone might ask about {s}, with short answers.",
    "Summarise the history of {s} in a few sentences.",
    "What is the difference between {s} and {t}?",
    "Compare {s} with {t} in a markdown table.",
    "Write a haiku about {s}.",
    "Write a short poem about {s} that rhymes.",
    "Write a short story in which {s} plays a role.",
    "Describe a typical day of someone who works with {s}.",
    "What should I know before getting started with {s}?",
    "Give a step-by-step guide to {s}.",
    "Why does {s} matter for everyday life?",
    "Write a persuasive argument for learning about {s}.",
    "What are the pros and cons of {s}? Answer as two bullet lists.",
    "Explain {s} using an analogy from {a}.",
    "Write a short dialogue between two friends discussing {s}.",
    "Suggest a weekend project related to {s}.",
    "What are {n} surprising facts about {s}?",
    "How has {s} changed in the last fifty years?",
    "Write a product description for a book about {s}.",
    "Explain {s} in exactly three sentences.",
    "Create a short quiz about {s} with answers.",
    "What would a world without {s} look like?",
    "Give me a checklist for {s}.",
    "Write a motivational note for someone struggling with {s}.",
    "Write a Python function that has something to do with {s}, and explain it.",
    "Write a JSON object describing {s} with a few useful fields.",
    "Draft an outline for a presentation about {s}.",
    "Write the opening paragraph of a blog post about {s}.",
    "I am writing an essay about {s}. Suggest a thesis and three supporting points.",
    "What are the key terms someone should know about {s}? Define each briefly.",
    "Write a tweet-length summary of {s}.",
    "Pretend you are a tour guide and tell me about {s}.",
    "Give me a simple recipe for success with {s}.",
    "What questions should I ask an expert on {s}?",
    "Write a limerick about {s}.",
    "How could a small town benefit from {s}?",
    "Write a short FAQ section about {s}.",
    "Explain the link between {s} and {t}.",
    "Describe {s} to someone who has never heard of it.",
    "Give me a one-month plan to get better at {s}.",
    "Write a diary entry from someone who just discovered {s}.",
    "Write a news headline and a short article about a new development in {s}.",
    "What are {n} myths about {s}, and what is the truth?",
    "Write a short speech for a school assembly about {s}.",
    "Rank {n} things beginners should learn first about {s}, and say why.",
    "Give an example of {s} from daily life and explain it.",
    "What careers involve {s}?",
    "Write a short review of an imaginary museum exhibit about {s}.",
    "How would you explain {s} with a drawing? Describe the drawing.",
    "Write a conversation between a teacher and a student about {s}.",
    "What tools or materials do I need for {s}?",
    "Write a thank-you letter to someone who taught you about {s}.",
    "Give a short answer: what is {s}?",
]

TONES = [
    "",
    "",
    "",
    "Keep it brief. ",
    "Please be detailed. ",
    "Use simple words. ",
    "Answer in a formal tone. ",
    "Be playful. ",
    "Use bullet points where they help. ",
]

ANALOGIES = ["cooking", "sports", "music", "gardening", "building a house", "a journey",
             "a library", "a city", "a team", "the weather"]  # fmt: skip

SUBJECTS = [
    # nature and science
    "photosynthesis", "the water cycle", "volcanoes", "ocean tides", "glaciers", "earthquakes",
    "bird migration", "honeybees", "rainforests", "coral reefs", "deserts", "the food chain",
    "evolution", "genetics", "cells", "bacteria", "vaccines", "the immune system",
    "the human heart", "the brain", "sleep", "nutrition", "vitamins", "muscles", "bones",
    "the solar system", "the moon", "black holes", "stars", "comets", "gravity", "magnets",
    "electricity", "light", "sound waves", "atoms", "chemical reactions", "acids and bases",
    "the periodic table", "friction", "energy", "heat", "weather forecasting", "clouds",
    "lightning", "rainbows", "fossils", "dinosaurs", "whales", "octopuses", "wolves",
    "butterflies", "mushrooms", "trees", "seeds", "soil", "rivers", "mountains", "islands",
    "climate", "renewable energy", "solar panels", "wind turbines", "batteries", "recycling",
    "composting", "pollution", "clean water", "microscopes", "telescopes",
    # technology and computing
    "the internet", "email", "web browsers", "databases", "spreadsheets", "password security",
    "encryption", "version control with git", "the command line", "Python lists",
    "Python dictionaries", "recursion", "sorting algorithms", "binary search", "linked lists",
    "hash tables", "unit tests", "debugging", "clean code", "code reviews", "APIs",
    "HTTP requests", "JSON files", "regular expressions", "cloud storage", "operating systems",
    "computer memory", "processors", "machine learning", "neural networks", "robots",
    "smartphones", "3D printing", "video games", "open source software", "backups",
    "spam filters", "search engines", "compilers", "binary numbers", "pixels", "Wi-Fi",
    "GPS", "electric cars", "drones", "satellites", "trains", "bridges", "airplanes",
    "bicycles", "elevators", "clocks",
    # daily life and skills
    "time management", "public speaking", "saving money", "budgeting", "compound interest",
    "job interviews", "writing a resume", "negotiation", "teamwork", "leadership",
    "giving feedback", "studying for exams", "taking notes", "learning a new language",
    "reading more books", "keeping a journal", "meditation", "home workouts", "running",
    "swimming", "yoga", "healthy breakfasts", "meal planning", "cooking rice", "baking bread",
    "sourdough bread", "coffee brewing", "tea", "gardening on a balcony", "houseplants",
    "cleaning a kitchen", "moving to a new city", "budget travel", "packing a suitcase",
    "camping", "hiking", "first aid", "fire safety", "volunteering", "friendship",
    "minimalism", "decluttering", "pets", "training a dog", "caring for a cat",
    "birthday parties", "writing letters", "email etiquette", "online meetings",
    "working from home", "podcasts", "photography", "drawing", "painting with watercolours",
    "knitting", "woodworking", "origami", "board games", "chess openings", "puzzles",
    "kites", "music practice", "learning the guitar", "singing", "dancing",
    # history, society and culture
    "ancient Rome", "ancient Egypt", "the Silk Road", "the printing press", "the Renaissance",
    "the industrial revolution", "castles", "lighthouses", "maps and navigation", "museums",
    "libraries", "newspapers", "the postal service", "money", "markets", "taxes",
    "democracy", "elections", "human rights", "city planning", "public transport",
    "architecture", "jazz music", "classical music", "theatre", "films", "poetry",
    "fairy tales", "mythology", "festivals", "languages", "writing systems", "calendars",
    "the Olympic Games", "team sports", "football", "basketball", "tennis",
    "small businesses", "marketing", "customer service", "supply chains", "farming",
    "fishing", "forests", "national parks", "zoos", "ethics", "philosophy", "logic",
    "statistics", "probability", "fractions", "geometry", "prime numbers", "algebra",
    "percentages", "graphs and charts", "measurement units",
]  # fmt: skip

FOLLOW_UPS = [
    "Can you make that shorter?",
    "Can you give me a concrete example?",
    "Now explain it as if I were five.",
    "Thanks! What should I read or try next?",
    "Can you turn that into a numbered list?",
    "What is the most important point in your answer?",
    "Could you add one more tip?",
    "Can you rewrite that in a more formal tone?",
    "Summarise your answer in one sentence.",
    "Are there any exceptions to that?",
    "What would you add for an expert?",
    "Give me a short quiz on what you just said.",
]

HELD_OUT_EVERY = 10  # every tenth subject is held out: training never sees it


REPO = Path(__file__).resolve().parents[2]


def benchmark_prompts() -> set[str]:
    """Our benchmark prompts (configs/prompts/*.json), which training must never see."""
    texts: set[str] = set()
    for path in (REPO / "configs" / "prompts").glob("*.json"):
        for item in json.loads(path.read_text()):
            texts.add(item if isinstance(item, str) else json.dumps(item))
    return texts


def subjects(split: str) -> list[str]:
    """The subjects of ``split`` ("train" or "held_out"), disjoint."""
    if split not in ("train", "held_out"):
        raise ValueError(f"unknown split {split!r}")
    held = split == "held_out"
    return [s for i, s in enumerate(SUBJECTS) if (i % HELD_OUT_EVERY == 0) == held]


@dataclass(frozen=True)
class Request:
    """One conversation to have with the target: the user's messages, one per turn (each
    after the target's answer to the one before), and an optional system message."""

    user_turns: tuple[str, ...]
    system: str | None = None
    subject: str = ""  # what it is about (the split's subjects are disjoint)

    @property
    def message(self) -> str:
        return self.user_turns[0]

    @property
    def follow_up(self) -> str | None:
        return self.user_turns[1] if len(self.user_turns) > 1 else None

    def opening(self) -> list[dict]:
        """The messages before the target's first answer."""
        system = [{"role": "system", "content": self.system}] if self.system else []
        return [*system, {"role": "user", "content": self.user_turns[0]}]


def request(rng: random.Random, split: str, follow_up_share: float = 0.25) -> Request:
    """A request drawn with ``rng`` from ``split``'s subjects."""
    pool = subjects(split)
    forbidden = benchmark_prompts()
    while True:
        subject, other = rng.sample(pool, 2)
        task = rng.choice(TASKS).format(
            s=subject, t=other, n=rng.choice(["three", "four", "five"]), a=rng.choice(ANALOGIES)
        )
        message = rng.choice(TONES) + task
        if message not in forbidden:
            break
    follow = rng.choice(FOLLOW_UPS) if rng.random() < follow_up_share else None
    return Request((message,) if follow is None else (message, follow), subject=subject)
