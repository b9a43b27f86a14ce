"""Sources: where each batch's rows come from.

Streaming sources whose position is an offset the allocation records (files, Delta tables, the
generator), receivers that write ahead what cannot be replayed (queue, socket), and the inputs of
a batch job (file splits, DataFrames) with the identity of the files they read."""
