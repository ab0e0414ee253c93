"""The test suite, one folder per part of keras_hetero (docs/how-it-works.md,
"Tests"); shared helpers in `tests.support`.

A package, so that worker processes (forkserver, spawn, Ray, scripts with
the repository on `sys.path`) import test modules and helpers by one name,
`tests.<folder>.<module>`, however pytest was started.
"""
