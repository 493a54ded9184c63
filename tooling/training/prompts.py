"""Training prompts for drafters, written for specserve (no public dataset, no benchmark
questions: those are how we and our users measure, and must stay unseen).

Chat requests are built from task templates and subjects, both written here; the model's own
answers to them (``tooling.training.self_distillation``) are what a drafter learns to predict.
The held-out split is taken from the same generator with another seed and checked disjoint.
"""

from __future__ import annotations

import random

TEMPLATES = [
    "Explain {s} to a curious twelve-year-old.",
    "What are the main ideas behind {s}?",
    "Give me three practical tips about {s}.",
    "Write a short paragraph about {s}.",
    "What are common mistakes people make with {s}?",
    "How would you teach {s} to a beginner in one week?",
    "Write a friendly email to a colleague about {s}.",
    "List five questions someone might ask about {s}, with short answers.",
    "Summarise the history of {s} in a few sentences.",
    "What is the difference between {s} and {t}?",
    "Compare {s} with {t} in a short table.",
    "Write a haiku about {s}.",
    "Write a short story in which {s} plays a role.",
    "Describe a typical day of someone who works with {s}.",
    "What should I know before getting started with {s}?",
    "Give a step-by-step guide to {s}.",
    "Why does {s} matter for everyday life?",
    "Write a persuasive argument for learning about {s}.",
    "What are the pros and cons of {s}?",
    "Explain {s} using an analogy from cooking.",
    "Write a short dialogue between two friends discussing {s}.",
    "Suggest a weekend project related to {s}.",
    "What are three surprising facts about {s}?",
    "How has {s} changed in the last fifty years?",
    "Write a product description for a book about {s}.",
    "Explain {s} in exactly three sentences.",
    "Create a short quiz about {s} with answers.",
    "What would a world without {s} look like?",
    "Give me a checklist for {s}.",
    "Write a motivational note for someone struggling with {s}.",
]

SUBJECTS = [
    "photosynthesis",
    "compound interest",
    "the water cycle",
    "volcanoes",
    "sourdough bread",
    "public speaking",
    "time management",
    "recycling",
    "electric cars",
    "the solar system",
    "learning a new language",
    "gardening on a balcony",
    "chess openings",
    "the human heart",
    "saving money",
    "meditation",
    "rainforests",
    "the printing press",
    "bicycles",
    "healthy sleep",
    "writing a resume",
    "budget travel",
    "coffee brewing",
    "honeybees",
    "the immune system",
    "renewable energy",
    "ocean tides",
    "origami",
    "running a marathon",
    "keeping a journal",
    "board games",
    "weather forecasting",
    "the internet",
    "libraries",
    "composting",
    "bird migration",
    "painting with watercolours",
    "home workouts",
    "magnets",
    "the moon",
    "team sports",
    "cooking rice",
    "first aid",
    "volunteering",
    "earthquakes",
    "sorting algorithms",
    "Python lists",
    "version control with git",
    "spreadsheets",
    "password security",
    "databases",
    "writing unit tests",
    "recursion",
    "HTTP requests",
    "JSON files",
    "regular expressions",
    "the command line",
    "clean code",
    "debugging",
    "machine learning",
    "binary numbers",
    "cloud storage",
    "email etiquette",
    "podcasts",
    "houseplants",
    "dinosaurs",
    "glaciers",
    "bridges",
    "trains",
    "museums",
    "jazz music",
    "ancient Rome",
    "the Silk Road",
    "lighthouses",
    "maps and navigation",
    "kites",
    "friendship",
    "negotiation",
    "job interviews",
    "studying for exams",
    "minimalism",
]


def chat_prompts(count: int, seed: int) -> list[str]:
    """``count`` distinct requests from the templates and subjects, shuffled by ``seed``."""
    combos = []
    for template in TEMPLATES:
        for subject in SUBJECTS:
            if "{t}" in template:
                other = SUBJECTS[(SUBJECTS.index(subject) * 7 + 3) % len(SUBJECTS)]
                combos.append(template.format(s=subject, t=other))
            else:
                combos.append(template.format(s=subject))
    if count > len(combos):
        raise ValueError(f"only {len(combos)} distinct training prompts, asked for {count}")
    return random.Random(seed).sample(combos, count)


def train_and_held_out(num_train: int, num_held_out: int, seed: int = 0):
    """Disjoint training and held-out prompts."""
    prompts = chat_prompts(num_train + num_held_out, seed)
    return prompts[:num_train], prompts[num_train:]
