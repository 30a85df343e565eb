"""Prompts the equality tests of several tiers share (no imports: the Ray tier's process stays light)."""

# Varied prompts for equality tests: prose, code, lists, unicode, a chat template, a repeated sentence.
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4,",
    "Translate to French: good morning",
    "Ünïcödé and emoji 🙂 test:",
    "The three primary colors are",
    "import numpy as np\nx = np.",
    "Q: What is 12 times 12?\nA:",
    "<|im_start|>user\nName a planet.<|im_end|>\n<|im_start|>assistant\n",
    "A haiku about autumn:\n",
    "SELECT name FROM users WHERE",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Water boils at",
    "List: apples, pears,",
    "In 1492,",
]
