"""``python -m lightning_osdp.cli``: the ``osdp`` command without the console script."""

from lightning_osdp.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
