"""What each Spark barrier task runs (inside Spark's Python worker).

Standard library only, and pickled by value (`keras_hetero.spark` registers
this module with cloudpickle): Spark's Python worker runs it without
importing keras_hetero, TensorFlow or Keras. The training function runs in
a fresh child process (`keras_hetero.spark._worker`): TensorFlow's
collective runtime can be configured once per process, and Spark reuses
its Python workers from one job to the next.
"""

import collections
import json
import os
import socket
import subprocess
import sys
import tempfile

# Lines of a failed worker's output that travel back to the driver.
_TAIL_LINES = 40


def _free_port():
    """A TCP port free on this host now (the child binds it a moment later;
    a port taken meanwhile fails the attempt, and a restart picks anew)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("", 0))
        return sock.getsockname()[1]


def run_task(job, environment, attempt, _partition):
    """The barrier task: `TF_CONFIG` from the barrier, then the child.

    Yields one `(worker index, pickled return value)`.
    """
    from pyspark import BarrierTaskContext

    context = BarrierTaskContext.get()
    index = context.partitionId()
    # The executor's address as Spark reaches it; the port is ours.
    host = context.getTaskInfos()[index].address.rsplit(":", 1)[0]
    # Ordered by partition id: worker i's address is entry i everywhere.
    addresses = context.allGather(f"{host}:{_free_port()}")
    env = {
        **os.environ,
        **environment,
        "TF_CONFIG": json.dumps(
            {
                "cluster": {"worker": addresses},
                "task": {"type": "worker", "index": index},
            }
        ),
        # What Spark's worker can import (its py-files, pyspark), the child
        # can too.
        "PYTHONPATH": os.pathsep.join(path for path in sys.path if path),
    }
    gpus = context.resources().get("gpu")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(gpus.addresses)
    with tempfile.TemporaryDirectory(prefix="keras_hetero-spark-") as work:
        with open(os.path.join(work, "job.pkl"), "wb") as f:
            f.write(job)
        process = subprocess.Popen(
            [sys.executable, "-u", "-m", "keras_hetero.spark._worker", work],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
        )
        tail = collections.deque(maxlen=_TAIL_LINES)
        for line in process.stdout:
            # The executor's log keeps the worker's whole output.
            sys.stderr.write(line)
            tail.append(line)
        status = process.wait()
        if status != 0:
            raise RuntimeError(
                f"keras-hetero worker {index} (attempt {attempt}) exited "
                f"with status {status}. Its last output:\n" + "".join(tail)
            )
        with open(os.path.join(work, "result.pkl"), "rb") as f:
            yield index, f.read()
