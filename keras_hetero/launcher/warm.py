"""Warm workers: a restart without importing TensorFlow again.

Importing TensorFlow, Keras and keras_hetero is the biggest phase of a
restart (about 4.4 s of the 8 s from a kill to the first step of the new
attempt on this project's soak, `benchmarks/RESULTS.md`). So the launcher
keeps, per worker, a *spare*: a process of the worker's interpreter that
has done those imports (`main`) and waits
for one line on its stdin, the worker's command and environment. On a
restart the launcher hands each new worker to a spare instead of starting
a process; the spare runs the script as `python SCRIPT ARGS` (or `python
-m MODULE ARGS`) would: `sys.argv`, `__name__ == "__main__"`, `__file__`,
`sys.path[0]`, the exit status and the traceback of an exception.

A spare is used once (it becomes the worker), so no TensorFlow runtime is
ever reused after a failed collective, and nothing is forked. The launcher
starts the spares for the next attempt once every worker of this one
trained a step (not while they start: a restart is where every second
counts), one per worker that imported keras_hetero, at the lowest CPU
priority where it can give the priority back when the spare becomes a
worker (as root, or within `RLIMIT_NICE`): on a busy CPU they import in
its gaps, and a spare still importing when a restart comes is handed its
worker all the same (it is then ahead of a new process). Each costs one
idle process with the libraries imported (about 0.7 GB resident on
this machine) per worker.

A spare serves a worker only if its command is a Python interpreter
running a script or a module (`spare_command`) and its environment equals
the worker's but for the variables set per attempt (`PER_ATTEMPT_ENV`);
otherwise the worker starts cold, as without spares. A script that sets a
variable read when TensorFlow or Keras is imported (`_phases.IMPORT_ENV`,
such as `TF_USE_LEGACY_KERAS`) before importing them gets a spare imported
with the value the first (cold) attempt's workers had at `import
keras_hetero`. Should a script in a spare still set one to another value,
the spare prints why and exits with `REFUSED_EXIT_CODE`; the launcher then
starts every later worker cold (`launch(warm=False)`, `keras-hetero run
--no-warm`, from the start).
"""

import importlib.machinery
import io
import json
import os
import resource
import runpy
import subprocess
import sys
import types
import zipfile

from keras_hetero import _phases
from keras_hetero._environment import HANG_REPORT_ENV
from keras_hetero._environment import NUM_WORKERS_ENV
from keras_hetero._environment import PHASES_ENV
from keras_hetero._environment import RESTART_ENV
from keras_hetero._environment import TF_CONFIG_ENV

# Set by the launcher for each attempt; none is read at import.
PER_ATTEMPT_ENV = (
    TF_CONFIG_ENV,
    RESTART_ENV,
    NUM_WORKERS_ENV,
    HANG_REPORT_ENV,
    PHASES_ENV,
)
# A spare's exit status when the script set an import-time variable to a
# value other than the one the spare imported with.
REFUSED_EXIT_CODE = 76
# Python's options without an argument that leave the script's run as it
# is (`-c`, `-i`, `-h`, `-V` and long options are not warmed); `-W` and
# `-X` take one.
_FLAGS = frozenset("bBdEIOPqRsSuv")
_WITH_ARGUMENT = ("-W", "-X")
_LOWEST_PRIORITY = 19
# A spare's program (not `-m` this module: the package imports it first).
_SPARE = (
    "import sys; from keras_hetero.launcher import warm; sys.exit(warm.main())"
)


def spare_command(argv):
    """The command of a spare for worker command `argv`, or None.

    Args:
        argv: A worker's command, such as `[sys.executable, "train.py"]`.

    Returns:
        `[python, *options, "-c", SPARE]` (`SPARE` runs `main`) for
        `[python, *options, SCRIPT | -m MODULE, *args]`, else None.

    Example:

    >>> spare_command(["python3", "-u", "train.py", "--epochs", "3"])[:3]
    ['python3', '-u', '-c']
    >>> spare_command(["bash", "train.sh"]) is None
    True
    """
    split = _split(argv)
    if split is None:
        return None
    interpreter, options, _, _, _ = split
    return [interpreter, *options, "-c", _SPARE]


def _split(argv):
    """`(interpreter, options, kind, target, args)` of a Python command
    (`kind` "path" or "module"), or None."""
    argv = [str(part) for part in argv]
    if not argv or not os.path.basename(argv[0]).startswith("python"):
        return None
    options, at = [], 1
    while at < len(argv) and argv[at].startswith("-") and argv[at] != "-":
        option = argv[at]
        if option == "-m" and at + 1 < len(argv):
            return argv[0], options, "module", argv[at + 1], argv[at + 2 :]
        if option in _WITH_ARGUMENT and at + 1 < len(argv):
            options += argv[at : at + 2]
            at += 2
            continue
        if option[:2] in _WITH_ARGUMENT or set(option[1:]) <= _FLAGS:
            options.append(option)
            at += 1
            continue
        return None  # -c, -i, a long option: run as it is
    if at >= len(argv) or argv[at] == "-":
        return None
    return argv[0], options, "path", argv[at], argv[at + 1 :]


def key(env):
    """What a spare's environment must share with a worker's: all of it
    but `PER_ATTEMPT_ENV`."""
    return {k: v for k, v in env.items() if k not in PER_ATTEMPT_ENV}


def can_lower_priority():
    """Whether this process may lower a child's CPU priority and give it
    back later (Linux lets only root, or `RLIMIT_NICE`, raise one)."""
    if os.geteuid() == 0:
        return True
    soft, _ = resource.getrlimit(resource.RLIMIT_NICE)
    if soft == resource.RLIM_INFINITY:
        return True
    return 20 - soft <= os.getpriority(os.PRIO_PROCESS, 0)


def _set_priority(pid, value):
    """Sets the CPU priority of every thread of process `pid` (Linux
    keeps one per thread)."""
    try:
        threads = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        threads = [pid]
    for thread in threads:
        try:
            os.setpriority(os.PRIO_PROCESS, thread, value)
        except OSError:
            pass  # the thread ended, or no right to: the priority stays


class Spare:
    """A process that imported the libraries and waits to become a worker.

    Args:
        argv: The worker command it serves (see `spare_command`).
        env: The worker's environment (`PER_ATTEMPT_ENV` are left out).
        imported: Values of `_phases.IMPORT_ENV` to import with (what the
            script had at `import keras_hetero`), None to leave them be.
        lower_priority: Start at the lowest CPU priority; `take` gives the
            launcher's back.

    Raises:
        ValueError: If `argv` is not a command a spare can run.
    """

    def __init__(self, argv, env, imported=None, lower_priority=False):
        command = spare_command(argv)
        if command is None:
            raise ValueError(f"not a Python script or module command: {argv}")
        self.argv, self.key = list(argv), key(env)
        start_env = dict(self.key)
        for name, value in (imported or {}).items():
            if value is None:
                start_env.pop(name, None)
            else:
                start_env[name] = value
        self.process = subprocess.Popen(
            command,
            env=start_env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self._priority = None
        if lower_priority:
            self._priority = os.getpriority(os.PRIO_PROCESS, 0)
            _set_priority(self.process.pid, _LOWEST_PRIORITY)

    def serves(self, argv, env):
        """Whether this spare can run worker command `argv` with `env`."""
        return list(argv) == self.argv and key(env) == self.key

    def take(self, argv, env):
        """Hands the worker `argv`, `env` to the spare.

        Returns:
            The spare's `subprocess.Popen`, now the worker's; None if the
            spare had died (see `output`).
        """
        if self.process.poll() is not None:
            return None
        if self._priority is not None:
            _set_priority(self.process.pid, self._priority)
        spec = {"argv": list(argv), "env": dict(env)}
        try:
            self.process.stdin.write(json.dumps(spec).encode() + b"\n")
            self.process.stdin.close()
        except OSError:  # it died just now
            self.process.wait()
            return None
        return self.process

    def output(self):
        """What a dead spare printed (its last lines)."""
        text = self.process.stdout.read().decode(errors="replace")
        return "\n".join(text.strip().splitlines()[-5:])

    def close(self):
        """Stops the spare (unless it became a worker)."""
        if self.process.stdin.closed:
            return
        self.process.kill()
        self.process.wait()
        self.process.stdin.close()
        self.process.stdout.close()


# In a spare: what the variables read at import were when it imported.
_imported = {}


def _normal(name, value):
    """`value` of import-time variable `name` as what it selects."""
    if name == "TF_USE_LEGACY_KERAS":
        return (value or "0").lower() in ("1", "true", "yes")
    if name == "KERAS_BACKEND":
        return value or "tensorflow"
    return value


class _Watched(type(os.environ)):
    """`os.environ` in a spare's script: refuses to change what the
    spare imported with."""

    def __setitem__(self, name, value):
        _check(name, value)
        super().__setitem__(name, value)

    def __delitem__(self, name):
        _check(name, None)
        super().__delitem__(name)


def _check(name, value):
    if name not in _imported:
        return
    if _normal(name, value) == _normal(name, _imported[name]):
        return
    print(
        f"[keras-hetero warm worker] the script sets {name}={value!r}, but "
        f"this process imported TensorFlow and Keras with "
        f"{_imported[name]!r}; exiting with {REFUSED_EXIT_CODE} so the "
        f"launcher starts workers cold (keras-hetero run --no-warm does "
        f"from the start)",
        file=sys.stderr,
        flush=True,
    )
    os._exit(REFUSED_EXIT_CODE)


def main():
    """A spare's life: the libraries are imported (by importing this
    module's package); waits for its worker and runs it."""
    import keras_hetero  # noqa: F401  (TensorFlow, Keras: the point)

    line = sys.stdin.buffer.readline()
    if not line:
        return 0  # the launcher no longer needs it
    spec = json.loads(line)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    _imported.update({n: os.environ.get(n) for n in _phases.IMPORT_ENV})
    os.environ.clear()
    os.environ.update(spec["env"])
    os.environ.__class__ = _Watched
    # This worker's `imported` phase: now (the spare imported before),
    # with what it imported with (the next spare imports the same).
    _phases.mark(_phases.IMPORTED, imported_with=dict(_imported))
    _, _, kind, target, args = _split(spec["argv"])
    sys.argv = [target, *args]
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
        return 0
    path = os.path.abspath(target)
    if not getattr(sys.flags, "safe_path", False):  # -P, Python 3.11+
        sys.path[0] = os.path.dirname(path)
    if not os.path.isfile(path) or zipfile.is_zipfile(path):
        runpy.run_path(target, run_name="__main__")  # a directory, a zip
        return 0
    # As `python SCRIPT` runs it: `sys.argv[0]` as given, `__file__`
    # absolute (Python 3.9+), a new `__main__` (runpy's would set
    # `sys.argv[0]` to the path).
    main_module = types.ModuleType("__main__")
    main_module.__file__ = path
    main_module.__loader__ = importlib.machinery.SourceFileLoader(
        "__main__", path
    )
    sys.modules["__main__"] = main_module
    with io.open_code(path) as f:
        code = compile(f.read(), path, "exec")
    exec(code, main_module.__dict__)
    return 0
