"""``python -m supervisor.cli``: the ``tangguh`` command."""
import sys

from . import main

sys.exit(main())
