"""A training script for the ElasticCheckpoint / launcher tests.

Run by `keras-hetero run` (MultiWorkerMirroredStrategy from TF_CONFIG) or
directly (MirroredStrategy over two logical CPUs). Keeps an exactly-once
ledger (`kh.testing.Ledger`) in `<out>`: per train step, the global step
and the example ids this worker's replicas trained on, and can kill or
signal itself: at the k-th step of `--fault-at` in attempt k (restarts are
counted by KERAS_HETERO_RESTART), so one launcher job is killed several
times. `--input` picks the input kind (tests/support/elastic_inputs.py).
"""

import argparse
import json
import os
import pathlib
import signal
import sys
import time

os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
# The repository, for `tests.support`.
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2]))

import numpy as np  # noqa: E402

import keras_hetero as kh  # noqa: E402
from keras_hetero import _compat  # noqa: E402
from keras_hetero._compat import keras  # noqa: E402
from tests.support import elastic_inputs  # noqa: E402
from tests.support import helpers  # noqa: E402

BATCH = 8  # 10 global batches per epoch of elastic_inputs.ROWS


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--ckpt", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--save-every", default="2")
    parser.add_argument(
        "--fault-at",
        default="0",
        help="comma-separated steps: attempt k is killed at the k-th",
    )
    parser.add_argument("--fault-worker", type=int, default=1)
    parser.add_argument("--fault", choices=["KILL", "TERM"], default="KILL")
    parser.add_argument("--stop-after", type=int, default=0)
    parser.add_argument("--attempt", type=int, default=None)
    parser.add_argument(
        "--input", choices=elastic_inputs.KINDS, default="plain"
    )
    parser.add_argument("--data-dir", default=None)
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--sync-save", action="store_true")
    parser.add_argument("--resize", default="keep_global_batch")
    parser.add_argument(
        "--hang-timeout",
        type=float,
        default=0,
        help="kh.Timeouts(watchdog=...) and a StragglerDetector that exits "
        "75 on a hang (network fault tests)",
    )
    parser.add_argument(
        "--step-seconds",
        type=float,
        default=0,
        help="sleep after each step (so a test can act mid-run)",
    )
    parser.add_argument(
        "--rebalance",
        action="store_true",
        help="worker 0 simulated 8x slower; a ShardRebalancer moves shares",
    )
    parser.add_argument(
        "--balance",
        action="store_true",
        help="a ShardRebalancer on equal workers; print the final shares "
        "and the detector's communication events (slow-link test)",
    )
    parser.add_argument("--detector-window", type=int, default=9)
    parser.add_argument(
        "--sync-every",
        type=int,
        default=0,
        help="low-communication training (kh.LowCommunication), inner "
        "SGD with momentum 0.9",
    )
    parser.add_argument(
        "--local-dir",
        default=None,
        help="ElasticCheckpoint(local_directory=...); {worker} is the task",
    )
    parser.add_argument(
        "--ckpt-after-restart",
        default=None,
        help="the shared directory from attempt 1 on (an empty one: the "
        "shared storage lost)",
    )
    args = parser.parse_args()
    faults = [int(step) for step in args.fault_at.split(",") if step]
    multi_worker = "TF_CONFIG" in os.environ
    if not multi_worker:
        kh.testing.logical_cpus(2)
    import tensorflow as tf

    timeouts = None
    if args.hang_timeout:
        timeouts = kh.Timeouts(watchdog=args.hang_timeout)
    if multi_worker and timeouts is not None:
        strategy = timeouts.strategy()
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    elif multi_worker:
        strategy = tf.distribute.MultiWorkerMirroredStrategy()
        task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    else:
        strategy = tf.distribute.MirroredStrategy(["CPU:0", "CPU:1"])
        task = 0
    restart = args.attempt
    if restart is None:
        restart = int(os.environ.get("KERAS_HETERO_RESTART", "0"))

    def extra(step, logs):
        record = {"loss": float(logs.get("loss", float("nan")))}
        record["time"] = time.time()
        if args.balance:
            stats = model.step_stats
            record["compute"] = [float(v) for v in stats.compute_seconds]
            record["call"] = stats.call_seconds
            record["rows"] = [int(v) for v in stats.rows]
        return record

    ledger = kh.testing.Ledger(
        args.out, attempt=restart, worker=task, extra=extra
    )
    if args.input == "augment" and _compat.IS_LEGACY:
        # tf-keras' random layers draw with stateful TF1 ops by default,
        # whose state is inside the op kernel (no checkpoint can hold it);
        # with tf.random.Generator their state is a variable.
        keras.backend.experimental.enable_tf_random_generator()
    keras.utils.set_random_seed(1)
    augment = ()
    if args.input == "augment":
        augment = elastic_inputs.augment_layers(keras)
    low_communication = {}
    if args.sync_every:
        low_communication = dict(
            low_communication=kh.LowCommunication(args.sync_every),
            momentum=0.9,
        )
    with strategy.scope():
        model = helpers.id_model(
            ledger,
            # --balance: equal simulated speeds (2 ms per row), so the
            # compute the rebalancer reads is more than scheduler noise.
            [0.004, 0.0005] if args.rebalance else 0.002 * args.balance,
            augment=augment,
            **low_communication,
        )
    os.makedirs(args.out, exist_ok=True)
    prefix = os.path.join(args.out, f"attempt{restart}-worker{task}")
    if restart == 0 and task == 0:
        np.savez(prefix + "-initial.npz", *model.get_weights())

    class Fault(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if args.step_seconds:
                time.sleep(args.step_seconds)
            if (
                restart < len(faults)
                and task == args.fault_worker
                and step == faults[restart]
            ):
                number = getattr(signal, "SIG" + args.fault)
                os.kill(os.getpid(), number)

    class StopAfter(keras.callbacks.Callback):
        def on_train_batch_end(self, batch, logs=None):
            step = int(model.optimizer.iterations.numpy())
            if step == args.stop_after:
                self.model.stop_training = True

    save_every = args.save_every
    save_every = int(save_every) if save_every.isdigit() else save_every
    ckpt = kh.callbacks.ElasticCheckpoint(
        args.ckpt_after_restart if restart and args.ckpt_after_restart
        else args.ckpt,
        save_every=save_every,
        async_save=not args.sync_save,
        resize=args.resize,
        local_directory=args.local_dir and args.local_dir.format(worker=task),
    )  # fmt: skip
    # The ledger first: a step is in it before a checkpoint holds it.
    callbacks = [ledger, ckpt, Fault()]
    detector = None
    if timeouts is not None:
        detector = kh.callbacks.StragglerDetector(
            hang_timeout=timeouts.watchdog,
            abort_on_hang=True,
            window=args.detector_window,
            patience=2 if args.balance else 3,
        )
        callbacks.append(detector)
    if args.stop_after:
        callbacks.append(StopAfter())
    fit = dict(epochs=args.epochs, verbose=0, callbacks=callbacks)
    if args.input == "arrays":
        # Keras' default shuffle=True: `fit` shards the arrays, with a seed
        # drawn when training starts (or the checkpoint's).
        x, y = elastic_inputs.arrays()
        model.fit(x, y, batch_size=args.batch, shuffle=True, **fit)
    else:
        data = elastic_inputs.dataset(
            args.input, args.batch, strategy, args.data_dir
        )
        if args.rebalance or args.balance:
            callbacks.append(
                kh.callbacks.ShardRebalancer(
                    data,
                    every_n_steps=3,
                    warmup_steps=1,
                    window=3,
                    tolerance=0.0 if args.rebalance else 0.2,
                )
            )
        model.fit(data, **fit)
        if args.balance:
            events = [
                [
                    e.step,
                    e.kind,
                    e.outside_seconds,
                    e.baseline_seconds,
                    list(e.workers),
                    [list(link) for link in e.slow_links],
                ]
                for e in detector.communication_events
            ]
            stragglers = [e.replica for e in detector.events]
            print(
                f"worker {task} balance "
                + json.dumps(
                    {
                        "shares": [float(v) for v in data.shares],
                        "communication": events,
                        "stragglers": stragglers,
                    }
                )
            )
    if task == 0:
        np.savez(prefix + "-final.npz", *model.get_weights())
    print(
        f"worker {task} done at step {int(model.optimizer.iterations.numpy())}"
    )


if __name__ == "__main__":
    main()
