"""Speculative decoding against plain decoding on prompts where it matters: greedy, real chat prompts.

Random prompts (run_mlx_infer.py) give a prompt-lookup proposer nothing to find, so this measures two
tasks instead: a code edit (rewrite a function with one rename: the answer repeats the prompt) and a
summary (some phrases repeat). Per task and batch size, plain and speculative runs alternate, so a
noisy machine shifts both alike; every run's text must equal the plain one's (greedy is exact).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import mlx.nn as nn

from mlx_infer.engine.engine import Engine, EngineConfig
from mlx_infer.engine.scheduler import SchedulerConfig
from mlx_infer.engine.speculative import SpeculativeConfig
from mlx_infer.loading import LoadedModel
from mlx_infer.sampling import SamplingParams

CODE = '''def compute_totals(orders, tax_rate):
    totals = {}
    for order in orders:
        customer = order["customer"]
        amount = order["amount"]
        if amount <= 0:
            continue
        taxed = amount * (1 + tax_rate)
        if customer not in totals:
            totals[customer] = 0.0
        totals[customer] += taxed
    result = []
    for customer, total in totals.items():
        if total < 1.0:
            continue
        result.append((customer, round(total, 2)))
    result.sort(key=lambda item: item[1], reverse=True)
    best = result[0] if result else None
    count = len(result)
    average = sum(total for _, total in result) / count if count else 0.0
    summary = {
        "best": best,
        "count": count,
        "average": round(average, 2),
        "rows": result,
    }
    return summary
'''

ARTICLE = (
    "The city council met on Tuesday to discuss the new bicycle lanes on Main Street. Supporters said "
    "the bicycle lanes on Main Street would make cycling safer for children who ride to school, and that "
    "shops on Main Street would gain customers who arrive by bicycle. Opponents said the bicycle lanes "
    "would remove forty parking spaces on Main Street and that delivery trucks would have nowhere to stop. "
    "The council heard from twenty residents. Most residents who spoke supported the bicycle lanes, but "
    "several shop owners asked the council to delay the decision until a study of parking on Main Street "
    "is finished. The council voted five to two to build the bicycle lanes on Main Street next spring, "
    "and to ask the transport department for a study of parking and deliveries on Main Street before "
    "construction begins. The mayor said the council would review the bicycle lanes after one year."
)

TASKS = {
    "code-edit": "Rewrite this function, renaming the variable `totals` to `sums`. Output only the code.\n\n"
    + CODE,
    "summary": "Summarise this article in a few sentences.\n\n" + ARTICLE,
}


@dataclass
class SpecResult:
    task: str
    batch: int
    tokens: int = 0  # generated per run, all sequences together
    plain: list[float] = field(default_factory=list)  # decode tok/s per run
    speculative: list[float] = field(default_factory=list)
    proposed: int = 0
    accepted: int = 0
    identical: bool = True  # every speculative run's tokens equal the plain run's

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0


def run(
    lm: LoadedModel,
    spec: SpeculativeConfig,
    gen_len: int,
    repeats: int,
    batches: list[int],
    draft: nn.Module | None = None,
) -> list[SpecResult]:
    """``draft``: the draft model when ``spec.method`` is "draft"."""
    results = []
    for task, text in TASKS.items():
        prompt = lm.tokenizer.encode_chat([{"role": "user", "content": text}])
        for b in batches:
            result = SpecResult(task, b)
            _generate(lm, None, [prompt[:8]] * b, 2)  # warm-up: first-call costs at this batch size
            _generate(lm, spec, [prompt[:8]] * b, 2, draft)
            reference = None
            for _ in range(repeats):
                for config in (None, spec):
                    tokens, tps, engine = _generate(lm, config, [prompt] * b, gen_len, draft)
                    if config is None:
                        reference = tokens
                        result.plain.append(tps)
                    else:
                        result.speculative.append(tps)
                        result.proposed += engine.stats.spec_proposed
                        result.accepted += engine.stats.spec_accepted
                        result.identical &= tokens == reference
                    result.tokens = sum(map(len, tokens))
            results.append(result)
    return results


def _generate(
    lm: LoadedModel,
    spec: SpeculativeConfig | None,
    prompts: list[list[int]],
    gen_len: int,
    draft: nn.Module | None = None,
) -> tuple[list[list[int]], float, Engine]:
    """Greedy outputs and decode tok/s (tokens after each sequence's first, over the time after the
    last sequence's first token)."""
    config = EngineConfig(
        num_blocks=len(prompts) * ((len(prompts[0]) + gen_len) // 16 + 2),
        enable_prefix_caching=False,  # both runs prefill alike; decode is what is compared
        scheduler=SchedulerConfig(max_num_seqs=max(len(prompts), 1), max_num_batched_tokens=4096),
        speculative=spec or SpeculativeConfig(),
    )
    draft = draft if spec is not None and spec.method == "draft" else None
    engine = Engine(lm.model, lm.tokenizer, lm.max_context, config, draft_model=draft)
    ids = [engine.add_request(p, SamplingParams(max_tokens=gen_len)) for p in prompts]
    out: dict[str, list[int]] = {i: [] for i in ids}
    while any(not tokens for tokens in out.values()):
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    first_tokens = sum(map(len, out.values()))
    start = time.perf_counter()
    while engine.has_unfinished():
        for o in engine.step():
            out[o.request_id].extend(o.token_ids)
    seconds = time.perf_counter() - start
    tokens = [out[i] for i in ids]
    decoded = sum(map(len, tokens)) - first_tokens
    return tokens, decoded / seconds if seconds > 0 else 0.0, engine
