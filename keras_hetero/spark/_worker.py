"""The child process of one Spark barrier task: runs the training function.

`python -m keras_hetero.spark._worker DIRECTORY` loads the pickled
`(train_fn, args, kwargs)` from `DIRECTORY/job.pkl`, calls it (with the
`TF_CONFIG` the task set) and pickles its return value into
`DIRECTORY/result.pkl`. It exits when its parent (Spark's Python worker)
dies, e.g. when Spark kills the barrier stage after another task failed.
"""

import os
import pickle
import sys
import threading
import time


def _exit_with_parent(parent):
    while os.getppid() == parent:
        time.sleep(0.5)
    os._exit(1)


def main(directory):
    threading.Thread(
        target=_exit_with_parent, args=(os.getppid(),), daemon=True
    ).start()
    with open(os.path.join(directory, "job.pkl"), "rb") as f:
        train_fn, args, kwargs = pickle.load(f)
    value = train_fn(*args, **kwargs)
    try:
        result = pickle.dumps(value)
    except Exception as error:
        raise TypeError(
            "The value `train_fn` returned must be picklable to reach the "
            f"driver. Received: {type(value).__name__} ({error})."
        ) from error
    with open(os.path.join(directory, "result.pkl"), "wb") as f:
        f.write(result)


if __name__ == "__main__":
    main(sys.argv[1])
