"""Keyed processors the tests pickle by reference (Python workers import this module)."""

from __future__ import annotations

from spark_ckpt import KeyedProcessor


class FailsOnKeySeven(KeyedProcessor):
    def process(self, key, rows, ctx):
        if key[0] == 7:
            raise ValueError("the price of key seven cannot be negative")
        yield (key[0], len(rows))
