"""An error in a user's function inside Spark tasks is reported once, with its context."""

from __future__ import annotations

import pytest
from processors_for_tests import FailsOnKeySeven

from spark_ckpt import PipelineFailedError, Settings, StreamingContext, UserFunctionError


def test_a_processor_error_names_operator_partition_and_key_once(spark, tmp_path):
    ctx = StreamingContext(spark, 0.1, str(tmp_path / "ckpt"), "uerr",
                           settings=Settings(progress="never", state_parallelism=2))
    gen = ctx.generator_stream("g", rows_per_batch=40, total_rows=40, keys=10)
    gen.key_by("key").process(FailsOnKeySeven(), "key BIGINT, n BIGINT", name="prices") \
        .foreach_batch(lambda df, b: None, name="o")
    with pytest.raises(PipelineFailedError) as info:
        ctx.process_available(timeout=300)
    cause = info.value.__cause__
    assert isinstance(cause, UserFunctionError)
    text = str(info.value)
    assert "operator prices, partition " in text and "process() raised on key (7,)" in text
    # one summary line and one traceback: nothing repeated per task attempt or JVM frame
    assert text.count("process() raised on key") == 1
    assert text.count("Traceback (most recent call last)") == 1
    assert text.count("ValueError: the price of key seven cannot be negative") == 2
    assert "Py4JJavaError" not in text and "org.apache.spark" not in text
