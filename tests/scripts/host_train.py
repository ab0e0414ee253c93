"""`elastic_train.py` under the multi-host launcher.

Run by tests/launcher/test_hosts.py. Prints what the launcher gave this
worker (`TF_CONFIG` task, worker count, `CUDA_VISIBLE_DEVICES`), then runs
`elastic_train.py` with the remaining arguments. `--slow-attempt K
--slow-step-seconds S`: in attempt K, sleep S seconds after each step
instead of `--step-seconds`, so a test can act while that attempt trains,
however loaded the machine.
"""

import json
import os
import runpy
import sys

SCRIPT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "elastic_train.py"
)


def main():
    argv = sys.argv[1:]
    slow = None
    if "--slow-attempt" in argv:
        at = argv.index("--slow-attempt")
        slow = (argv[at + 1], argv[at + 3])  # K, S (--slow-step-seconds S)
        del argv[at : at + 4]
    restart = os.environ.get("KERAS_HETERO_RESTART", "0")
    if slow is not None and slow[0] == restart:
        argv[argv.index("--step-seconds") + 1] = slow[1]
    task = json.loads(os.environ["TF_CONFIG"])["task"]["index"]
    print(
        "launched "
        + json.dumps(
            {
                "restart": int(restart),
                "worker": task,
                "workers": int(os.environ["KERAS_HETERO_NUM_WORKERS"]),
                "devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            }
        ),
        flush=True,
    )
    sys.argv = [SCRIPT, *argv]
    runpy.run_path(SCRIPT, run_name="__main__")


if __name__ == "__main__":
    main()
