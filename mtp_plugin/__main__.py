"""``python -m mtp_plugin``."""

import sys

from .cli import main

sys.exit(main())
