"""Cross-site request forgery: every action carries the session's secret token.

A form sends it as the ``csrf`` field, a script using the session as the
``X-CSRF-Token`` header. Bearer-token requests need none: a browser never
attaches that header on its own, so another site cannot forge one.
"""
import hmac
import secrets


def token(request):
    """The session's token, made on first use (every page that shows a form calls this)."""
    value = request.session.get("csrf")
    if not value:
        value = request.session["csrf"] = secrets.token_urlsafe(32)
    return value


def valid(request, identity, form):
    if identity is not None and identity.via == "token":
        return True
    expected = request.session.get("csrf")
    sent = form.get("csrf") if form is not None else None
    sent = sent or request.headers.get("x-csrf-token")
    return bool(expected and isinstance(sent, str) and hmac.compare_digest(sent, expected))
