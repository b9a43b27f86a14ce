"""Deterministic input for the example orders job: orders, customers and payments as Parquet.

    python jobs/orders_data.py DIR --orders 2000000 --files 50
"""

from __future__ import annotations

import argparse
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

REGIONS = np.array(["north", "south", "east", "west", "central", "islands"])
METHODS = np.array(["card", "transfer", "cash", "voucher"])


def generate(directory: str, *, orders: int = 200_000, files: int = 8, customers: int = 5_000,
             seed: int = 7) -> dict[str, int]:
    """Write orders/ (``files`` files), customers/ (1 file) and payments/ (``files`` files)."""
    rng = np.random.default_rng(seed)
    for sub in ("orders", "customers", "payments"):
        os.makedirs(os.path.join(directory, sub), exist_ok=True)
    cust = pa.table({
        "customer_id": np.arange(customers, dtype=np.int64),
        "region": REGIONS[rng.integers(0, len(REGIONS), customers)],
        "segment": np.where(rng.random(customers) < 0.2, "business", "consumer"),
    })
    pq.write_table(cust, os.path.join(directory, "customers", "customers-00000.parquet"))
    per_file = orders // files
    for f in range(files):
        start = f * per_file
        n = per_file if f < files - 1 else orders - start
        order_id = np.arange(start, start + n, dtype=np.int64)
        day = rng.integers(0, 60, n)
        ts = (np.datetime64("2026-01-01") + day.astype("timedelta64[D]")).astype("datetime64[us]")
        table = pa.table({
            "order_id": order_id,
            "customer_id": rng.integers(0, customers, n).astype(np.int64),
            "order_ts": pa.array(ts, pa.timestamp("us", tz="UTC")),
            "amount": np.round(rng.gamma(2.0, 40.0, n) - 5.0, 2),
            "quantity": rng.integers(1, 10, n).astype(np.int32),
        })
        pq.write_table(table, os.path.join(directory, "orders", f"orders-{f:05d}.parquet"))
        paid = rng.random(n) < 0.9  # one payment for 90% of the orders
        payments = pa.table({
            "order_id": order_id[paid],
            "paid": np.round(table.column("amount").to_numpy()[paid], 2),
            "method": METHODS[rng.integers(0, len(METHODS), int(paid.sum()))],
        })
        pq.write_table(payments, os.path.join(directory, "payments", f"payments-{f:05d}.parquet"))
    return {"orders": orders, "files": files, "customers": customers}


ORDER_EVENT_SCHEMA = ("order_id BIGINT, customer_id BIGINT, order_ts TIMESTAMP, amount DOUBLE, "
                      "quantity INT")


def drop_order_files(directory: str, *, files: int, rows_per_file: int, first_file: int = 0,
                     customers: int = 5_000, fmt: str = "json", malformed_every: int = 0,
                     seed: int = 7) -> list[str]:
    """Drop order event files into a landing directory, each written aside then moved in.

    File ``k`` holds orders ``k * rows_per_file ...`` and is the same whatever the call, so a
    stream's output can be compared with a batch over the same files. ``malformed_every``
    (JSON only) makes every n-th line unparseable, for the dead-letter path.
    """
    os.makedirs(directory, exist_ok=True)
    written = []
    for f in range(first_file, first_file + files):
        rng = np.random.default_rng(seed * 1_000_003 + f)
        start = f * rows_per_file
        order_id = np.arange(start, start + rows_per_file, dtype=np.int64)
        seconds = rng.integers(0, 60 * 86_400, rows_per_file)
        ts = (np.datetime64("2026-01-01T00:00:00") + seconds.astype("timedelta64[s]"))
        table = pa.table({
            "order_id": order_id,
            "customer_id": rng.integers(0, customers, rows_per_file).astype(np.int64),
            "order_ts": pa.array(ts.astype("datetime64[us]"), pa.timestamp("us", tz="UTC")),
            "amount": np.round(rng.gamma(2.0, 40.0, rows_per_file) - 5.0, 2),
            "quantity": rng.integers(1, 10, rows_per_file).astype(np.int32),
        })
        name = f"orders-{f:06d}.{fmt}"
        tmp = os.path.join(directory, f".{name}.tmp")
        if fmt == "parquet":
            pq.write_table(table, tmp)
        else:
            import json

            with open(tmp, "w") as out:
                for i, row in enumerate(table.to_pylist()):
                    if malformed_every and i % malformed_every == malformed_every - 1:
                        out.write('{"order_id": ' + str(row["order_id"]) + ', "amount": oops\n')
                        continue
                    row["order_ts"] = row["order_ts"].strftime("%Y-%m-%dT%H:%M:%S.%fZ")
                    out.write(json.dumps(row) + "\n")
        final = os.path.join(directory, name)
        os.replace(tmp, final)
        written.append(final)
    return written


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("directory")
    parser.add_argument("--orders", type=int, default=200_000)
    parser.add_argument("--files", type=int, default=8)
    parser.add_argument("--customers", type=int, default=5_000)
    args = parser.parse_args()
    print(generate(args.directory, orders=args.orders, files=args.files,
                   customers=args.customers))


if __name__ == "__main__":
    main()
