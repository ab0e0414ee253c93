"""What the rewritten test modules of a HETERO run use (run.py copies this
file there as `_kh_conformance.py`).

`Model` is `kh.HeteroModel` and `HeteroSequential` is
`kh.HeteroSequential`, so `Model(inputs, outputs)`, `class M(Model)`,
`Sequential([...])` and `Model.from_config(...)` construct keras_hetero's
classes.
"""

import keras_hetero as kh

Model = kh.HeteroModel
HeteroSequential = kh.HeteroSequential
