"""HeteroModel's training machinery; `keras_hetero/model.py` holds the class
and its Keras surface, each method a call into a module here.

- `step`: the train and test steps, read top to bottom in data order (the
  synchronous step and the low-communication inner step beside it), and
  the host-side wrapper of Keras' train function.
- The step's stages: `precision` (top-level `keras_hetero.precision`) and
  `loss_scale` (float16); `aggregation` (per-replica gradients -> the
  exact global gradient, compressed on the wire if asked, clipped after
  aggregation); `accumulation` (sums over `accumulation_steps`
  micro-steps); `telemetry` (per-replica rows and seconds ->
  `StepStats`; the device-exact clock) and `clock_check` (whether those
  readings mean anything).
- `fitting`: what `fit` / `evaluate` / `predict` do around Keras' own;
  `parameter_server`: the same three under ParameterServerStrategy (one
  closure per worker); `keras_callbacks`: Keras' own file-writing
  callbacks write from the chief only under multi-worker Keras 3;
  `batch_statistics`: what `fit` warns about batch normalisation;
  `agreement`: the check at the start of `fit` that every worker of a
  multi-worker job trains with the same settings.
- `options.Settings`: the model's settings, defined once (immutable);
  `state`: the one way the package reaches a model's settings and
  run-time state; `runtime`: creates that state when first needed and
  saves / loads the part a `.keras` file holds.
- `low_communication`: local steps and the periodic synchronisation.
- `stopping`: several workers stop after the same step, the request
  carried in the step's own collective (what `ElasticCheckpoint` does on
  a signal).
"""
