"""Deprecated: :func:`read_delta` moved to :mod:`spark_ckpt.storage.delta_reader` (this alias
goes in a later version)."""

import warnings

from spark_ckpt.storage.delta_reader import read_delta

__all__ = ["read_delta"]

warnings.warn("spark_ckpt.delta_reader is deprecated: import read_delta from "
              "spark_ckpt.storage.delta_reader", DeprecationWarning, stacklevel=2)
