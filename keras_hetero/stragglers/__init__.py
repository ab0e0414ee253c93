"""Finding slow and hung workers: `scoring` (pure numpy: per-replica
scores, `StragglerEvent`) and `detector` (`StragglerDetector`, the Keras
callback, and its hang watchdog)."""
