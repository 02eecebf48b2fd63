"""Create the shop's tables, place one order that commits and one that rolls back.

    SHOP_DB=shop.db TANGGUH_BROKER_URL=sqlite:///broker.db python place_orders.py
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "handlers")]
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")

import django  # noqa: E402

django.setup()

from django.core.management import call_command  # noqa: E402

from shop.orders import place_order  # noqa: E402

call_command("migrate", run_syncdb=True, verbosity=0)
print(place_order("ada@example.com").id)
try:
    place_order("bob@example.com", fail=True)
except RuntimeError:
    pass
