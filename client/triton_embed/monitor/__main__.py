"""``python -m triton_embed.monitor``: see :mod:`triton_embed.monitor.cli`."""

import sys

from triton_embed.monitor.cli import main

if __name__ == "__main__":
    sys.exit(main())
