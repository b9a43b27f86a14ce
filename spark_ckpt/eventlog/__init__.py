"""The job event log: a Delta table of job events, written buffered and replayed tolerantly."""

from spark_ckpt.eventlog.events import EVENT_SCHEMA, Event, EventType
from spark_ckpt.eventlog.reader import EventLogUnreadable, read_events
from spark_ckpt.eventlog.replay import JobHistory, replay
from spark_ckpt.eventlog.writer import EventLogWriter

__all__ = [
    "EVENT_SCHEMA",
    "Event",
    "EventLogUnreadable",
    "EventLogWriter",
    "EventType",
    "JobHistory",
    "read_events",
    "replay",
]
