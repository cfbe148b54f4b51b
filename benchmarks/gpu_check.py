"""The CUDA check: what no CPU test can show, run in a few minutes on a machine with one GPU, with a summary.

    python benchmarks/gpu_check.py                 # on a machine with a GPU (under 5 minutes)
    python benchmarks/gpu_check.py --device cpu    # the same checks on the CPU, to try the script without a GPU

Each check runs in its own processes (a failure or a hang in one does not stop the others) and writes what it saw;
the summary at the end says, per check, what held, what did not, and what could not be run:

* ``one_stage``: ``Trainer(strategy=GPipeStrategy(), accelerator="cuda", devices=1)``: where the stage's parameters
  live, and training in ``32-true``, ``bf16-mixed`` and ``16-mixed`` (with its gradient scaler, and a step whose
  gradient holds an inf: skipped and the scale halved) against the same training without the strategy.
* ``two_stages_nccl`` and ``two_stages_gloo``: two stages, one process each, sharing the one GPU
  (``GPipeStrategy(parallel_devices=[cuda:0, cuda:0])``): the placement of each stage, the three precisions against
  one device, an inf in stage 0's gradient under ``16-mixed`` (both stages skip the step and halve the scale), and a
  Chrome trace of one step timed with CUDA events. NCCL refuses two ranks of one communicator on
  the same GPU ("Duplicate GPU detected") and gloo moves only CPU tensors point to point, so on a single GPU either
  may fail: the summary says how, and what stays untested until a machine with two GPUs runs it.
* ``engine_overhead``: the engine's cost per micro-batch on the GPU: one stage, ``M`` micro-batches through the
  engine against the same ``M`` chunks through the same layers in a plain loop (no Lightning, no communication).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent
sys.path[:0] = [str(BENCHMARKS.parent), str(BENCHMARKS)]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import Tensor, nn  # noqa: E402

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")
CHECKS = ("one_stage", "two_stages_nccl", "two_stages_gloo", "engine_overhead")
CHECK_TIMEOUT_S = 70  # each check; the whole script stays under 5 minutes even if every check hangs to its limit
CPU_CHECK_TIMEOUT_S = 240  # on the CPU the checks run at once, sharing its cores
POISONED_BATCH = 2  # the batch whose gradient gets an inf in the overflow run
WIDTH, DEPTH, BATCH, BATCHES = 64, 8, 32, 6


# ---- the training checks (run inside the check's processes) -------------------------------------------------------


def build_module(poison: bool) -> Any:
    from lightning.pytorch import LightningModule

    class Regression(LightningModule):
        """``DEPTH`` Linear + Tanh layers in ``self.model`` (pipelined), a head outside (replicated)."""

        def __init__(self) -> None:
            super().__init__()
            layers: list[nn.Module] = []
            for _ in range(DEPTH):
                layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
            self.model = nn.Sequential(*layers)
            self.head = nn.Linear(WIDTH, 1)

        def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
            x, y = batch
            loss = F.mse_loss(self.head(self.model(x)).float(), y)
            self.log("train_loss", loss)
            return loss

        def on_after_backward(self) -> None:
            # Layer 0 on the stage that holds it; elsewhere it is a stand-in without parameters of its own.
            first = next(self.model[0].parameters(), None)
            if poison and self.trainer.fit_loop.epoch_loop.batch_idx == POISONED_BATCH and first is not None:
                first.grad[0, 0] = float("inf")

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.05)

    return Regression()


def data() -> Any:
    from torch.utils.data import DataLoader, TensorDataset

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * BATCHES, WIDTH, generator=generator)
    return DataLoader(TensorDataset(x, x[:, :1].sin()), batch_size=BATCH)


def fit(device: str, precision: str, poison: bool, strategy: Any, devices: int, out: Path | None) -> dict[str, Any]:
    """Train on ``BATCHES`` batches; what the process saw: losses (last stage), placement, the gradient scaler."""
    from lightning.pytorch import Callback, Trainer, seed_everything
    from lightning.pytorch.plugins import MixedPrecision

    seen: dict[str, Any] = {"losses": []}

    class Record(Callback):
        def on_train_start(self, trainer: Any, pl_module: Any) -> None:
            real = [p for p in pl_module.parameters() if not p.is_meta]
            seen["parameter_devices"] = sorted({str(p.device) for p in real})
            seen["pipelined_devices"] = sorted({str(p.device) for p in pl_module.model.parameters() if not p.is_meta})
            seen["stage"] = getattr(trainer.strategy, "stage_index", 0)
            if torch.cuda.is_available():
                seen["cuda_allocated_mb"] = torch.cuda.memory_allocated() / 2**20

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            if outputs is not None:
                seen["losses"].append(float(outputs["loss"]))

    seed_everything(0)
    module = build_module(poison)
    if device == "cpu" and precision == "16-mixed":  # (Lightning would run bf16 instead: no gradient scaler)
        precision_settings: dict[str, Any] = {"plugins": [MixedPrecision("16-mixed", "cpu")]}
    else:
        precision_settings = {"precision": precision}
    trainer = Trainer(
        strategy=strategy, accelerator=device, devices=devices, **precision_settings, max_epochs=1, logger=False,
        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()],
        default_root_dir=str(out) if out is not None else None,
    )
    trainer.fit(module, data())
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    seen["scaler"] = None if scaler is None else {"type": type(scaler).__name__, "scale": float(scaler.get_scale())}
    seen["global_rank"] = trainer.global_rank
    seen["weights"] = {k: v.detach().float().cpu() for k, v in module.state_dict().items()}
    return seen


def run_one_stage(device: str, out: Path) -> None:
    """One process: the strategy on one stage against the same training without it, per precision."""
    import lightning_pipe

    results = {}
    for precision in PRECISIONS:
        for poison in (False, True) if precision == "16-mixed" else (False,):
            name = f"{precision}{'-overflow' if poison else ''}"
            pipelined = fit(device, precision, poison, lightning_pipe.GPipeStrategy(num_micro_batches=4), 1, None)
            alone = fit(device, precision, poison, "auto", 1, None)
            results[name] = {"pipelined": _public(pipelined), "alone": _public(alone),
                             "weight_error": _weight_error(alone["weights"], pipelined["weights"])}
    _write(out / "rank0.json", results)


def run_two_stages(device: str, backend: str, out: Path) -> None:
    """Two processes (Lightning's default launcher re-runs this command for rank 1) sharing the one device."""
    import lightning_pipe

    results = {}
    shared = torch.device(device, 0) if device == "cuda" else torch.device(device)
    for index, (precision, poison) in enumerate([(p, False) for p in PRECISIONS] + [("16-mixed", True)]):
        strategy = lightning_pipe.GPipeStrategy(
            num_micro_batches=4, parallel_devices=[shared, shared], process_group_backend=backend,
            trace_steps=[3] if index == 0 else [], trace_dir=out,
        )
        seen = fit(device, precision, poison, strategy, 1, out)
        results[f"{precision}{'-overflow' if poison else ''}"] = _public(seen)
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    _write(out / f"rank{rank}.json", results)


def run_engine_overhead(device: str, out: Path) -> None:
    """Seconds per step of the engine (one stage, M micro-batches) and of a plain loop over the same M chunks."""
    import torch.distributed as dist
    from lightning.fabric.plugins.environments.lightning import find_free_network_port

    from ranks.engine_step import EngineStep

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(find_free_network_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    torch.manual_seed(0)
    width, depth, batch = (1024, 8, 512) if device == "cuda" else (128, 8, 64)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    sequential = nn.Sequential(*layers).to(device)
    x, target = torch.randn(batch, width, device=device), torch.randn(batch, width, device=device)
    results = {"width": width, "depth": depth, "batch": batch, "by_micro_batches": {}}
    for m in (1, 4, 16):
        engine = EngineStep(sequential, m, "never")

        def plain_step(m: int = m) -> None:
            outputs = [sequential(chunk) for chunk in x.chunk(m)]
            F.mse_loss(torch.cat(outputs), target).backward()

        repeats = 30 if device == "cuda" else 3  # the CPU path only tries the script
        engine_s = _seconds_per_call(lambda: engine.step(x, target), device, repeats=repeats)
        plain_s = _seconds_per_call(plain_step, device, repeats=repeats)
        results["by_micro_batches"][m] = {
            "engine_ms": 1e3 * engine_s, "plain_ms": 1e3 * plain_s,
            "overhead_us_per_micro_batch": 1e6 * (engine_s - plain_s) / m,
        }
    dist.destroy_process_group()
    _write(out / "rank0.json", results)


def _seconds_per_call(step: Any, device: str, repeats: int, warmup: int = 3) -> float:
    """The median time of ``step`` (synchronised with the device before each reading)."""
    times = []
    for i in range(warmup + repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if device == "cuda":
            torch.cuda.synchronize()
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def _public(seen: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in seen.items() if k != "weights"} | {"weights_file": None}


def _weight_error(expected: dict[str, Tensor], actual: dict[str, Tensor]) -> float:
    error = sum(float(((actual[k] - v) ** 2).sum()) for k, v in expected.items()) ** 0.5
    return error / max(sum(float((v**2).sum()) for v in expected.values()) ** 0.5, 1e-12)


def _write(path: Path, value: Any) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(value, indent=1, default=str))


# ---- the launching side: each check in its own processes, then the summary ----------------------------------------


def run_check(check: str, device: str, out: Path) -> dict[str, Any]:
    """Run ``check`` in a fresh Python with a time limit; its files and, on failure, its last lines of output."""
    directory = out / check
    directory.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--device", device, "--check", check, "--out", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    start = time.monotonic()
    try:
        process = subprocess.run(command, capture_output=True, text=True, env=env,
                                 timeout=CHECK_TIMEOUT_S if device == "cuda" else CPU_CHECK_TIMEOUT_S)
        status, output = process.returncode, process.stdout + process.stderr
    except subprocess.TimeoutExpired as expired:
        status, output = "timeout", f"{expired.stdout or ''}{expired.stderr or ''}"
        if isinstance(output, bytes):
            output = output.decode(errors="replace")
    (directory / "output.txt").write_text(output if isinstance(output, str) else str(output))
    ranks = {path.stem: json.loads(path.read_text()) for path in sorted(directory.glob("rank*.json"))}
    return {"status": status, "seconds": time.monotonic() - start, "ranks": ranks, "error": _last_error(output)}


def _last_error(output: str) -> str:
    """The last line of ``output`` that names an error (else its last line): what the summary shows of a failure."""
    lines = str(output).strip().splitlines()
    errors = [line for line in lines if "Error" in line or "error" in line or "Exception" in line]
    return (errors or lines or [""])[-1].strip()[:300]


def summarize(device: str, environment: dict[str, Any], results: dict[str, dict[str, Any]], out: Path) -> str:
    lines = [f"GPU check on {environment['device_name']} (torch {environment['torch']}, CUDA {environment['cuda']},"
             f" NCCL {environment['nccl']}), device={device!r}", ""]
    rows: list[tuple[str, str, str]] = []

    def add(check: str, verdict: str, detail: str) -> None:
        rows.append((check, verdict, detail))

    one = results.get("one_stage", {})
    if one.get("ranks"):
        for name, result in one["ranks"]["rank0"].items():
            pipelined, alone = result["pipelined"], result["alone"]
            exact = name == "32-true"
            tolerance = 1e-5 if exact else 2e-2
            holds = result["weight_error"] < tolerance and pipelined["parameter_devices"] == alone["parameter_devices"]
            detail = (f"stage on {pipelined['parameter_devices']}, weights differ from no strategy by"
                      f" {result['weight_error']:.1e} (limit {tolerance:g})")
            if name.startswith("16-mixed"):
                scaler = pipelined["scaler"]
                holds = holds and scaler is not None and scaler == alone["scaler"]
                detail += f"; scaler {scaler} (without the strategy: {alone['scaler']})"
            add(f"one stage, {name}", "ok" if holds else "FAILED", detail)
    else:
        add("one stage", "FAILED", f"{one.get('status')}: {one.get('error')}")

    for backend in ("nccl", "gloo"):
        check = results.get(f"two_stages_{backend}", {})
        if check.get("skipped"):
            add(f"two stages on one device, {backend}", "not run", check["skipped"])
            continue
        ranks = check.get("ranks", {})
        if check.get("status") != 0 or len(ranks) != 2:
            add(f"two stages on one device, {backend}", "FAILED", f"{check.get('status')}: {check.get('error')}")
            continue
        reference = one.get("ranks", {}).get("rank0", {})
        for precision in (*PRECISIONS, "16-mixed-overflow"):
            placed = {rank: ranks[rank][precision]["pipelined_devices"] for rank in sorted(ranks)}
            losses = ranks["rank0"][precision]["losses"]  # rank 0 holds the last stage: the losses
            expected = reference.get(precision, {}).get("alone", {}).get("losses")
            tolerance = 1e-5 if precision == "32-true" else 2e-2
            close = expected is not None and len(expected) == len(losses) and all(
                abs(a - b) <= tolerance * max(abs(b), 1e-6) for a, b in zip(losses, expected)
            )
            scaler = ranks["rank0"][precision]["scaler"]
            if precision.endswith("overflow"):  # the inf is on stage 0 (rank 1): every stage skips and halves
                close = close and all(ranks[r][precision]["scaler"] == {"type": "GradScaler", "scale": 2.0**15}
                                      for r in ranks)
            add(f"two stages on one device, {backend}, {precision}", "ok" if close else "FAILED",
                f"stage devices by rank {placed}; losses {'match' if close else 'differ from'} one device's"
                + (f"; scaler {scaler}" if scaler else ""))
        trace = out / f"two_stages_{backend}" / "gpipe_trace.json"
        add(f"trace, two stages, {backend}", *_trace_summary(trace))

    overhead = results.get("engine_overhead", {})
    if overhead.get("ranks"):
        answer = overhead["ranks"]["rank0"]
        parts = [f"M={m}: engine {r['engine_ms']:.2f} ms, plain {r['plain_ms']:.2f} ms,"
                 f" {r['overhead_us_per_micro_batch']:+.0f} us per micro-batch"
                 for m, r in answer["by_micro_batches"].items()]
        add("engine overhead (one stage)", "measured",
            f"{answer['depth']} x Linear({answer['width']}) + ReLU, batch {answer['batch']}: " + "; ".join(parts))
    else:
        add("engine overhead (one stage)", "FAILED", f"{overhead.get('status')}: {overhead.get('error')}")

    width = max(len(r[0]) for r in rows)
    lines += [f"{check:<{width}}  {verdict:<8}  {detail}" for check, verdict, detail in rows]
    lines += ["", "Not covered on one GPU: NCCL point-to-point between two GPUs (and its overlap of sends with"
              " compute), the per-GPU memory of stages on separate devices, and speed-ups from more devices."]
    return "\n".join(lines)


def _trace_summary(path: Path) -> tuple[str, str]:
    if not path.exists():
        return "FAILED", f"no trace at {path}"
    events = [e for e in json.loads(path.read_text())["traceEvents"] if e.get("ph") == "X" and e.get("cat") != "step"]
    busy: dict[int, float] = {}
    for event in events:
        busy[event["tid"]] = busy.get(event["tid"], 0.0) + event["dur"]
    per_stage = ", ".join(f"stage {tid}: {micros / 1e3:.2f} ms" for tid, micros in sorted(busy.items()))
    return ("ok" if len(busy) == 2 else "FAILED"), f"{len(events)} intervals ({per_stage}) in {path}"


def environment() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    nccl = ".".join(map(str, torch.cuda.nccl.version())) if cuda and torch.distributed.is_nccl_available() else "none"
    return {
        "torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl,
        "device_name": torch.cuda.get_device_name(0) if cuda else "no CUDA device",
        "gpus": torch.cuda.device_count() if cuda else 0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--check", choices=CHECKS, help="run one check in this process (used by the launcher)")
    parser.add_argument("--out", default="gpu_check", help="where each check writes what it saw")
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.check is not None:
        directory = out / args.check
        if args.check == "one_stage":
            run_one_stage(args.device, directory)
        elif args.check.startswith("two_stages_"):
            run_two_stages(args.device, args.check.removeprefix("two_stages_"), directory)
        else:
            run_engine_overhead(args.device, directory)
        return
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("no CUDA device here; pass --device cpu to try the script on the CPU")
    env = environment()
    start = time.monotonic()
    results: dict[str, dict[str, Any]] = {}
    runnable = [check for check in CHECKS if args.device == "cuda" or check != "two_stages_nccl"]
    # On the GPU the checks take turns (they share it, and one measures speed); on the CPU, where the script is
    # only tried, they run at once.
    with ThreadPoolExecutor(max_workers=1 if args.device == "cuda" else len(runnable)) as pool:
        running = {check: pool.submit(run_check, check, args.device, out) for check in runnable}
        for check in CHECKS:
            if check not in running:
                results[check] = {"skipped": "NCCL needs CUDA"}
                continue
            results[check] = running[check].result()
            print(f"{check}: {results[check]['status']} in {results[check]['seconds']:.0f} s", flush=True)
    summary = summarize(args.device, env, results, out)
    summary += f"\n\nTotal {time.monotonic() - start:.0f} s; every check's output is under {out}."
    (out / "summary.txt").write_text(summary)
    if args.device == "cuda":  # the benchmark page (benchmarks/run.py) shows it
        (BENCHMARKS / "gpu_check_summary.txt").write_text(summary)
    print("\n" + summary)


if __name__ == "__main__":
    main()
