"""Replay prompt-lookup speculation offline on bench/spec_decode.py's outputs, to compare
draft policies without serving them (issue #28).

For each prompt of a run (`<run-dir>/runs/<workload>.prompts.json`, its chat template
applied) and the output llmserve gave without drafts (`llmserve-<workload>.json`, greedy, so
the output with drafts is the same), the proposer drafts as the scheduler would and a draft
counts as kept while it equals the output. The time of the decode is modelled per step from
the Xeon's served figures (bench/RESULTS.md, "Speculative decoding, fourth round": the
worker's forward and forward-gap histograms over the text workload): a one-row step
`--step-ms`, each draft row `--row-ms` more, and the round trip to the scheduler `--sync-ms`
after a step with drafts (the next one is built after its result) against `--async-ms` after
a plain one (continued by asynchronous scheduling). The first step of a run of drafted steps
pays the round trip twice: the plain step before it is not continued while a draft waits
(`Speculator.waits_for_draft`). The earlier rounds' AMD EPYC figures were a 6.6 ms step,
1.6 ms rows and a 1.7 ms round trip. Prints, per workload and policy, the modelled decode
speed with drafts over without.

    .venv/bin/python bench/spec_replay.py bench/results/spec-decode-r3c --workloads code text random
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from scheduler_service.engine.proposer import NgramIndex, NgramProposer  # noqa: E402

# A policy: (min_n, max_n, k, cap drafts by the match's length).
POLICIES = {
    "K5 n2-4 uncapped": (2, 4, 5, False),
    "K8 n2-4 uncapped": (2, 4, 8, False),
    "K5 n2-4 capped": (2, 4, 5, True),
    "K8 n2-6 capped": (2, 6, 8, True),
    "K12 n2-6 capped": (2, 6, 12, True),
}


def proposer_for(min_n: int, max_n: int, k: int, capped: bool) -> Callable[[NgramIndex], list]:
    if capped:
        proposer = NgramProposer(min_n, max_n, k)
        return lambda index: proposer.propose(index, k)

    def uncapped(index: NgramIndex) -> list[int]:
        match = index.longest_match()
        return [] if match is None else index.tokens[match[1] : match[1] + k]

    return uncapped


def replay(prompt: list[int], output: list[int], policy: tuple, args: argparse.Namespace) -> float:
    """Modelled milliseconds to decode `output` after its first token, with drafts."""
    min_n, max_n, k, capped = policy
    propose = proposer_for(min_n, max_n, k, capped)
    index = NgramIndex(min_n, max_n, [*prompt, output[0]])
    done, ms, drafted_before = 1, 0.0, False
    while done < len(output):
        drafts = propose(index)[: len(output) - done - 1]
        kept = 0
        while kept < len(drafts) and drafts[kept] == output[done + kept]:
            kept += 1
        new = output[done : done + kept + 1]
        ms += args.step_ms + args.row_ms * len(drafts)
        ms += args.sync_ms if drafts else args.async_ms
        if drafts and not drafted_before:  # the step before waited for its result too
            ms += args.sync_ms - args.async_ms
        drafted_before = bool(drafts)
        index.extend(new)
        done += len(new)
    return ms


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="a bench/spec_decode.py --out-dir")
    p.add_argument("--workloads", nargs="+", default=["code", "text"])
    p.add_argument("--tokenizer", default="/tmp/bench/smollm2-hf")
    p.add_argument("--step-ms", type=float, default=14.2)
    p.add_argument("--row-ms", type=float, default=2.6)
    p.add_argument("--sync-ms", type=float, default=3.1)
    p.add_argument("--async-ms", type=float, default=0.3)
    args = p.parse_args()
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    print(f"| workload | {' | '.join(POLICIES)} |")
    print(f"|---|{'---|' * len(POLICIES)}")
    for workload in args.workloads:
        bodies = json.loads((args.run_dir / "runs" / f"{workload}.prompts.json").read_text())
        replies = json.loads((args.run_dir / "runs" / f"llmserve-{workload}.json").read_text())
        pairs = []
        for body, reply in zip(bodies, replies["requests"], strict=True):
            if "messages" in body:
                text = tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=False
                )
            else:  # random: a completion of token ids' text, as the server tokenizes it
                text = body["prompt"]
            prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
            output = tokenizer(reply["text"], add_special_tokens=False)["input_ids"]
            if len(output) > 1:
                pairs.append((prompt, output))
        plain = sum((len(o) - 1) * (args.step_ms + args.async_ms) for _, o in pairs)
        cells = [
            f"{plain / sum(replay(pr, o, policy, args) for pr, o in pairs):.2f}x"
            for policy in POLICIES.values()
        ]
        print(f"| {workload} | {' | '.join(cells)} |")


if __name__ == "__main__":
    main()
