"""``python -m lightning_osdp.checkpoint.consolidate SRC OUT [--weights-only]``: a sharded checkpoint directory to
one Lightning ``.ckpt`` file. The code is in :mod:`lightning_osdp.checkpoint.consolidation`; the function is
``lightning_osdp.checkpoint.consolidate``.
"""

from lightning_osdp.checkpoint.consolidation import consolidate, main

__all__ = ["consolidate", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
