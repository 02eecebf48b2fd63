"""A minimal Django project for the recipe: one app, one SQLite database named by SHOP_DB."""
import os

SECRET_KEY = "example-only"
INSTALLED_APPS = ["shop"]
DATABASES = {"default": {"ENGINE": "django.db.backends.sqlite3", "NAME": os.environ.get("SHOP_DB", "shop.db")}}
DEFAULT_AUTO_FIELD = "django.db.models.AutoField"
USE_TZ = True
