from django.db import models


class Order(models.Model):
    email = models.CharField(max_length=200)
    receipt_sent = models.BooleanField(default=False)

    class Meta:
        app_label = "shop"
