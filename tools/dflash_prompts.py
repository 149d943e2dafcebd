"""The prompts of SmolLM2's DFlash draft, tokenized here (the GPU machine has no tokenizer).

- ``heldout``: chat requests written for measuring, which training never sees: tau, tok/s and
  speculative == greedy are measured on them (tools/bench_dflash.py).
- ``seeds``: the start of a user turn (the chat template's default system message, then an
  opener such as "Explain"); tools/train_dflash.py lets the target write the rest of the request
  at temperature 1, then answer it. So the training prompts are what the target generates itself.

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


def chat_tokens(tok, user: str, open_turn: bool) -> list[int]:
    """A one-user-turn chat prompt: the whole request with the assistant's turn opened, or (not
    ``open_turn``) cut after ``user`` so that the model writes the rest of the request."""
    from lucepy.server.chat import chat_text

    text = chat_text(tok, [{"role": "user", "content": user}])
    if not open_turn:
        text = text[: text.index(user) + len(user)]
    return tok.encode(text, special=True)


def build(model: Path) -> dict:
    from lucepy.runtime.tokenizer import Tokenizer

    tok = Tokenizer(model)
    try:
        turn_end = tok.encode("<|im_end|>", special=True)
        assistant = tok.encode("<|im_end|>\n<|im_start|>assistant\n", special=True)
        return {
            "model": model.name,
            "end": turn_end,  # the token that ends a turn (the request's, the answer's)
            "assistant": assistant,  # appended to a written request: the answer's turn opens
            "heldout_text": HELDOUT,
            "heldout": [chat_tokens(tok, p, True) for p in HELDOUT],
            "seeds": [chat_tokens(tok, o, False) for o in OPENERS],
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
    args.out.write_text(json.dumps(data) + "\n")
    print(f"{args.out}: {len(data['heldout'])} held-out prompts, {len(data['seeds'])} seeds")


if __name__ == "__main__":
    main()
