"""The command that turns a sharded checkpoint into one file: ``lightning-pipe consolidate_checkpoint
SHARDED_DIR OUT.ckpt``.

The file holds the whole model and every optimizer state numbered as on one device, like the checkpoint a run with
``save_distributed_checkpoint=False`` writes: it loads with ``torch.load`` or ``LightningModule.load_from_checkpoint``
without this package, or resumes a pipeline of any stage count. It is written one stage at a time (see
:func:`lightning_pipe.checkpoints.sharded.consolidate`), so the command needs about one stage's memory, not the model's.
A checkpoint that is not whole (a save that did not finish, a shard cut short, parts of different saves) is refused
before anything is written, naming what is wrong and the newest complete checkpoint beside it.
"""

from __future__ import annotations

import argparse

from lightning_pipe.checkpoints.integrity import ShardedCheckpointError, check_sharded_checkpoint
from lightning_pipe.checkpoints.sharded import consolidate, is_sharded_checkpoint


def main(argv: list[str] | None = None) -> None:
    """Parse the command line (``argv``, else ``sys.argv``) and write the file."""
    parser = argparse.ArgumentParser(
        prog="lightning-pipe consolidate_checkpoint",
        description="Write a sharded gpipe checkpoint (a torch.distributed.checkpoint directory) as one checkpoint"
        " file that loads anywhere (torch.load, LightningModule.load_from_checkpoint), one stage at a time: peak"
        " memory about one stage.",
    )
    parser.add_argument("sharded_dir", help="the sharded checkpoint: a directory")
    parser.add_argument("out", help="the checkpoint file to write")
    parser.add_argument(
        "--weights-only", action=argparse.BooleanOptionalAction, default=None,
        help="unpickle the checkpoint's non-tensor entries as torch.load(weights_only=...) does (default: torch's"
        " default, True); --no-weights-only only for checkpoints from a trusted source",
    )
    args = parser.parse_args(argv)
    if not is_sharded_checkpoint(args.sharded_dir):
        parser.error(f"{args.sharded_dir!r} is not a sharded checkpoint (a directory)")
    try:
        checked = check_sharded_checkpoint(args.sharded_dir)
    except ShardedCheckpointError as error:
        parser.exit(1, f"{parser.prog}: error: {error}\n")
    consolidate(checked.directory, args.out, weights_only=args.weights_only)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
