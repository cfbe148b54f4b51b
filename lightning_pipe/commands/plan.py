"""The command that says which schedule to use: ``lightning-pipe plan`` ranks every schedule x micro-batch
count x virtual stages x checkpoint mode by its predicted step, from block costs profiled on this machine or read
from a file.

    lightning-pipe plan --stages 4                                  # the Hydra config in ./conf
    lightning-pipe plan --stages 8 model.depth=16 data.batch_size=64  # with overrides
    lightning-pipe plan my_project.models:Classifier --batch-size 64 --stages 4
    lightning-pipe plan --costs costs.json --stages 8               # costs saved by --save-costs
    lightning-pipe plan --stages 4 --action-time 0.05 --send-time 0.02  # the runtime's costs (ms) on GPUs
    lightning-pipe plan --transformers-config llama:hidden_size=8192,... --layouts 8x8 16x4 \
        --memory-budget 80GB --precision bf16-mixed  # what each rank holds, from a model's shapes alone

It profiles each pipelined block's forward, input gradient, weight gradient and activation bytes at the smallest and
the largest micro-batch the candidates use (:func:`~lightning_pipe.partition.profiling.block_cost_model`), adds the
runtime's own cost per action and per message (measured per device type,
:data:`~lightning_pipe.schedules.choice.MEASURED_RUNTIME_COSTS`; ``--action-time``/``--send-time``, or a costs file's
``runtime``, override them), predicts every configuration (:mod:`lightning_pipe.schedules.choice`), prints the ranked table and the recommendation with
why, and, with ``--draw DIR`` where matplotlib is installed, the predicted timelines of the best three.

With ``--transformers-config`` it answers "does this fit" instead, for a model too large to build: the Hugging Face
causal language model of that config (a local ``config.json``, or ``model_type:field=value,...``) is built on the
meta device (no weights, nothing downloaded), its blocks and the modules outside them found and placed as the
pipeline places them, and each ``--layouts`` S x D is split by parameters; for every ``data_parallel`` mode the
table gives the state the largest stage's rank holds (:func:`~lightning_pipe.partition.memory_estimate.rank_state_bytes`)
against ``--memory-budget``.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
from pathlib import Path
from typing import Any

import torch

from lightning_pipe.auto_schedule import candidates_for, ranked_choice
from lightning_pipe.partition.profiling import block_cost_model
from lightning_pipe.pipeline import find_pipelined_region
from lightning_pipe.schedules.builtin import SCHEDULES
from lightning_pipe.schedules.choice import (
    AUTO_SCHEDULES, BlockCosts, CostModel, PlannedConfiguration, choose, runtime_costs,
)
from lightning_pipe.schedules.planner import RuntimeCosts
from lightning_pipe.partition.balance import min_max_partition, ranges_from_sizes
from lightning_pipe.partition.memory_estimate import StateLayout, rank_state_bytes
from lightning_pipe.partition.placement import balance_charges, observe_places, outside_modules
from lightning_pipe.partition.region import chosen_region
from lightning_pipe.execution.tensor_parallel import resolve_plan
from lightning_pipe.settings import DATA_PARALLEL_MODES, PipelineSettings


def main(argv: list[str] | None = None) -> None:
    """Parse the command line (``argv``, else ``sys.argv``), profile or read the costs, print the plan."""
    parser = argparse.ArgumentParser(
        prog="lightning-pipe plan",
        description="Rank every schedule x micro-batch count x virtual stages x checkpoint mode by its predicted step"
        " for S stages, from block costs profiled here or read from a file, and recommend one.",
    )
    parser.add_argument("target", nargs="*", help="a LightningModule's import path (pkg.module:Class), or Hydra"
                        " overrides of the config in --config-dir (model.depth=16); nothing: that config as it is")
    parser.add_argument("--stages", type=int, default=None, help="pipeline stages (default: the config's num_stages)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per training batch (default: the"
                        " config's data.batch_size)")
    parser.add_argument("--config-dir", type=Path, default=Path("conf"), help="the Hydra config tree (default ./conf)")
    parser.add_argument("--config-name", default="config")
    parser.add_argument("--costs", type=Path, default=None, help="read the block costs from this JSON file")
    parser.add_argument("--save-costs", type=Path, default=None, help="write the profiled block costs here")
    parser.add_argument("--memory-budget", default=None, help="bytes per device for a stage (e.g. 40GB)")
    parser.add_argument("--schedules", nargs="+", default=list(SCHEDULES), choices=list(SCHEDULES))
    parser.add_argument("--device", default="cpu", help="where to profile (default cpu)")
    parser.add_argument("--action-time", type=float, default=None, help="the runtime's own milliseconds per compute"
                        " action (default: the costs file's, else the value measured for the device type)")
    parser.add_argument("--send-time", type=float, default=None, help="milliseconds a message takes to arrive"
                        " (default: the costs file's, else the value measured for the device type)")
    parser.add_argument("--replicas", type=int, default=1, help="data-parallel replicas of the pipeline: the state"
                        " each rank holds is shown for every data_parallel mode (default 1)")
    parser.add_argument("--transformers-config", default=None, help="only the state per rank, of the Hugging Face"
                        " causal LM of this config built on the meta device: a config.json (or its directory), or"
                        " model_type:field=value,... (llama:hidden_size=8192,num_hidden_layers=80)")
    parser.add_argument("--layouts", nargs="+", default=None, help="with --transformers-config: the layouts S x D, or"
                        " S x D x T with tensor parallelism, to tabulate, as 8x8 16x4 4x2x8 (default: --stages x"
                        " --replicas)")
    parser.add_argument("--precision", default="32-true", help="Lightning's precision of the run: under bf16-mixed"
                        " the sharded weights are gathered in bfloat16 (default 32-true)")
    parser.add_argument("--top", type=int, default=15, help="rows of the table shown (default 15)")
    parser.add_argument("--draw", type=Path, default=None, help="draw the best three's predicted timelines here")
    args = parser.parse_args(argv)
    if args.transformers_config is not None:
        try:
            layouts = [_layout(text) for text in args.layouts] if args.layouts else [(args.stages, args.replicas, 1)]
            budget = PipelineSettings(schedule="auto", memory_budget=args.memory_budget).memory_budget
            print(state_from_shapes(model_from_config(args.transformers_config), layouts, budget, args.precision,
                                    args.batch_size))
        except ValueError as error:
            parser.error(str(error))
        return
    try:
        model, batch_size, num_stages, module_name, runtime = _costs(args)
        settings = PipelineSettings(schedule="auto", module_name=module_name,
                                    memory_budget=args.memory_budget)
        candidates = candidates_for(settings, num_stages, batch_size, model.num_blocks, args.schedules)
        source = f"read from {args.costs}" if args.costs else f"profiled on {args.device}"
        rows, chosen, text = ranked_choice(
            model, settings, num_stages, batch_size, settings.memory_budget, candidates, source, args.top,
            runtime=runtime,
        )
    except ValueError as error:
        parser.error(str(error))
    print(text)
    print(f"\nRecommended: {chosen.configuration}.")
    auto = [r for r in rows if r.configuration.schedule in AUTO_SCHEDULES]
    if chosen.configuration.schedule not in AUTO_SCHEDULES and auto:
        print(f"schedule='auto' would choose {choose(auto).configuration} (it leaves zbv, whose loss is on stage 0,"
              " to you).")
    print("\n" + state_per_rank([b.parameter_bytes for b in model.small], num_stages, args.replicas,
                                settings.memory_budget))
    if args.draw is not None:
        _draw(rows[:3], num_stages, args.draw)


def state_per_rank(block_bytes: list[float], num_stages: int, replicas: int, budget: int | None = None) -> str:
    """What the rank of the largest stage (blocks split by their parameter bytes) holds of parameters, gradients and
    Adam's two moments, for each ``data_parallel`` mode over ``replicas``; whether that leaves room in ``budget``.

    >>> print(state_per_rank([2**30] * 8, 4, 2))  # doctest: +NORMALIZE_WHITESPACE
    State per rank, 4 stages x 2 replicas (the largest stage's blocks: parameters, gradients, Adam's two moments;
    the modules outside the blocks and the activations not counted):
      data_parallel='replicate'   8.00 GiB
      data_parallel='shard'       8.00 GiB
      data_parallel='full_shard'  4.00 GiB
    """
    ranges = ranges_from_sizes(min_max_partition(block_bytes, num_stages))
    largest = max(sum(block_bytes[i] for i in r) for r in ranges)
    lines = [f"State per rank, {num_stages} stages x {replicas} replicas (the largest stage's blocks: parameters,"
             " gradients, Adam's two moments;\nthe modules outside the blocks and the activations not counted):"]
    for mode in DATA_PARALLEL_MODES if replicas > 1 else ("replicate",):
        held = StateLayout(mode, replicas).copies() * largest
        verdict = "fits" if budget is not None and held <= budget else "exceeds"
        room = "" if budget is None else f"  ({verdict} the budget of {budget / 2**30:.2f} GiB)"
        lines.append(f"  data_parallel={mode!r:<13} {held / 2**30:6.2f} GiB{room}")
    return "\n".join(lines)


def model_from_config(spec: str) -> torch.nn.Module:
    """The Hugging Face causal language model of a config, built on the meta device: ``spec`` is a local
    ``config.json`` (or the directory holding it) or ``model_type:field=value,...``. Nothing is downloaded."""
    import transformers

    if Path(spec).exists():
        config = transformers.AutoConfig.from_pretrained(spec)
    else:
        model_type, _, fields = spec.partition(":")
        values = dict(field.split("=", 1) for field in fields.split(",") if field)
        config = transformers.AutoConfig.for_model(model_type, **{k: json.loads(v) for k, v in values.items()})
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def state_from_shapes(
    model: torch.nn.Module, layouts: list[tuple[int, ...]], budget: int | None, precision: str = "32-true",
    batch_size: int | None = None,
) -> str:
    """The markdown table of what the largest stage's rank holds for each layout (S stages x D replicas, x T
    tensor-parallel ranks) and each ``data_parallel`` mode, from ``model``'s parameter counts alone (on the meta
    device): its blocks split by parameters, the modules outside them on the stages that run them (observed in a
    forward on the meta device), the layers the model's tensor-parallel plan names divided by T; and the predicted
    bubble ``(S-1)/(M+S-1)``, ``M`` micro-batches of one sample from ``batch_size`` over the replicas (else ``4S``)."""
    layouts = [(*layout, 1) if len(layout) == 2 else layout for layout in layouts]
    region = chosen_region(model, None, None, None, max(layout[0] for layout in layouts), 1)
    names = outside_modules(model, region)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    places = observe_places(model, region, lambda m: m(input_ids=ids, labels=ids).loss, names)
    blocks = region.blocks(model)
    charged = [float(sum(p.numel() for p in block.parameters())) for block in blocks]
    split = _split_parameters(model, region, blocks) if any(layout[2] > 1 for layout in layouts) else [0.0] * len(blocks)
    largest = max(charged)
    held = {id(p) for block in blocks for p in block.parameters()}
    for index, module in balance_charges(model, region, places):  # a module two stages hold: counted on both
        count = sum(p.numel() for p in module.parameters())
        charged[index] += count
        largest = max(largest, count)
        held |= {id(p) for p in module.parameters()}
    everywhere = sum(p.numel() for p in model.parameters() if id(p) not in held)
    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    where = "; ".join(f"{name} ({_count(sum(p.numel() for p in model.get_submodule(name).parameters()))}) on"
                      f" {places.describe(name, region.names)}" for name in names)
    room = _size(budget) if budget is not None else "the budget"
    lines = [
        f"{type(model).__name__} from its shapes (meta device): {_count(total)} parameters, {len(blocks)} blocks in"
        f" {region.label!r}; {where}.",
        f"State the largest stage's rank holds at its step's peak, precision={precision!r}: parameters, gradients and"
        " Adam's two moments in float32 (16 bytes a parameter), sharded as data_parallel says; weights gathered in"
        f" {'bfloat16' if precision == 'bf16-mixed' else 'float32'}; activations not counted.",
        "",
        f"| layout | data_parallel | largest stage | held per rank | fits {room} | left for activations | bubble |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for num_stages, replicas, tensor in layouts:
        ranges = ranges_from_sizes(min_max_partition(charged, num_stages))
        # A rank of T holds the stage's whole parameters but 1/T of those the plan splits.
        per_rank = [charged[i] - split[i] * (1 - 1 / tensor) for i in range(len(blocks))]
        stage = max(sum(per_rank[i] for i in r) for r in ranges) + everywhere
        micro_batches = batch_size // replicas if batch_size else 4 * num_stages
        bubble = (num_stages - 1) / (micro_batches + num_stages - 1)
        name = f"{num_stages} stages x {replicas} replicas" + (f" x {tensor} tensor-parallel" if tensor > 1 else "")
        modes = DATA_PARALLEL_MODES if tensor == 1 else ("replicate", "shard")  # what GPipeStrategy runs with T
        for mode in modes if replicas > 1 else ("replicate",):
            size = rank_state_bytes(stage, max(largest - max(split) * (1 - 1 / tensor), 1.0), mode, replicas, precision)
            fits = "-" if budget is None else ("yes" if size <= budget else "no")
            left = "-" if budget is None else (_size(budget - size) if size <= budget else "none")
            lines.append(f"| {name} | {mode} | {_count(stage)} parameters |"
                         f" {_size(size)} | {fits} | {left} | {bubble:.2f} (M={micro_batches}) |")
    return "\n".join(lines)


def _split_parameters(model: torch.nn.Module, region: Any, blocks: list[torch.nn.Module]) -> list[float]:
    """Each block's parameters in the layers the Hugging Face model's tensor-parallel plan splits."""
    plans = resolve_plan(model, region.names, blocks, None, 1)
    return [float(sum(p.numel() for name in plans.styles.get(i, {}) for p in block.get_submodule(name).parameters()))
            for i, block in enumerate(blocks)]


def _count(parameters: float) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if parameters >= scale / 10:
            return f"{parameters / scale:.2f} {unit}"
    return f"{parameters:.0f}"


def _size(size: float) -> str:
    return f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.2f} MiB"


def _layout(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) not in (2, 3) or not all(part.isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"--layouts {text!r} is invalid; give stages x replicas, as 8x8 or 16x4, or stages x"
                         " replicas x tensor-parallel ranks, as 4x2x8")
    return int(parts[0]), int(parts[1]), int(parts[2]) if len(parts) == 3 else 1


def _costs(args: argparse.Namespace) -> tuple[CostModel, int, int, Any, RuntimeCosts]:
    """The block costs, the batch size, the stage count, the pipelined module's name and the runtime's costs."""
    if args.costs is not None:
        stored = json.loads(args.costs.read_text())
        model = CostModel.measured([BlockCosts(**b) for b in stored["small"]], [BlockCosts(**b) for b in stored["large"]])
        if args.stages is None:
            raise ValueError("--costs needs --stages: the stage count to plan for")
        runtime = RuntimeCosts(**stored["runtime"]) if "runtime" in stored else runtime_costs(args.device.split(":")[0])
        return model, args.batch_size or stored["batch_size"], args.stages, None, _overridden(runtime, args)
    module, batch_size, num_stages, module_name = _module(args)
    if batch_size is None or num_stages is None:
        raise ValueError("give --batch-size and --stages (a LightningModule's import path has neither)")
    settings = PipelineSettings(schedule="auto", module_name=module_name)
    region = find_pipelined_region(module, settings, num_stages)
    blocks = torch.nn.Sequential(*region.blocks(module))
    counts = [c.num_micro_batches for c in candidates_for(settings, num_stages, batch_size, len(blocks), args.schedules)]
    sizes = (max(1, batch_size // max(counts)), max(1, batch_size // min(counts)))
    sample = getattr(module, "example_input_array", None)
    if sample is None:
        raise ValueError(f"{type(module).__name__} has no example_input_array to profile its blocks with; set one")
    device = torch.device(args.device)
    model = block_cost_model(module, blocks, sample, device, sizes)
    runtime = _overridden(runtime_costs(device.type), args)
    if args.save_costs is not None:
        args.save_costs.write_text(json.dumps({
            "batch_size": batch_size, "small": [dataclasses.asdict(b) for b in model.small],
            "large": [dataclasses.asdict(b) for b in model.large], "runtime": dataclasses.asdict(runtime),
        }, indent=1))
    return model, batch_size, num_stages, module_name, runtime


def _overridden(runtime: RuntimeCosts, args: argparse.Namespace) -> RuntimeCosts:
    """``runtime`` with the times given on the command line (milliseconds) in place of its own."""
    return RuntimeCosts(
        runtime.action_time if args.action_time is None else args.action_time / 1e3,
        runtime.send_time if args.send_time is None else args.send_time / 1e3,
    )


def _module(args: argparse.Namespace) -> tuple[Any, int | None, int | None, Any]:
    """The LightningModule (from its import path or the Hydra config), its batch size, stages and module name."""
    if len(args.target) == 1 and ":" in args.target[0]:
        path, _, name = args.target[0].partition(":")
        return getattr(importlib.import_module(path), name)(), args.batch_size, args.stages, None
    from hydra import compose, initialize_config_dir
    from hydra.utils import instantiate

    from lightning_pipe.integration import hydra_schema

    hydra_schema.register_configs()  # the strategy group's schema, which conf/strategy/gpipe.yaml extends

    with initialize_config_dir(config_dir=str(args.config_dir.resolve()), version_base="1.3"):
        cfg = compose(args.config_name, overrides=list(args.target))
    module = instantiate(cfg.model)
    batch_size = args.batch_size or cfg.get("data", {}).get("batch_size")
    strategy = cfg.get("strategy", {})
    return module, batch_size, args.stages or strategy.get("num_stages"), strategy.get("module_name")


def _draw(rows: list[PlannedConfiguration], num_stages: int, where: Path) -> None:
    """The predicted timelines of ``rows`` as one PNG each, where matplotlib is installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no timelines drawn (pip install matplotlib)")
        return
    where.mkdir(parents=True, exist_ok=True)
    colours = {"forward": "tab:blue", "backward": "tab:red", "backward_input": "tab:orange", "backward_weight": "tab:green"}
    for rank, row in enumerate(rows, 1):
        c = row.configuration
        figure, axes = plt.subplots(figsize=(12, 0.5 + 0.4 * num_stages))
        for stage, intervals in enumerate(row.simulation.intervals):  # type: ignore[union-attr]
            for start, end, action in intervals:
                axes.broken_barh([(start * 1000, (end - start) * 1000)], (stage - 0.4, 0.8),
                                 color=colours[action.kind])
        axes.set_yticks(range(num_stages), [f"stage {s}" for s in range(num_stages)])
        axes.invert_yaxis()
        axes.set_xlabel("ms")
        axes.set_title(f"{c}: predicted step {row.step * 1000:.1f} ms, bubble {row.bubble:.3f}")
        path = where / f"{rank}_{c.schedule}_m{c.num_micro_batches}_v{c.virtual_stages}_{c.recompute}.png"
        figure.savefig(path, dpi=100, bbox_inches="tight")
        plt.close(figure)
        print(f"drew {path}")


if __name__ == "__main__":
    main()
