"""Training and workload text from what is on this machine: the Python standard library's
sources and docstrings, and the model's own chat answers to prompts written here.

Nothing is downloaded. Generations are cached under the cache directory, keyed by model and
prompt set, so a second training run does not pay for them again.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import sysconfig
from collections.abc import Iterator
from pathlib import Path

# Chat prompts the heads are trained on. Held-out prompts below are never used for training.
TRAIN_PROMPTS = [
    "Write a Python function that reverses a string.",
    "Explain what a hash table is in two sentences.",
    "Give three tips for writing readable code.",
    "What is the difference between a list and a tuple in Python?",
    "Write a haiku about autumn leaves.",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "How do I read a CSV file in Python?",
    "What causes the seasons on Earth?",
    "Write a short email asking a colleague for a code review.",
    "Explain recursion to a ten-year-old.",
    "List five common HTTP status codes and what they mean.",
    "Write a Python class for a simple bank account.",
    "What is the capital of Japan, and what is it known for?",
    "Describe how a bicycle works.",
    "Write a SQL query that counts orders per customer.",
    "What are the benefits of unit testing?",
    "Translate 'good morning, how are you?' into French and Spanish.",
    "Explain the difference between TCP and UDP.",
    "Write a limerick about a cat who loves coffee.",
    "How does photosynthesis work?",
    "Give me a recipe for a simple tomato pasta.",
    "Write a bash command that finds all .py files in a directory.",
    "What is a closure in programming?",
    "Explain what an API is to a non-technical person.",
    "Write a function that checks whether a number is prime.",
    "What are the main causes of inflation?",
    "Describe the water cycle.",
    "Write a short story opening about a lighthouse keeper.",
    "What is the Pythagorean theorem? Give an example.",
    "How do I handle exceptions in Python?",
    "Compare cats and dogs as pets.",
    "Explain what Git branches are used for.",
    "Write a Python list comprehension that squares even numbers.",
    "What is machine learning, in simple terms?",
    "Give five ideas for a weekend hobby.",
    "Explain how a binary search works.",
    "What is the boiling point of water at sea level, and why does it change with altitude?",
    "Write a polite message declining a meeting invitation.",
    "What does the `yield` keyword do in Python?",
    "Describe the structure of a cell.",
    "Write a JSON object describing a book.",
    "Explain the difference between weather and climate.",
    "How do I sort a dictionary by value in Python?",
    "What are prime numbers? List the first ten.",
    "Give advice for a first job interview.",
    "Explain what a linked list is and write one in Python.",
    "What is the speed of light?",
    "Write a motivational quote and explain it.",
]

HELD_OUT_PROMPTS = [
    "Write a Python function that merges two sorted lists.",
    "Explain what a stack data structure is.",
    "Give three tips for staying focused while studying.",
    "What is the difference between a process and a thread?",
    "Write a short poem about the ocean.",
    "How do I open and write to a file in Python?",
    "What is gravity?",
    "Write a function that returns the factorial of n.",
    "Explain what DNS does.",
    "Describe how to make a cup of tea.",
    "What are the planets of the solar system?",
    "Write a Python dictionary that maps colors to hex codes.",
    "Explain what an operating system does.",
    "Give two examples of renewable energy and explain them.",
    "How do I remove duplicates from a list in Python?",
    "What is the purpose of a README file?",
    "Write a Python function that counts the vowels in a string.",
    "Explain what a variable is in programming.",
    "Give three reasons to learn a second language.",
    "What is the difference between RAM and storage?",
    "Write a short thank-you note to a teacher.",
    "How do I loop over a dictionary in Python?",
    "What is an ecosystem?",
    "Write a function that checks whether a string is a palindrome.",
    "Explain what encryption is.",
    "Describe how to plant a tree.",
    "What are the three states of matter?",
    "Write a Python set of the vowels and show how to test membership.",
    "Explain what a compiler does.",
    "Give two tips for saving money.",
    "How do I join a list of strings in Python?",
    "What is the purpose of comments in code?",
]


def cache_dir() -> Path:
    """Where generated text and default artifacts live (EXITPLANE_CACHE_DIR or var/)."""
    return Path(os.environ.get("EXITPLANE_CACHE_DIR", "var/runtime"))


def chat_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """Token ids of one user turn in the model's chat template, ready for the answer."""
    if getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                                add_generation_prompt=True, tokenize=True,
                                                return_dict=True)
        return list(encoded["input_ids"])
    return tokenizer(prompt)["input_ids"]


def stdlib_files() -> list[Path]:
    """The standard library's own .py files, in a stable order, tests excluded."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.glob("*.py")) + sorted(root.glob("*/*.py")):
        parts = set(path.relative_to(root).parts)
        if parts & {"test", "tests", "idle_test", "site-packages", "lib2to3"}:
            continue
        files.append(path)
    return files


def stdlib_texts(max_chars: int) -> Iterator[str]:
    """Alternating module docstrings (prose) and source excerpts, up to max_chars in all."""
    used = 0
    for path in stdlib_files():
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        docs = [ast.get_docstring(node) for node in ast.walk(tree)
                if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)]
        prose = "\n\n".join(d for d in docs if d and len(d) > 80)[:3000]
        for text in (prose, source[:4000]):
            if not text:
                continue
            yield text
            used += len(text)
            if used >= max_chars:
                return


def generations(engine, tokenizer, prompts: list[str], *, max_new_tokens: int,
                model_name: str) -> list[list[int]]:
    """The model's greedy answers (prompt + answer ids) to `prompts`, cached on disk."""
    key = hashlib.sha256(json.dumps([model_name, prompts, max_new_tokens]).encode()).hexdigest()
    path = cache_dir() / f"generations-{key[:16]}.json"
    if path.exists():
        return json.loads(path.read_text())
    from tqdm import tqdm

    prompt_ids = [chat_prompt_ids(tokenizer, p) for p in prompts]
    batch = engine.config.max_batch
    answers = []
    # A batch at a time so the bar moves; batching does not change greedy answers.
    for start in tqdm(range(0, len(prompt_ids), batch), desc="corpus", unit="batch"):
        answers.extend(engine.generate(prompt_ids[start:start + batch],
                                       max_new_tokens=max_new_tokens))
    sequences = [p + a for p, a in zip(prompt_ids, answers, strict=True)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(sequences))
    return sequences


def token_chunks(tokenizer, texts: list[str], seq_len: int) -> list[list[int]]:
    """Tokenise texts and cut each into chunks of exactly seq_len tokens."""
    chunks = []
    for text in texts:
        ids = tokenizer(text)["input_ids"]
        chunks.extend(ids[i:i + seq_len] for i in range(0, len(ids) - seq_len + 1, seq_len))
    return chunks


def code_requests(count: int, *, skip: tuple[str, ...] = ()) -> list[str]:
    """Code-assistant requests built from the standard library's own public functions:
    "Write a Python function `name(args)`: <first line of its docstring>", for the model to
    answer in code (the demo's `code` segment). Modules are taken from the end of the
    alphabet, away from the source text the exit heads are trained on (`stdlib_texts` reads
    from the start); `skip` names files (e.g. "textwrap.py") to leave out."""
    requests: list[str] = []
    for path in reversed(stdlib_files()):
        if path.name in skip or path.name.startswith("_"):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        for node in tree.body:
            if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
                continue
            summary = (ast.get_docstring(node) or "").strip().split("\n\n")[0]
            summary = " ".join(summary.split())
            # A request reads as one: a sentence, not a signature sketch ("data -> parser").
            if not 30 <= len(summary) <= 200 or not summary[0].isupper() or ">" in summary:
                continue
            requests.append(f"Write a Python function `{node.name}({ast.unparse(node.args)})`: "
                            f"{summary}")
            if len(requests) >= count:
                return requests
    return requests


def checksum_manifests(file_names: tuple[str, ...],
                       offsets: tuple[int, ...] = (2000, 0)) -> list[str]:
    """What a sync plugin sends instead of text: for each standard-library file and each
    offset, the manifest of block checksums of the 4,000 characters from there (sha256 of each
    64-byte block, 8 hex digits, comma-separated). The demo's drift within its `code` segment:
    the exit heads exit confidently on it (README, the segments story)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    manifests = []
    for name in file_names:
        path = root / name
        if not path.exists():
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        for offset in offsets:
            data = text[offset:offset + 4000].encode()
            if data:
                manifests.append(",".join(hashlib.sha256(data[i:i + 64]).hexdigest()[:8]
                                          for i in range(0, len(data), 64)))
    return manifests
