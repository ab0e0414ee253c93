"""This host's GPUs and each worker's share of them, found without
TensorFlow (`nvidia-smi -L`, else `/proc/driver/nvidia/gpus`).

`--workers-per-host auto` starts one worker per GPU, each with
`CUDA_VISIBLE_DEVICES` set to its GPU, and one worker on a host without
GPUs; an integer K (and `--workers K` on one machine) splits the GPUs
evenly among K workers.
"""

import os
import re
import shutil
import subprocess

from keras_hetero._checks import check_int

_NVIDIA_PROC = "/proc/driver/nvidia/gpus"


def parse_workers_per_host(value, name="workers_per_host"):
    """`--workers-per-host`: a positive integer or `"auto"`.

    Args:
        value: An int, or a string of one, or `"auto"`.
        name: The argument to name in errors. Defaults to
            `"workers_per_host"`.

    Returns:
        The int, or `"auto"`.

    Raises:
        ValueError: For anything else, naming the value.

    Example:

    >>> parse_workers_per_host("3"), parse_workers_per_host("auto")
    (3, 'auto')
    """
    if value == "auto":
        return "auto"
    text = str(value).strip()
    if not isinstance(value, bool) and text.isdigit() and int(text) >= 1:
        return int(text)
    raise ValueError(
        f"Invalid value for argument `{name}`. Received: {name}={value!r}. "
        "Expected an integer >= 1 or 'auto' (one worker per GPU)."
    )


def discover_gpus(environ=None, run=subprocess.run):
    """The GPUs this host's workers may use, as `CUDA_VISIBLE_DEVICES`
    entries.

    If the launcher's own `CUDA_VISIBLE_DEVICES` is set, its entries (an
    empty value or `-1`: none). Else the NVIDIA GPUs `nvidia-smi -L` lists
    (their indices), else as many as `/proc/driver/nvidia/gpus` has
    entries; else none. TensorFlow is not imported (it would initialise
    every GPU in the launcher). Other accelerators are not discovered: pass
    `devices_per_host`.

    Args:
        environ: The environment to read. Defaults to `os.environ`.
        run: `subprocess.run`, replaceable in tests.

    Returns:
        A list of strings such as `["0", "1"]`.
    """
    environ = os.environ if environ is None else environ
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        # CUDA stops at the first invalid entry; -1 is the usual "none".
        for position, entry in enumerate(entries):
            if entry.startswith("-"):
                return entries[:position]
        return entries
    if shutil.which("nvidia-smi", path=environ.get("PATH")):
        try:
            listed = run(
                ["nvidia-smi", "-L"],
                capture_output=True,
                text=True,
                timeout=30,
            )
        except (OSError, subprocess.SubprocessError):
            listed = None
        if listed is not None and listed.returncode == 0:
            return parse_nvidia_smi(listed.stdout)
    try:
        return [str(i) for i in range(len(os.listdir(_NVIDIA_PROC)))]
    except OSError:
        return []


def host_gpus(devices_per_host=None, environ=None):
    """This host's GPUs: `discover_gpus(environ)`, or, given
    `devices_per_host` N, N GPUs numbered 0 to N-1 (0: none).

    Raises:
        ValueError: If `devices_per_host` is not None or an int >= 0.
    """
    if devices_per_host is None:
        return discover_gpus(environ)
    count = check_int("devices_per_host", devices_per_host, 0)
    return [str(i) for i in range(count)]


def parse_nvidia_smi(text):
    """The GPU indices in `nvidia-smi -L` output (`GPU 0: ... (UUID: ...)`
    lines; MIG device lines are not separate GPUs here).

    Example:

    >>> parse_nvidia_smi("GPU 0: A100 (UUID: GPU-a)\\nGPU 1: A100 (UUID: "
    ...                  "GPU-b)\\n")
    ['0', '1']
    """
    return re.findall(r"^GPU (\d+):", text, re.M)


def worker_devices(workers_per_host, gpus, name="workers_per_host"):
    """Each worker's `CUDA_VISIBLE_DEVICES` on a host with `gpus`.

    `"auto"`: one worker per GPU, or one worker (unset) without GPUs; so
    hosts with 8 and 4 GPUs make 12 workers of one GPU each. An integer K:
    K workers with `len(gpus) / K` GPUs each (consecutive), or K workers
    with it unset when the host has no GPU.

    Args:
        workers_per_host: An int >= 1 or `"auto"`.
        gpus: The host's GPUs (`discover_gpus`).
        name: The argument to name in errors. Defaults to
            `"workers_per_host"`.

    Returns:
        A list with one entry per worker: a `CUDA_VISIBLE_DEVICES` string,
        or None to leave the variable as the launcher has it.

    Raises:
        ValueError: If K does not divide the number of GPUs.

    Example:

    >>> worker_devices("auto", ["0", "1"]), worker_devices("auto", [])
    (['0', '1'], [None])
    >>> worker_devices(2, ["0", "1", "2", "3"])
    ['0,1', '2,3']
    """
    workers_per_host = parse_workers_per_host(workers_per_host, name)
    gpus = [str(g) for g in gpus]
    if workers_per_host == "auto":
        return list(gpus) or [None]
    if not gpus:
        return [None] * workers_per_host
    if len(gpus) % workers_per_host:
        raise ValueError(
            f"Invalid value for argument `{name}`. Received: {name}="
            f"{workers_per_host!r} on a host with {len(gpus)} GPU(s) "
            f"({','.join(gpus)}). Expected a divisor of the GPU count "
            "(every worker gets as many)"
            + (", or 'auto'" if name == "workers_per_host" else "")
            + "; or devices_per_host=0 "
            "(--devices-per-host 0) to leave CUDA_VISIBLE_DEVICES alone "
            "and let every worker see every GPU."
        )
    each = len(gpus) // workers_per_host
    return [
        ",".join(gpus[i * each : (i + 1) * each])
        for i in range(workers_per_host)
    ]
