"""Every worker stops after the same step: a stop request (a signal, a
preemption) agreed through the step's own collective.

Under MultiWorkerMirroredStrategy each worker process gets its signal at its
own time, maybe a step apart from the others. A worker that stopped at its
own next step boundary would leave the others in a collective it never
joins: they fail there, and a failed chief loses the stop's save. So a
request does not stop the worker that got it; it travels to all of them:

- `request` sets the worker's request, a variable of the model's
  `telemetry.Telemetry`, eagerly between two train-function calls;
- every train step appends the request to its stats vector
  (`Telemetry.with_stop_request`), which the gradients' all-reduce sums
  anyway: no extra collective, no extra round trip;
- after each call the host reads the telemetry totals (Keras 3: in the call,
  `step.train_function_extras`; tf-keras: after it) and `agreed` says
  whether any worker's request travelled in the call's steps. Every worker
  reads the same sums, so every worker stops after the same step. With
  `steps_per_execution > 1` every worker runs the same steps per call, so
  the call boundary where the request is read is the same everywhere too.

An XLA-compiled step carries the request like the rows (it only leaves the
clocks out).

`agrees` is True only where it is needed and works this way: several worker
processes training in one synchronous collective per step. One worker (no
strategy, MirroredStrategy, ...) stops at its own next step boundary as
before; ParameterServerStrategy (only the coordinator runs `fit`) and
low-communication training (no collective per step; a checkpoint waits for a
synchronisation, `low_communication.LocalTraining.save_requested`) keep
their own ways.
"""

from keras_hetero import _distribute
from keras_hetero.training import state


def carries_requests(strategy, settings):
    """Whether the telemetry of a model trained with `strategy` and
    `settings` carries stop requests (see above)."""
    return (
        _distribute.num_workers(strategy) > 1
        and not _distribute.is_parameter_server(strategy)
        and settings.low_communication is None
    )


def agrees(model):
    """Whether the workers training `model` agree on the step to stop at.

    Returns:
        True when stops go through `request` and `agreed`; False when each
        process stops on its own (one worker, parameter servers,
        low-communication training, a model that is not a `HeteroModel`
        or has not made its train function yet).
    """
    run = state.run_state(model)
    telemetry = None if run is None else run.telemetry
    return telemetry is not None and telemetry.carries_stop


def request(model):
    """Asks every worker to stop: the next train step carries the request.

    Call between train-function calls (e.g. in `on_train_batch_begin`),
    only where `agrees(model)`.
    """
    state.run_state(model).telemetry.request_stop()


def agreed(model):
    """Whether the last train-function call carried any worker's request:
    the same answer on every worker (after the call, e.g. in
    `on_train_batch_end`)."""
    return state.run_state(model).telemetry.stop_requests() > 0
