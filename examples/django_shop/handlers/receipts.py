"""Handlers that use the Django ORM.

``tangguh run`` imports this module in the master, before it forks: Django is
set up once there (apps, models), and every child inherits it. Database
connections are opened by each child on first use and closed after each
job, never shared across the fork.
"""
import functools
import os
import sys

import django

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project folder
os.environ.setdefault("DJANGO_SETTINGS_MODULE", "shop.settings")
django.setup()

from django.db import close_old_connections, connections, transaction  # noqa: E402

import supervisor  # noqa: E402


def django_job(fn):
    """Django's request cycle for a job: stale connections dropped before, this child's closed after."""
    @functools.wraps(fn)
    def run(ctx, payload):
        close_old_connections()
        try:
            return fn(ctx, payload)
        finally:
            connections.close_all()
    return run


@supervisor.job("send_receipt", timeout=30)
@django_job
def send_receipt(ctx, payload):
    from shop.models import Order

    with transaction.atomic():
        order = Order.objects.select_for_update().get(id=payload["order_id"])
        if order.receipt_sent:
            return {"duplicate": True}  # at-least-once: a second run changes nothing
        ctx.log.info("sending receipt to %s", order.email)
        order.receipt_sent = True
        order.save(update_fields=["receipt_sent"])
    return {"order_id": order.id}
