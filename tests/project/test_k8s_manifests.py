"""The Kubernetes recipe (examples/k8s/) is valid and hangs together.

Every document of every YAML file under examples/k8s/, rendered as
`envsubst` renders it, is validated against the Kubernetes API schemas
(`kubernetes-validate`, offline, strict: unknown fields fail). The rest
checks what no schema can: that the pieces name each other (the headless
Service, rank 0's pod name, the Secret, the volume claim, the image's
script), that the node ranks of both pools cover `--nnodes` once, and that
restarts and disruptions fit the launcher's. No cluster, no network;
nothing imports TensorFlow.
"""

import ast
import pathlib
import re
import shlex
import shutil
import subprocess

import pytest

yaml = pytest.importorskip("yaml")

ROOT = pathlib.Path(__file__).resolve().parents[2]
RECIPE = ROOT / "examples" / "k8s"
MANIFESTS = sorted([*RECIPE.glob("**/*.yaml"), *RECIPE.glob("**/*.yml")])
DOCS = ROOT / "docs" / "multi-machine.md"
# Kubernetes versions whose schemas the manifests must satisfy: an older
# one still offered by the managed services, and the newest one
# kubernetes-validate ships.
KUBERNETES_VERSIONS = ("1.32", "1.37")
# What a user sets before `envsubst` (docs/multi-machine.md).
VALUES = {
    "IMAGE": "registry.example.com/ml/keras-hetero-train:0.1.0",
    "RWX_STORAGE_CLASS": "standard-rwx",
}
PLACEHOLDER = re.compile(r"\$\{(\w+)\}")
GPU = "nvidia.com/gpu"
LAUNCHER_CLI = ROOT / "keras_hetero" / "launcher" / "cli.py"
NODE_RANK = "$((RANK_OFFSET+JOB_COMPLETION_INDEX))"


def placeholders(text):
    return set(PLACEHOLDER.findall(text))


def render(text, values=VALUES):
    """What `envsubst '$NAME ...'` makes of `text` for `values`' names:
    `${NAME}` and `$NAME` replaced, any other `$` (the shell's) untouched."""
    names = "|".join(map(re.escape, values))
    pattern = re.compile(rf"\$(?:\{{({names})\}}|({names})(?!\w))")
    return pattern.sub(
        lambda match: values[match.group(1) or match.group(2)], text
    )


def documents(path):
    return [
        document
        for document in yaml.safe_load_all(render(path.read_text()))
        if document is not None
    ]


def all_documents():
    return [document for path in MANIFESTS for document in documents(path)]


def of_kind(kind):
    return [d for d in all_documents() if d["kind"] == kind]


def pools():
    """The training Jobs, one per node pool, by name."""
    return {job["metadata"]["name"]: job for job in of_kind("Job")}


def pod_spec(job):
    return job["spec"]["template"]["spec"]


def container(job):
    (only,) = pod_spec(job)["containers"]
    return only


def environment(job):
    return {item["name"]: item for item in container(job)["env"]}


def launch(job):
    """`(launcher flags, script, script arguments)` of the pod's command."""
    assert container(job)["command"] == ["/bin/sh", "-c"]
    (line,) = container(job)["args"]
    words = shlex.split(line)
    assert words[:3] == ["exec", "keras-hetero", "run"], (
        "exec: the launcher replaces the shell and gets the pod's SIGTERM"
    )
    flags = {}
    position = 3
    while words[position].startswith("--"):
        flags[words[position]] = words[position + 1]
        position += 2
    return flags, words[position], words[position + 1 :]


def example(script):
    """The file under examples/ that the image holds as `script`."""
    return ROOT / "examples" / pathlib.PurePath(script).name


def min_hosts(nnodes):
    return int(nnodes.split(":")[0])


def max_hosts(nnodes):
    return int(nnodes.split(":")[-1])


def rank_zero_job():
    (job,) = [
        job
        for job in pools().values()
        if environment(job)["RANK_OFFSET"]["value"] == "0"
    ]
    return job


def test_recipe_has_its_files():
    names = {path.name for path in MANIFESTS}
    assert names == {"storage.yaml", "train.yaml"}
    assert (RECIPE / "Dockerfile").is_file()


def test_placeholders_are_the_documented_values_and_all_rendered():
    used = set().union(*(placeholders(p.read_text()) for p in MANIFESTS))
    assert used == set(VALUES)
    for path in MANIFESTS:
        assert "${" not in render(path.read_text()), path


@pytest.mark.skipif(not shutil.which("envsubst"), reason="no envsubst")
def test_render_equals_envsubst():
    shell_format = " ".join(f"${name}" for name in VALUES)
    for path in MANIFESTS:
        rendered = subprocess.run(
            [shutil.which("envsubst"), shell_format],
            input=path.read_text(),
            env=VALUES,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        assert rendered == render(path.read_text()), path


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_every_manifest_is_valid_kubernetes(version):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate",
        reason="kubernetes-validate is not installed (it is in the `test` "
        'extra: pip install -e ".[test]")',
    )
    checked = 0
    for path in MANIFESTS:
        for document in documents(path):
            where = f"{path.name}: {document['kind']}"
            try:
                kubernetes_validate.validate(document, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                pytest.fail(
                    f"{where} is not valid Kubernetes {version}:\n{error}"
                )
            checked += 1
    assert checked == 5  # the claim, Service, budget and the two Jobs


def test_two_pools_run_one_indexed_job_each():
    jobs = pools()
    assert len(jobs) == 2
    for job in jobs.values():
        spec = job["spec"]
        assert spec["completionMode"] == "Indexed"
        assert spec["parallelism"] == spec["completions"], (
            "every host of the group runs at once"
        )
        # The launcher restarts workers inside the pod; a launcher that
        # exits non-zero is restarted in the same pod (same name).
        assert pod_spec(job)["restartPolicy"] == "OnFailure"


def test_each_pool_requests_its_gpus_on_its_own_nodes():
    jobs = list(pools().values())
    for job in jobs:
        resources = container(job)["resources"]
        gpus = resources["requests"][GPU]
        assert isinstance(gpus, int) and gpus > 0
        assert resources["limits"][GPU] == gpus
        assert any(
            toleration["key"] == GPU
            for toleration in pod_spec(job)["tolerations"]
        )
        assert pod_spec(job)["nodeSelector"]
    selectors = [pod_spec(job)["nodeSelector"] for job in jobs]
    assert selectors[0].keys() == selectors[1].keys()
    assert selectors[0] != selectors[1], "each pool on its own nodes"


def test_service_is_headless_and_selects_the_pods_of_both_pools():
    (service,) = of_kind("Service")
    spec = service["spec"]
    assert spec["clusterIP"] == "None"
    # Rank 0's name must resolve while its pod is not yet ready.
    assert spec["publishNotReadyAddresses"] is True
    for job in pools().values():
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert spec["selector"].items() <= labels.items()
        assert pod_spec(job)["subdomain"] == service["metadata"]["name"]


def test_rdzv_endpoint_is_rank_0_pod_behind_the_service():
    (service,) = of_kind("Service")
    flags, _, _ = launch(rank_zero_job())
    host, port = flags["--rdzv-endpoint"].rsplit(":", 1)
    # An Indexed Job's pod is named <job>-<index>; with `subdomain`, that
    # name under the Service resolves to the pod.
    rank_zero_pod = f"{rank_zero_job()['metadata']['name']}-0"
    assert host == f"{rank_zero_pod}.{service['metadata']['name']}"
    assert int(port) in [entry["port"] for entry in service["spec"]["ports"]]
    (rendezvous,) = container(rank_zero_job())["ports"]
    assert rendezvous["containerPort"] == int(port)
    # A non-loopback endpoint: rank 0 must listen beyond loopback.
    assert flags["--rdzv-bind"] == "0.0.0.0"


def test_node_ranks_of_both_pools_cover_nnodes_once():
    ranks = []
    for job in pools().values():
        flags, _, _ = launch(job)
        assert flags["--node-rank"] == NODE_RANK
        offset = int(environment(job)["RANK_OFFSET"]["value"])
        ranks += [offset + index for index in range(job["spec"]["completions"])]
    nnodes = launch(rank_zero_job())[0]["--nnodes"]
    assert sorted(ranks) == list(range(max_hosts(nnodes)))


def test_every_pool_runs_the_same_launcher_command():
    """The launcher refuses a host whose script or arguments differ from
    rank 0's; the pools differ in their environment only."""
    commands = [container(job)["args"] for job in pools().values()]
    assert commands[0] == commands[1]
    images = [container(job)["image"] for job in pools().values()]
    assert images == [VALUES["IMAGE"]] * 2
    flags, script, arguments = launch(rank_zero_job())
    assert flags["--workers-per-host"] == "auto", "one worker per GPU"
    known = LAUNCHER_CLI.read_text()
    for flag in flags:
        assert f'"{flag}"' in known, f"keras-hetero run has no {flag}"
    source = example(script).read_text()
    options = arguments[0::2]
    for option in options:
        assert f'"{option}"' in source, f"{script} has no {option}"
    assert "--simulate-speeds" not in options, "real GPUs: no simulated sleeps"


def test_token_comes_from_the_documented_secret():
    references = []
    for job in pools().values():
        token = environment(job)["KERAS_HETERO_RDZV_TOKEN"]
        references.append(token["valueFrom"]["secretKeyRef"])
    assert references[0] == references[1]
    # The Secret is made once by hand (a token in a manifest would change
    # on every apply); the docs' command must make this one.
    command = (
        f"kubectl create secret generic {references[0]['name']} "
        f'--from-literal={references[0]["key"]}="$(openssl rand -hex 16)"'
    )
    assert command in DOCS.read_text()


def test_checkpoint_is_on_the_shared_read_write_many_claim():
    (claim,) = of_kind("PersistentVolumeClaim")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for job in pools().values():
        volumes = {
            volume["name"]: volume["persistentVolumeClaim"]["claimName"]
            for volume in pod_spec(job)["volumes"]
        }
        (mount,) = [
            mount
            for mount in container(job)["volumeMounts"]
            if volumes[mount["name"]] == claim["metadata"]["name"]
        ]
        _, _, arguments = launch(job)
        directory = arguments[arguments.index("--checkpoint") + 1]
        assert directory.startswith(mount["mountPath"] + "/")


def test_disruption_budget_and_grace_period_fit_the_launcher():
    (budget,) = of_kind("PodDisruptionBudget")
    flags, _, _ = launch(rank_zero_job())
    # Jobs have no scale subresource: an integer minAvailable only.
    assert budget["spec"]["minAvailable"] == min_hosts(flags["--nnodes"])
    assert "maxUnavailable" not in budget["spec"]
    for job in pools().values():
        labels = job["spec"]["template"]["metadata"]["labels"]
        assert (
            budget["spec"]["selector"]["matchLabels"].items() <= labels.items()
        )
        grace = pod_spec(job)["terminationGracePeriodSeconds"]
        assert grace > float(launch(job)[0]["--grace-seconds"])


def test_image_is_a_gpu_tensorflow_image_with_the_script():
    from packaging.requirements import Requirement

    dockerfile = (RECIPE / "Dockerfile").read_text()
    base = re.search(r"^ARG BASE_IMAGE=(\S+)$", dockerfile, re.M).group(1)
    assert re.search(r"^FROM \$\{BASE_IMAGE\}$", dockerfile, re.M)
    match = re.fullmatch(r"tensorflow/tensorflow:(\d+\.\d+\.\d+)-gpu", base)
    assert match, f"{base}: TensorFlow's CUDA image, tagged <version>-gpu"
    pinned = re.search(
        r'"(tensorflow[<>=!,.\d]+)"', (ROOT / "pyproject.toml").read_text()
    ).group(1)
    assert Requirement(pinned).specifier.contains(match.group(1)), (
        f"{base} is outside keras-hetero's {pinned}"
    )
    copied = set()
    for line in re.findall(r"^COPY (.+)$", dockerfile, re.M):
        *sources, destination = line.split()
        if destination.endswith("/"):
            copied |= {destination + pathlib.PurePath(s).name for s in sources}
    _, script, _ = launch(rank_zero_job())
    assert script in copied
    folder = pathlib.PurePath(script).parent
    tree = ast.parse(example(script).read_text())
    local = {
        node.module
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        and (ROOT / "examples" / f"{node.module}.py").is_file()
    }
    assert local, f"{script} imports its neighbour _digits"
    assert {f"{folder}/{name}.py" for name in local} <= copied


def test_docs_apply_the_tested_files():
    text = DOCS.read_text()
    assert "docker build -f examples/k8s/Dockerfile" in text
    for path in MANIFESTS:
        names = " ".join(
            f"${name}" for name in sorted(placeholders(path.read_text()))
        )
        relative = path.relative_to(ROOT)
        assert f"envsubst '{names}' < {relative} | kubectl apply -f -" in text
