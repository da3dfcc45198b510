"""``manage.py charge_twice``: a new order, its charge enqueued twice at once, both answers."""

from typing import Any

from django.core.management.base import BaseCommand

from shop.models import Order
from shop.tasks import charge


class Command(BaseCommand):
    help = "Create an order and enqueue its charge twice (a double click); print what happened."

    def add_arguments(self, parser: Any) -> None:
        parser.add_argument("--amount", type=int, default=4200, help="the order's amount in cents")
        parser.add_argument("--timeout", type=float, default=60, help="seconds to wait for the worker")

    def handle(self, *args: Any, amount: int, timeout: float, **options: Any) -> None:
        order = Order.objects.create(amount_cents=amount)
        first, second = charge.delay(order.pk), charge.delay(order.pk)
        answers = [first.get(timeout=timeout), second.get(timeout=timeout)]
        order.refresh_from_db()
        for name, result, answer in (("first", first, answers[0]), ("second", second, answers[1])):
            self.stdout.write(f"{name} task {result.id}: {answer}")
        self.stdout.write(f"order {order.pk}: charges={order.charges} charged_cents={order.charged_cents}")
