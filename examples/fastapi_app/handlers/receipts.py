"""The handler the FastAPI app enqueues (served by ``tangguh run`` with this folder as its handlers)."""
import dataclasses

import supervisor


@dataclasses.dataclass
class Receipt:
    order_id: int
    email: str


@supervisor.job("send_receipt", timeout=30, payload=Receipt)
def send_receipt(ctx, receipt):
    ctx.log.info("sending receipt")
    return {"sent_to": receipt.email, "order_id": receipt.order_id}
