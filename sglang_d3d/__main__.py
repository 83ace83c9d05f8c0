"""`python -m sglang_d3d COMMAND ...`: the `d3d` command, for launchers that run modules
(`torchrun --nproc_per_node N -m sglang_d3d train ...`)."""

import sys

from sglang_d3d.cli import main

sys.exit(main())
