import pytest

from spark_ckpt.errors import FormatVersionError
from spark_ckpt.execution.result_partition import OutputFile
from spark_ckpt.formats import dump_record, load_record


def test_record_round_trip():
    data = dump_record("thing", 1, {"a": 1})
    assert load_record(data, "thing", (1,))["a"] == 1


@pytest.mark.parametrize("data, message", [
    (b"{not json", "unparseable"),
    (b'{"kind": "other", "format_version": 1}', "expected a thing record, found 'other'"),
    (b'{"kind": "thing", "format_version": 9}', "format_version 9; this release reads 1"),
])
def test_bad_records_are_rejected_clearly(data, message):
    with pytest.raises(FormatVersionError, match=message):
        load_record(data, "thing", (1,))


def test_output_file_round_trip():
    f = OutputFile("sink", "s", "/p", 100, 10, {}, {"day": "2024-01-01", "region": None})
    assert OutputFile.from_json(f.to_json()) == f
