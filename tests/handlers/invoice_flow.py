import supervisor


@supervisor.job("render_invoice")
def render_invoice(ctx, payload):
    pdf = f"/srv/invoices/{payload['invoice_id']}.pdf"  # render it, idempotently (a retry overwrites)
    return {"invoice_id": payload["invoice_id"], "pdf": pdf, "total": payload["total"]}


@supervisor.job("send_summary")
def send_summary(ctx, payload):
    rendered = [result for state, result in ctx.parents().values() if state == "done"]
    total = sum(r["total"] for r in rendered)
    ctx.log.info("summary: %d invoices, %d cents", len(rendered), total)  # e-mail it, once
    return {"invoices": len(rendered), "total": total}
