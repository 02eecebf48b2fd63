"""The producer side: place an order and enqueue its receipt only if the order commits."""
from django.db import transaction

from .models import Order


def place_order(email, fail=False):
    with transaction.atomic():
        order = Order.objects.create(email=email)
        # Enqueue after COMMIT: a rolled-back order never gets a receipt job, and the
        # worker never looks for an order row that is not committed yet.
        transaction.on_commit(lambda: _receipts().send_receipt.enqueue({"order_id": order.id}))
        if fail:
            raise RuntimeError("payment declined")
    return order


def _receipts():
    import receipts  # the handler module (the handlers folder is on sys.path)

    return receipts
