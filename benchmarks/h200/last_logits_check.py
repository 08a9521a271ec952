"""Issue 20: the draft extend's LM head at the last accepted rows (SGLANG_DYNSPEC_LAST_ACCEPTED_LOGITS)
checked at a real acceptance, with CUDA graphs, on the test bed's tiny counting pair.

The counting target follows token x with x + 1; its draft, given the target's state at a
position, proposes the token one further, which is right one step ahead. A proposal
taken from any other row of the draft extend is another position's token and is
rejected, so with ``--speculative-num-steps 1`` every verify step accepts both tokens
only if the kept row is the right one (the CPU bed's test with the first row kept
instead: 26 verify steps where full acceptance needs 21).

Usage (device, from benchmarks/h200/last_logits_check.sh): python3 last_logits_check.py URL LABEL
Prints one JSON line: requests, tokens, verify steps, tokens per verify step after the
prefill's first token, and whether every output counts up as the target alone emits.
"""

import json
import math
import sys

from dynspec_testbed.workload import random_requests, run_waves

# Six requests at once, below the threshold of 8: every decode step speculates.
WAVES = [random_requests(6, seed=61, prefix="count", new_tokens=(64, 64))]


def main(url: str, label: str) -> None:
    results = run_waves(url, WAVES, batched=True)
    prompts = {r.rid: r.input_ids for wave in WAVES for r in wave}
    counts_up, tokens, steps, full = True, 0, 0, 0
    for rid, out in results.items():
        ids = out["output_ids"]
        start = prompts[rid][-1]
        counts_up &= ids == [(start + 1 + i) % 512 for i in range(len(ids))]
        tokens += len(ids)
        steps += out["meta_info"]["spec_verify_ct"]
        full += math.ceil((len(ids) - 1) / 2)
    print(
        json.dumps(
            {
                "label": label,
                "requests": len(results),
                "tokens": tokens,
                "verify_steps": steps,
                "verify_steps_at_full_acceptance": full,
                "tokens_per_verify_step": round((tokens - len(results)) / max(steps, 1), 3),
                "outputs_count_up": counts_up,
            }
        )
    )


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
