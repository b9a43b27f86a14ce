"""docs/notebook.ipynb runs top to bottom in a real Jupyter kernel, on a classic session and on
a Spark Connect session: build, run in the background, stop from another cell, inspect state;
its last cell checks the state against the rows read."""

from __future__ import annotations

import os

import pytest
from helpers import ROOT

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

pytestmark = pytest.mark.slow


def _execute(tmp_path, **env):
    # the kernel imports spark_ckpt from this checkout, installed or not
    env.setdefault("PYTHONPATH", os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p))
    notebook = nbformat.read(ROOT / "docs" / "notebook.ipynb", as_version=4)
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update({k: str(v) for k, v in env.items()})
    try:
        client = nbclient.NotebookClient(notebook, timeout=600, kernel_name="python3",
                                         resources={"metadata": {"path": str(tmp_path)}})
        client.execute()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    outputs = [o for cell in notebook.cells if cell.cell_type == "code"
               for o in cell.get("outputs", ())]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
    return text


def test_notebook_on_a_classic_session(tmp_path):
    from helpers import test_java_options

    text = _execute(tmp_path, SPARK_CKPT_NOTEBOOK_DIR=tmp_path,
                    PYSPARK_SUBMIT_ARGS=f"--driver-java-options \"{test_java_options()}\" "
                                        "pyspark-shell")
    assert "classic" in text and "rows in 50 keys" in text
    assert (tmp_path / "clicks-ckpt" / "checkpoints").is_dir()


@pytest.mark.connect
def test_notebook_on_spark_connect(tmp_path, connect_url):
    text = _execute(tmp_path, SPARK_CKPT_NOTEBOOK_DIR=tmp_path, SPARK_REMOTE=connect_url)
    assert "Spark Connect" in text and "rows in 50 keys" in text
