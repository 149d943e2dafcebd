"""The prompts of SmolLM2's DFlash draft, tokenized here (the GPU machine has no tokenizer).

- ``heldout``: chat requests written for measuring, which training never sees: tau, tok/s and
  speculative == greedy are measured on them (tools/bench_dflash.py).
- ``seeds``: the start of a user turn after ``seed_head`` (the chat template's default system
  message and the user's turn opened): an opener such as "Explain", or a template filled with a
  topic ("Write a short story about a lighthouse keeper"), 7,000 and more in all.
  tools/train_dflash.py lets the target write the rest of the request at temperature 1, then
  answer it. So the training prompts are what the target generates itself. The topics were
  chosen apart from the held-out prompts' subjects.

Writes tools/dflash_prompts.json:
    python3 tools/dflash_prompts.py [MODEL.gguf]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HELDOUT = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about the ocean at night.",
    "What are three tips for staying focused while studying?",
    "How do I make a cup of green tea?",
    "Describe the water cycle in simple terms.",
    "Write a Python function that checks whether a number is prime.",
    "What is the difference between weather and climate?",
    "Give me a recipe for a simple tomato pasta.",
    "Why is the sky blue?",
    "Summarize the plot of Romeo and Juliet.",
    "What are the benefits of regular exercise?",
    "How does a bicycle stay upright when it moves?",
    "Write an email to a colleague asking to move our meeting to Friday.",
    "List five countries in South America and their capitals.",
    "Explain what photosynthesis is to a ten-year-old.",
    "What should I pack for a weekend camping trip?",
    "How do vaccines help the body fight disease?",
    "Write a short story about a robot who learns to paint.",
    "What is the Pythagorean theorem and how is it used?",
    "Give me some ideas for a birthday party for a six-year-old.",
    "How can I improve my sleep?",
    "Explain the difference between a list and a tuple in Python.",
    "What causes earthquakes?",
    "Describe a typical day in the life of a honeybee.",
]

OPENERS = [
    "Explain", "Write", "What", "How", "Why", "Describe", "Give me", "Can you", "List", "Tell me",
    "Summarize", "Compare", "I need", "Help me", "Create", "Suggest", "What is the best way to",
    "How do I", "Is it", "Which", "Who", "When", "Where", "Write a Python", "Write a story",
    "Write a poem", "Define", "Plan", "Recommend", "What are", "How many", "Could you", "Please",
    "I want to", "My", "In", "Generate", "Outline", "Calculate", "Solve", "Translate",
    "Write a letter", "Write an essay", "What happens", "Why do", "How does", "Name", "Rewrite",
    "Imagine", "What would", "Should I", "Do you know", "Teach me", "Show me", "Find",
    "Write a function", "What is the difference between", "Give an example of", "Is there",
    "Brainstorm",
]  # fmt: skip

TEMPLATES = [
    "Explain {}", "Tell me about {}", "Write a short poem about {}", "Write a short story about {}",
    "What is the history of {}", "Give me three facts about {}", "Describe {} in simple terms",
    "What are the pros and cons of {}", "How would you teach a child about {}",
    "Write a blog post about {}", "What are common mistakes people make with {}",
    "Summarize what you know about {}", "Write a haiku about {}", "Compare {} with something",
    "Why do people care about {}", "Give me a step-by-step guide to {}",
    "What questions should I ask about {}", "Write a dialogue between two friends about {}",
    "List some interesting things about {}", "What is the future of {}",
    "Write a Python program related to {}", "Can you help me understand {}",
    "Write a product description for {}", "What would happen without {}",
    "Create a quiz about {}", "Write a speech about {}", "What do experts say about {}",
    "Give me advice on {}", "Write a limerick about {}", "Plan a lesson about {}",
]  # fmt: skip

TOPICS = [
    "volcanoes", "the moon landing", "black holes", "saving money", "learning a new language",
    "the French Revolution", "electric cars", "coffee", "chess", "the Roman Empire", "dinosaurs",
    "machine learning", "public speaking", "gardening", "the stock market", "ancient Egypt",
    "renewable energy", "jazz music", "the human brain", "social media", "baking bread",
    "the internet", "running a marathon", "meditation", "cats", "dogs", "the solar system",
    "World War II", "recycling", "friendship", "time management", "the Olympic Games", "chocolate",
    "trains", "airplanes", "the printing press", "soccer", "basketball", "photography",
    "the piano", "knitting", "cooking rice", "a job interview", "writing a resume", "budgeting",
    "credit cards", "mortgages", "the immune system", "DNA", "the heart", "nutrition", "vitamins",
    "dental care", "the Great Wall of China", "the pyramids", "Shakespeare", "poetry", "novels",
    "libraries", "museums", "elephants", "whales", "sharks", "penguins", "owls", "rainforests",
    "deserts", "mountains", "rivers", "glaciers", "hurricanes", "tornadoes", "lightning", "snow",
    "the seasons", "gravity", "magnets", "electricity", "light", "sound", "atoms", "chemistry",
    "algebra", "geometry", "fractions", "probability", "statistics", "calculus", "video games",
    "board games", "puzzles", "magic tricks", "circuses", "theater", "movies", "cartoons",
    "comic books", "superheroes", "pirates", "knights", "castles", "dragons", "fairy tales",
    "mythology", "Greek gods", "the Vikings", "samurai", "the Renaissance",
    "the Industrial Revolution", "democracy", "elections", "taxes", "the United Nations",
    "human rights", "volunteering", "charity", "kindness", "leadership", "teamwork", "negotiation",
    "marketing", "starting a business", "customer service", "email etiquette", "remote work",
    "productivity apps", "spreadsheets", "databases", "SQL", "JavaScript", "HTML", "CSS", "Linux",
    "git", "sorting algorithms", "binary search", "recursion", "linked lists", "hash tables",
    "object-oriented programming", "unit testing", "debugging", "cybersecurity", "passwords",
    "encryption", "cloud computing", "smartphones", "batteries", "solar panels", "wind turbines",
    "nuclear power", "water pollution", "plastic waste", "composting", "houseplants", "succulents",
    "roses", "apple trees", "mushrooms", "farming", "tractors", "cheese", "pizza", "sushi",
    "tacos", "curry", "soup", "salads", "smoothies", "breakfast", "vegetarian diets",
    "food allergies", "grocery shopping", "meal prep", "kitchen knives", "a road trip",
    "visiting Paris", "visiting Japan", "learning to swim", "yoga", "hiking boots", "skiing",
    "surfing", "fishing", "bird watching", "stars and constellations", "telescopes", "Mars",
    "Jupiter", "comets", "satellites", "rockets", "the ocean floor", "coral reefs", "octopuses",
    "butterflies", "ants", "spiders", "frogs", "horses", "wolves", "lions", "a lighthouse keeper",
    "a lost key", "a haunted house", "a talking cat", "a time machine", "a small bakery",
    "a rainy afternoon", "the first day of school", "moving to a new city", "a family reunion",
    "a wedding speech", "a thank-you note", "an apology letter", "a cover letter",
    "a complaint to a landlord", "a book review", "a movie review", "a travel itinerary",
    "a workout plan", "a New Year's resolution", "habits", "motivation", "stress", "anxiety",
    "happiness", "gratitude", "journaling", "reading faster", "memory techniques", "note taking",
    "critical thinking", "logic puzzles", "riddles", "jokes", "emojis", "languages of the world",
    "grammar", "punctuation", "idioms", "the alphabet", "calligraphy", "origami", "pottery",
    "woodworking", "sewing", "fashion", "sneakers", "perfume", "architecture", "bridges",
    "skyscrapers", "tiny houses", "interior design", "furniture", "clocks", "maps", "compasses",
]  # fmt: skip


def chat_tokens(tok, user: str, open_turn: bool) -> list[int]:
    """A one-user-turn chat prompt: the whole request with the assistant's turn opened, or (not
    ``open_turn``) cut after ``user`` so that the model writes the rest of the request."""
    from lucepy.server.chat import chat_text

    text = chat_text(tok, [{"role": "user", "content": user}])
    if not open_turn:
        text = text[: text.index(user) + len(user)]
        text = text.removesuffix("\x01")  # the marker of the header alone
    return tok.encode(text, special=True)


def build(model: Path) -> dict:
    from lucepy.runtime.tokenizer import Tokenizer

    tok = Tokenizer(model)
    try:
        turn_end = tok.encode("<|im_end|>", special=True)
        assistant = tok.encode("<|im_end|>\n<|im_start|>assistant\n", special=True)
        head = chat_tokens(tok, "\x01", False)  # the header: the user's turn opened
        seeds = OPENERS + [t.format(topic) for t in TEMPLATES for topic in TOPICS]
        tails = []
        for text in seeds:
            whole = chat_tokens(tok, text, False)
            if whole[: len(head)] != head:
                raise SystemExit(f"the chat header does not tokenize apart from {text!r}")
            tails.append(whole[len(head) :])
        return {
            "model": model.name,
            "end": turn_end,  # the token that ends a turn (the request's, the answer's)
            "assistant": assistant,  # appended to a written request: the answer's turn opens
            "heldout_text": HELDOUT,
            "heldout": [chat_tokens(tok, p, True) for p in HELDOUT],
            "seed_head": head,
            "seeds": tails,
        }
    finally:
        tok.close()


def main() -> None:
    from lucepy.catalog import smollm2_file

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", type=Path, help="default: SmolLM2-135M-Instruct")
    ap.add_argument("--out", type=Path, default=Path(__file__).with_suffix(".json"))
    args = ap.parse_args()
    data = build(args.model or Path(smollm2_file()))
    args.out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    print(f"{args.out}: {len(data['heldout'])} held-out prompts, {len(data['seeds'])} seeds")


if __name__ == "__main__":
    main()
