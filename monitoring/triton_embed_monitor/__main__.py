"""``python -m triton_embed_monitor``: see :mod:`triton_embed_monitor.cli`."""

import sys

from triton_embed_monitor.cli import main

if __name__ == "__main__":
    sys.exit(main())
