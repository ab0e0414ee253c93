"""The training step's stages, in the order `HeteroModel.train_step` runs
them (the step itself is in `keras_hetero/model.py`):

1. `precision` (top-level `keras_hetero.precision`): which dtype each layer
   computes in; `loss_scale`: the loss scale of float16 training.
2. Forward pass and loss x rows per replica (`HeteroModel.train_step`).
3. `aggregation`: per-replica gradients -> exact global gradient (sum of
   rows x mean, divided by the global rows), compressed on the wire if
   asked, clipped after aggregation.
4. `accumulation`: sums over `accumulation_steps` micro-steps;
   `loss_scale.guarded_apply`: the guarded apply (skipped everywhere when a
   replica's gradient is not finite).
5. `telemetry`: per-replica rows and seconds -> `StepStats`.

`parameter_server` runs the same step under ParameterServerStrategy (one
closure per worker), and `keras_callbacks` makes Keras' own file-writing
callbacks write from the chief only under multi-worker Keras 3.
"""
