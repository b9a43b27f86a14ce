"""Tools on top of both capabilities: the ``spark-ckpt`` command, the notebook shell, the report,
validation, operations on a pipeline's directory and the state processor (read, rewrite)."""
