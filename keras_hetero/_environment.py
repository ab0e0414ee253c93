"""The environment variables the launcher sets for each worker it starts.

Here, at the bottom of the package, because both the launcher (which sets
them) and the callbacks (which read them: `StragglerDetector` writes its
hang report where `HANG_REPORT_ENV` says) use them, and the callbacks sit
below the launcher.
"""

# The cluster and this worker's task in it (TensorFlow's own variable).
TF_CONFIG_ENV = "TF_CONFIG"
# How many times the group was restarted before this attempt ("0" first).
RESTART_ENV = "KERAS_HETERO_RESTART"
# Workers in this attempt's group.
NUM_WORKERS_ENV = "KERAS_HETERO_NUM_WORKERS"
# Where a hanging worker's report goes (read by the launcher on a hang).
HANG_REPORT_ENV = "KERAS_HETERO_HANG_REPORT"
# Where a worker appends the times it reached each restart phase
# (`keras_hetero._phases`; the launcher logs them).
PHASES_ENV = "KERAS_HETERO_PHASES"
# The exit code of a worker that found a step hung and wrote its hang
# report (`StragglerDetector(abort_on_hang=True)`): the launcher then gives
# the others time to write theirs.
HANG_EXIT_CODE = 75
