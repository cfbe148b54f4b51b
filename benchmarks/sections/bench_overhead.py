"""Lightning overhead: a ``Trainer(strategy="gpipe")`` step against the engine's own step on the same model.

The difference is what Lightning and the strategy add per step around the engine: the training loop, hooks,
logging and the broadcast of the step's outcome to the other stages. See :mod:`ranks.overhead` for the method.
"""

from __future__ import annotations

from typing import Any

from harness.measurements import NUM_STAGES, measured
from harness.report import markdown_table, verdict
from harness.summarize import median, median_ratio
from harness.workload import workload

TARGET_OVERHEAD = 0.05


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    answer = measured("overhead", quick)[0]
    plain_rounds, lightning_rounds = answer["plain_s"], answer["lightning_s"]
    plain = median([t for steps in plain_rounds for t in steps])
    lightning = median([t for steps in lightning_rounds for t in steps])
    # Per round (a plain loop and a fit run back to back): the ratio of their median steps; then the median of those.
    overhead = median_ratio([median(r) for r in lightning_rounds], [median(r) for r in plain_rounds]) - 1
    steps = sum(len(r) for r in plain_rounds)
    table = markdown_table(
        ["M", "plain engine loop (ms/step)", 'Trainer(strategy="gpipe") (ms/step)', "overhead"],
        [[answer["micro_batches"], f"{1e3 * plain:.1f}", f"{1e3 * lightning:.1f}", f"{overhead:+.1%}"]],
    )
    markdown = (
        f"{work.depth} × (Linear({work.width}, {work.width}) + ReLU), batch {work.batch}, {NUM_STAGES} stages,"
        f' `checkpoint="never"`, SGD; {work.fits} `Trainer.fit` calls alternating with as many plain loops, each of'
        f" {work.steps_per_fit} steps (the first step of each and one warm-up pair dropped): step times are medians"
        f" over the {steps} measured steps of each, the overhead is the median over the {work.fits} pairs of their"
        " ratio. The plain loop runs the engine's step, `optimizer.step()` and `zero_grad()`; the Trainer adds its"
        " loop, hooks, `self.log` and the strategy's per-step bookkeeping.\n\n"
        f"{table}\n\n"
        + verdict(f"Lightning overhead ≤ {TARGET_OVERHEAD:.0%} of the step", overhead <= TARGET_OVERHEAD, f"{overhead:+.1%}")
    )
    data = {
        "num_stages": NUM_STAGES, "workload": work.to_spec(), "micro_batches": answer["micro_batches"],
        "plain_s": plain, "lightning_s": lightning, "overhead": overhead,
        "plain_s_per_round": plain_rounds, "lightning_s_per_round": lightning_rounds,
    }
    return {"title": "Lightning overhead", "markdown": markdown, "data": data}
