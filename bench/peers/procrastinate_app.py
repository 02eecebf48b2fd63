"""Procrastinate on PostgreSQL (LISTEN/NOTIFY), defaults, in schema ``BENCH_PG_SCHEMA``."""
from procrastinate import App, PsycopgConnector

from bench import work
from bench.peers import PG_SCHEMA, PG_URL

app = App(connector=PsycopgConnector(conninfo=PG_URL, kwargs={"options": f"-c search_path={PG_SCHEMA}"}))


@app.task(name="bench_run", queue="bench")
def run(kwargs):
    work.run(**kwargs)
