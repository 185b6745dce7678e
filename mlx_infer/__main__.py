"""``python -m mlx_infer ...``: the ``mlx-infer`` command, as ``python -m mlx_lm`` is mlx-lm's."""

import sys

from mlx_infer.cli import main

sys.exit(main())
