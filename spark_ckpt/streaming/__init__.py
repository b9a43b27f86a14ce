"""Streaming: a DStream-like template over DataFrames, run batch by batch with durable input
allocation and exactly-once Delta/Parquet outputs per batch."""

from spark_ckpt.sinks.two_phase import TwoPhaseCommitSink
from spark_ckpt.streaming.context import StreamingContext
from spark_ckpt.streaming.runtime.progress import StreamingListener
from spark_ckpt.streaming.template.keyed import AggregatedStream, KeyedStream, ProcessedStream
from spark_ckpt.streaming.template.stream import InputStream, Output, Stream
from spark_ckpt.streaming.template.windows import (
    WindowAggStream,
    cumulate,
    session,
    sliding,
    tumbling,
)

__all__ = ["AggregatedStream", "InputStream", "KeyedStream", "Output", "ProcessedStream",
           "Stream", "StreamingContext", "StreamingListener", "TwoPhaseCommitSink",
           "WindowAggStream", "cumulate", "session", "sliding", "tumbling"]
