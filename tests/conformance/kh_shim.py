"""What the rewritten test modules of a HETERO run use (run.py copies this
file there as `_kh_conformance.py`).

`Model` is `kh.HeteroModel` itself, so `Model(inputs, outputs)`,
`class M(Model)` and `Model.from_config(...)` construct HeteroModels.

`HeteroSequential` is used only when run.py is asked to rewrite Sequential
(`--sequential HeteroSequential`): a prototype that puts HeteroModel's
training step on top of `keras.Sequential`. keras_hetero ships no such
class; the prototype lives here to measure what one would pass.
"""

import keras_hetero as kh
from keras_hetero._compat import keras  # the flavour HeteroModel uses

Model = kh.HeteroModel


@keras.saving.register_keras_serializable(package="kh_conformance")
class HeteroSequential(kh.HeteroModel, keras.Sequential):
    """A Sequential model trained by HeteroModel's step (prototype)."""
