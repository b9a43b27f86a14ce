"""Streaming: a DStream-like template over DataFrames, run batch by batch with durable input
allocation and exactly-once Delta/Parquet outputs per batch."""

from spark_ckpt.streaming.context import StreamingContext
from spark_ckpt.streaming.progress import StreamingListener
from spark_ckpt.streaming.keyed import AggregatedStream, KeyedStream, ProcessedStream
from spark_ckpt.streaming.stream import InputStream, Output, Stream
from spark_ckpt.streaming.twophase import TwoPhaseCommitSink

__all__ = ["AggregatedStream", "InputStream", "KeyedStream", "Output", "ProcessedStream",
           "Stream", "StreamingContext", "StreamingListener", "TwoPhaseCommitSink"]
