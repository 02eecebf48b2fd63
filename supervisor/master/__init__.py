"""The supervisor's master process, one role per module; ``arbiter`` wires them (docs/design.md)."""
from .arbiter import EXIT_BOOT, EXIT_CONFIG, EXIT_ERROR, EXIT_OK, EXIT_RUNNING, Arbiter, run  # noqa: F401
