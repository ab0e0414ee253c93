"""Finding slow and hung workers: `scoring` (pure numpy: per-replica
scores, `StragglerEvent`), `communication` and `links` (a slow link, and
the worker behind it) and `detector` (`StragglerDetector`, the Keras
callback, and its hang watchdog)."""
