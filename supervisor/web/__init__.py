"""``tangguh web``: the operator's console, a separate process that talks only to the broker.

One console serves every supervisor sharing a broker (their records are in it).
The parts: ``app.py`` wires them; ``auth.py`` (who is asking), ``csrf.py`` and
``headers.py`` (what a browser may do), ``redact.py`` (what nobody sees),
``brokerio.py`` (the broker from an event loop, outages turned into banners),
``live.py`` (the sampler and server-sent events), ``pages.py`` (the HTML views),
``actions.py`` (every change, logged), ``api.py`` (the same as JSON), ``forms.py``
(the job filter from a query string). Needs the ``web`` extra: ``pip install 'tangguh[web]'``.
"""
