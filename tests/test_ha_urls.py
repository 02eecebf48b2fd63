"""The high-availability URL forms and ``broker.redis_wait_replicas``: what is accepted, and a
one-line error for what is not (no server needed: nothing is contacted before the first call)."""
import pytest

from supervisor import cli, config
from supervisor.backends import open_broker
from supervisor.backends.postgres.connection import read_url
from supervisor.errors import BrokerUnusable, ConfigError

SECRET = "s3cret-Pw"


def test_a_sentinel_url_names_the_service_the_db_and_the_sentinels_password():
    b = open_broker(f"redis+sentinel://:{SECRET}@h1:26379,h2/mymaster/3?prefix=p&sentinel_password={SECRET}"
                    "&wait_replicas=1&wait_timeout=250")
    try:
        pool = b.r.connection_pool
        assert pool.service_name == "mymaster" and pool.connection_kwargs["db"] == 3
        assert pool.connection_kwargs["password"] == SECRET
        assert [s.connection_pool.connection_kwargs["port"] for s in pool.sentinel_manager.sentinels] == [26379, 26379]
        assert pool.sentinel_manager.sentinels[0].connection_pool.connection_kwargs["password"] == SECRET
        assert (b.prefix, b.replica_wait, b.cluster) == ("p", (1, 250), False)
    finally:
        b.close()


@pytest.mark.parametrize("url, says", [
    ("redis+sentinel://h1,h2/?prefix=p", "the path must be /<service name>[/<db>]"),
    ("redis+sentinel://h1/svc/x", "db 'x' must be a number"),
    ("redis+sentinel://h1/svc/0/extra", "the path must be"),
    ("redis+cluster://h1:7000/2", "a cluster has database 0 only"),
    ("redis+cluster://h1:7000/?wait_replicas=1", "wait_replicas is not supported on a cluster"),
    ("redis://h1,h2/0", "one host only"),
    ("redis://h1/0?sentinel_password=x", "unknown option(s) sentinel_password"),
    ("redis+sentinel://h1/svc?wait_replicas=-1", "wait_replicas must be a whole number"),
    ("redis+sentinel://h1/svc?wait_timeout=0", "wait_timeout must be a positive number of milliseconds"),
    ("redis://h1/0?wait_replicas=1&wait_timeout=5000", "wait_timeout (5000 ms) must be below socket_timeout (5 s)"),
    ("redis://h1/0?wait_replicas=1&wait_timeout=3000&socket_timeout=2.5",
     "wait_timeout (3000 ms) must be below socket_timeout (2.5 s)"),
    ("redis+sentinel://h1:port/svc", "invalid literal for int() with base 10: 'port'"),
    # redis-py reads 0 as "fail at once": the supervisor showed BROKER DOWN for good, config check ok.
    ("redis://h1/0?socket_timeout=0", "socket_timeout must be a positive number of seconds"),
    ("redis://h1/0?socket_connect_timeout=0", "socket_connect_timeout must be a positive number of seconds"),
    ("redis+sentinel://h1/svc?socket_timeout=nan", "socket_timeout must be a positive number of seconds"),
    ("redis+cluster://h1:7000/?socket_connect_timeout=-1", "socket_connect_timeout must be a positive number"),
])
def test_bad_ha_urls_are_one_line_errors(url, says):
    if "sentinel://" in url:  # a secret in the URL never shows in the message
        url += ("&" if "?" in url else "?") + f"sentinel_password={SECRET}"
    with pytest.raises(BrokerUnusable) as info:
        open_broker(url)
    message = str(info.value)
    assert says in message and "\n" not in message and SECRET not in message


def test_a_wait_timeout_below_the_read_limit_is_taken():
    open_broker("redis://h1/0?wait_replicas=1&wait_timeout=7000&socket_timeout=8").close()


def test_a_postgres_host_list_asks_for_the_read_write_host_unless_told_otherwise():
    assert "target_session_attrs=read-write" in read_url("postgresql://u@h1,h2:5433/db")[0]
    assert "target_session_attrs=any" in read_url("postgresql://u@h1,h2/db?target_session_attrs=any")[0]
    assert "target_session_attrs" not in read_url("postgresql://u@h1/db")[0]


def test_a_postgres_socket_timeout_is_tangguhs_own_option():
    conninfo, schema, socket_timeout = read_url("postgresql://u@h/db?schema=s&socket_timeout=2.5&connect_timeout=3")
    assert (schema, socket_timeout) == ("s", 2.5)
    assert "socket_timeout" not in conninfo and "connect_timeout=3" in conninfo  # libpq would refuse it
    assert read_url("postgresql://u@h/db")[2] == 10.0


@pytest.mark.parametrize("value", ["", "abc", "0", "-1", "nan", "inf"])
def test_a_bad_postgres_socket_timeout_is_refused_naming_it(value):
    with pytest.raises(BrokerUnusable, match="socket_timeout must be a positive number of seconds"):
        read_url(f"postgresql://u@h/db?socket_timeout={value}")


def test_redis_wait_replicas_is_folded_into_the_broker_url(tmp_path):
    cfg = config.from_dict({"broker": {"url": "redis+sentinel://h/svc/0?prefix=p", "redis_wait_replicas": 1}})
    assert cfg.broker.url == "redis+sentinel://h/svc/0?prefix=p&wait_replicas=1"
    assert config.from_dict({"broker": {"url": "redis://h/0"}}).broker.url == "redis://h/0"


@pytest.mark.parametrize("broker, says", [
    ('url = "sqlite:///x.db"\nredis_wait_replicas = 1',
     "broker.redis_wait_replicas: only for a redis:// or redis+sentinel:// broker, not sqlite://"),
    ('url = "redis+cluster://h:7000/"\nredis_wait_replicas = 1',
     "broker.redis_wait_replicas: only for a redis:// or redis+sentinel:// broker, not redis+cluster://"),
    ('url = "redis://h/0"\nredis_wait_replicas = -1',
     "broker.redis_wait_replicas: expected an integer from 0 to 2147483647, got -1"),
    ('url = "redis://h/0?wait_replicas=2"\nredis_wait_replicas = 1',
     "broker.redis_wait_replicas: 1 but broker.url says wait_replicas=2"),
])
def test_config_check_refuses_a_bad_redis_wait_replicas(capsys, tmp_path, broker, says):
    (tmp_path / "handlers").mkdir()
    path = tmp_path / "tangguh.toml"
    path.write_text(f"[broker]\n{broker}\n")
    code = cli.main(["config", "check", "-c", str(path)])
    out, err = capsys.readouterr()
    assert (code, out, err) == (2, "", f"tangguh: error: {says}\n")
    with pytest.raises(ConfigError):
        config.load(str(path))


def test_a_sentinel_url_is_shown_without_either_password():
    from supervisor.urls import redact

    url = f"redis+sentinel://app:{SECRET}@h1:26379,h2:26379/mymaster/0?sentinel_password={SECRET}&prefix=p"
    assert redact(url) == "redis+sentinel://app:***@h1:26379,h2:26379/mymaster/0?sentinel_password=***&prefix=p"
