"""Run reports: what every replica did during `fit`, as a PNG and a web page.

`kh.callbacks.RunReport` collects `Records` during `fit` and calls `write`
at the end; `plot` and `write` also work on records you build or keep.
Drawing needs matplotlib, the optional extra `keras-hetero[report]`; the
rest of keras-hetero does not import it.

The package holds what keras-hetero reports during `fit`: `records`
(`Records`), `figure` (`plot`), `page` (`write`: the PNG and the HTML page),
`sources` (what the other callbacks did, step by step), `tensorboard`
(`HeteroTensorBoard`) and `run_report` (`RunReport`). This `__init__`
exports the first three; the callbacks are `kh.callbacks`'.
"""

from keras_hetero.report.figure import plot
from keras_hetero.report.page import ReportFiles
from keras_hetero.report.page import write
from keras_hetero.report.records import Records

__all__ = [
    "Records",
    "ReportFiles",
    "plot",
    "write",
]
