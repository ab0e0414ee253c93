"""`python -m keras_hetero.run --workers N SCRIPT [ARGS]`: see `launcher`."""

import sys

from keras_hetero.launcher.cli import run_main

if __name__ == "__main__":
    sys.exit(run_main())
