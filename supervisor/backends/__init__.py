"""Brokers: one module per backend behind the contract in ``base``."""
from .base import Broker, open_broker, scheme_of  # noqa: F401
