"""The one redactor every URL shown to an operator goes through."""
import pytest

from supervisor.backends.base import scheme_of
from supervisor.errors import BrokerError, ConfigError
from supervisor import config
from supervisor.urls import redact

SECRET = "s3cret-Pw"


@pytest.mark.parametrize("url, shown", [
    # userinfo
    (f"redis://:{SECRET}@h:6379/0", "redis://:***@h:6379/0"),
    (f"rediss://app:{SECRET}@h/0", "rediss://app:***@h/0"),
    (f"postgresql://app:{SECRET}@db:5432/x", "postgresql://app:***@db:5432/x"),
    ("postgresql://app:p%40ss@db/x", "postgresql://app:***@db/x"),  # percent-encoded
    (f"postgresql://app:{SECRET}@ss@db/x", "postgresql://app:***@db/x"),  # an unencoded "@" in it
    (f"redis://u:{SECRET}@[::1]:6379/0", "redis://u:***@[::1]:6379/0"),
    # query parameters, any case, every password-like name
    (f"postgresql://app@db/x?password={SECRET}&sslmode=require",
     "postgresql://app@db/x?password=***&sslmode=require"),
    (f"postgresql://app@db/x?PassWord={SECRET}", "postgresql://app@db/x?PassWord=***"),
    (f"postgresql://db/x?sslpassword={SECRET}&passwd={SECRET}&pass={SECRET}",
     "postgresql://db/x?sslpassword=***&passwd=***&pass=***"),
    (f"redis://h/0?token={SECRET}&auth={SECRET}&client_secret={SECRET}&prefix=p",
     "redis://h/0?token=***&auth=***&client_secret=***&prefix=p"),
    (f"postgresql://db/x?pass%77ord={SECRET}", "postgresql://db/x?pass%77ord=***"),
    (f"postgresql://app:{SECRET}@db/x?password={SECRET}", "postgresql://app:***@db/x?password=***"),
    # forms with nothing to hide stay as they are
    ("postgresql:///dbname", "postgresql:///dbname"),
    ("postgresql://app@db/x?host=/var/run/postgresql", "postgresql://app@db/x?host=/var/run/postgresql"),
    ("sqlite:////var/lib/tangguh/broker.db", "sqlite:////var/lib/tangguh/broker.db"),
    ("redis://app@h/0", "redis://app@h/0"),
    # libpq's key=value form and other text that is not a URL
    (f"host=db password={SECRET} user=app", "host=db password=*** user=app"),
    (f"host=db password='{SECRET} x' user=app", "host=db password=*** user=app"),
])
def test_redact_masks_every_password(url, shown):
    assert redact(url) == shown
    assert SECRET not in redact(url)


@pytest.mark.parametrize("url", [
    f"redis://:{SECRET}/x@host/0",       # "/" in the password: the netloc ends early
    f"redis://:{SECRET}?x@host/0",       # "?" in it
    f"redis://:{SECRET}#x@host/0",       # "#" in it
    f"redis://[::1:{SECRET}@host/0",     # unparseable (bad IPv6 literal)
    f"postgresql://app:{SECRET}@[oops/x",
])
def test_redact_masks_what_it_cannot_parse_and_never_raises(url):
    shown = redact(url)
    assert SECRET not in shown and "x@host" not in shown
    assert shown.endswith("***")


def test_redact_takes_anything():
    assert redact(None) == "None" and redact(12) == "12" and redact("") == ""


@pytest.mark.parametrize("url", [f"postgressql://app:{SECRET}@db/x", f"app:{SECRET}@db/x",
                                 f"ftp://u:{SECRET}@h/x"])
def test_a_bad_scheme_is_named_never_the_url(url):
    with pytest.raises(BrokerError) as caught:
        scheme_of(url)
    assert SECRET not in str(caught.value) and "@db" not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        config.from_dict({"broker": {"url": url}})
    assert SECRET not in str(caught.value)
    with pytest.raises(ConfigError) as caught:
        config.from_dict({"toolkit": {"database_url": url}})
    assert SECRET not in str(caught.value) and str(caught.value).startswith("toolkit.database_url: expected")
