"""An order that is charged once, however often its charge task is delivered."""

from django.db import models


class Order(models.Model):
    """A customer's order; ``charges`` counts the charges actually written."""

    amount_cents = models.IntegerField()
    charged_cents = models.IntegerField(default=0)
    charges = models.IntegerField(default=0)

    def __str__(self) -> str:
        return f"order {self.pk}: charged {self.charged_cents} of {self.amount_cents} cents"
