"""The environment variables the launcher sets for each worker it starts.

Here, at the bottom of the package, because both the launcher (which sets
them) and the callbacks (which read them: `StragglerDetector` writes its
hang report where `HANG_REPORT_ENV` says) use them, and the callbacks sit
below the launcher.
"""

# How many times the group was restarted before this attempt ("0" first).
RESTART_ENV = "KERAS_HETERO_RESTART"
# Workers in this attempt's group.
NUM_WORKERS_ENV = "KERAS_HETERO_NUM_WORKERS"
# Where a hanging worker's report goes (read by the launcher on a hang).
HANG_REPORT_ENV = "KERAS_HETERO_HANG_REPORT"
