"""The command that writes a checkpoint's model as a Hugging Face directory: ``python -m
lightning_pipe.commands.export_pretrained CHECKPOINT OUT_DIR [--config PRETRAINED_DIR]``.

``CHECKPOINT`` is a consolidated checkpoint file or a sharded checkpoint directory of this package (or any weights
:mod:`lightning_pipe.checkpoints.stored_weights` reads). ``OUT_DIR`` receives safetensors shards with their index and,
from ``--config``, the model's ``config.json``: ``AutoModelForCausalLM.from_pretrained(OUT_DIR)`` loads it. The shards
are read and written one at a time (a sharded checkpoint's file per rank, cut at ``--max-shard-size``), so the command
needs about one shard's memory, not the model's (see :func:`lightning_pipe.checkpoints.export.export_checkpoint`).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from lightning_pipe.checkpoints.export import export_checkpoint, export_dtype, parse_size
from lightning_pipe.checkpoints.stored_weights import describe_names, open_stored_weights


def main(argv: list[str] | None = None) -> None:
    """Parse the command line (``argv``, else ``sys.argv``) and write the directory."""
    parser = argparse.ArgumentParser(
        prog="lightning-pipe export_pretrained",
        description="Write the model of a gpipe checkpoint (consolidated file or sharded directory) as a Hugging Face"
        " directory (safetensors shards, their index, the config), one shard at a time.",
    )
    parser.add_argument("checkpoint", type=Path,
                        help="a consolidated checkpoint file or a sharded checkpoint directory")
    parser.add_argument("out_dir", type=Path, help="the directory to write")
    parser.add_argument(
        "--prefix", default=None,
        help="what the LightningModule puts before the library's names, with its dot (e.g. 'model.'); default: the"
        " first component every key shares, else none",
    )
    parser.add_argument("--config", type=Path, default=None,
                        help="the pretrained model's directory (or config.json) whose config files are copied")
    parser.add_argument("--dtype", default=None, help="cast every tensor (e.g. bfloat16); default: as stored")
    parser.add_argument("--max-shard-size", default="5GB", help="largest shard written (default 5GB)")
    args = parser.parse_args(argv)
    try:
        stored = open_stored_weights(args.checkpoint)
        left_out = export_checkpoint(
            stored, args.out_dir, args.prefix, args.config, export_dtype(args.dtype), parse_size(args.max_shard_size)
        )
    except ValueError as error:
        parser.error(str(error))
    if left_out:
        print(f"left out the keys outside the prefix: {describe_names(left_out)}")
    print(f"wrote {args.out_dir}")


if __name__ == "__main__":
    main()
