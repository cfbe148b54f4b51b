"""Lightning overhead: a ``Trainer(strategy="gpipe")`` step against the engine's own step on the same model.

The difference is what Lightning and the strategy add per step around the engine: the training loop, hooks,
logging and the broadcast of the step's outcome to the other stages. See :mod:`overhead_worker` for the method.
"""

from __future__ import annotations

from typing import Any

from measurements import NUM_STAGES, measured
from report import markdown_table, verdict
from workload import workload

TARGET_OVERHEAD = 0.05


def run(quick: bool) -> dict[str, Any]:
    work = workload(quick)
    answer = measured("overhead", quick)[0]
    overhead = answer["lightning_s"] / answer["plain_s"] - 1
    table = markdown_table(
        ["M", "plain engine loop (ms/step)", 'Trainer(strategy="gpipe") (ms/step)', "overhead"],
        [[answer["micro_batches"], f"{1e3 * answer['plain_s']:.1f}", f"{1e3 * answer['lightning_s']:.1f}", f"{overhead:+.1%}"]],
    )
    markdown = (
        f"{work.depth} × (Linear({work.width}, {work.width}) + ReLU), batch {work.batch}, {NUM_STAGES} stages,"
        f' `checkpoint="never"`, SGD; median over {answer["steps"]} steps of each, from {work.fits} fits alternating'
        f" with as many plain loops of {work.steps_per_fit} steps (the first step of each and one warm-up pair"
        " dropped). The plain loop runs the engine's step, `optimizer.step()` and `zero_grad()`; the Trainer adds its"
        " loop, hooks, `self.log` and the strategy's per-step bookkeeping.\n\n"
        f"{table}\n\n"
        + verdict(f"Lightning overhead ≤ {TARGET_OVERHEAD:.0%} of the step", overhead <= TARGET_OVERHEAD, f"{overhead:+.1%}")
    )
    data = {"num_stages": NUM_STAGES, "workload": work.to_spec(), **answer, "overhead": overhead}
    return {"title": "Lightning overhead", "markdown": markdown, "data": data}
