"""``python -m tiertrain`` (what ``torchrun ... -m tiertrain train`` starts on every rank)."""

import sys

from .cli import main

sys.exit(main())
