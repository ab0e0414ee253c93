"""Finds input stages whose order or values a restart cannot reproduce.

`kh.data.shard` shuffles each pass by `(seed, pass)` and
`ElasticCheckpoint` resumes an epoch by skipping its first examples; both
assume that the user's own examples come out in the same order (with the
same values) in every process. This module reads the examples' tf.data
graph, including the bodies of its `map` / `filter` / `interleave`
functions, and names the stages that break that assumption.

What each stage does was measured on TF 2.21 (docs/checkpoints.md, "Input
pipelines and exact resume"): a stateful random op with a seed (op seed or
`tf.random.set_seed`) draws the same numbers on every pass and in a fresh
process, so it is exact; one without any seed draws new ones each time.
Python stages (`from_generator`, `py_function`, `numpy_function`) cannot be
inspected and are not reported.
"""

import dataclasses
import re

import tensorflow as tf

from keras_hetero import _compat
from keras_hetero._compat.epochs import KERNEL_RANDOM_STATE

# Shuffling ops -> the positions of their `seed` and `seed2` inputs (op
# definitions in tensorflow/core/ops/dataset_ops.cc and
# experimental_dataset_ops.cc; inputs are appended, never reordered).
_SHUFFLES = {
    "ShuffleDataset": (2, 3),
    "ShuffleDatasetV3": (2, 3),
    "ShuffleAndRepeatDataset": (2, 3),
    "ShuffleAndRepeatDatasetV2": (2, 3),
    "GlobalShuffleDataset": (1, 2),
}
_RANDOM_DATASETS = {
    "RandomDataset": (0, 1),
    "RandomDatasetV2": (0, 1),
    "ExperimentalRandomDataset": (0, 1),
}
# Stateful random ops with `seed` / `seed2` attributes (both 0: no seed).
_STATEFUL_RANDOM = KERNEL_RANDOM_STATE
# Ops inside a dataset function that advance state kept in a variable:
# `tf.random.Generator` (Rng*, Stateful*) and Keras random layers' seed
# generators (Assign*VariableOp).
_STATE_UPDATES = frozenset(
    {
        "AssignAddVariableOp",
        "AssignSubVariableOp",
        "AssignVariableOp",
        "RngReadAndSkip",
        "RngSkip",
        "StatefulRandomBinomial",
        "StatefulStandardNormal",
        "StatefulStandardNormalV2",
        "StatefulTruncatedNormal",
        "StatefulUniform",
        "StatefulUniformFullInt",
        "StatefulUniformInt",
    }
)
_FILTERS = frozenset({"FilterDataset", "ParallelFilterDataset"})

# What users wrote, by the op it became.
_METHODS = {
    "ShuffleDataset": "Dataset.shuffle",
    "ShuffleDatasetV2": "Dataset.shuffle",
    "ShuffleDatasetV3": "Dataset.shuffle",
    "ShuffleAndRepeatDataset": "tf.data.experimental.shuffle_and_repeat",
    "ShuffleAndRepeatDatasetV2": "tf.data.experimental.shuffle_and_repeat",
    "GlobalShuffleDataset": "Dataset.global_shuffle",
    "RandomDataset": "Dataset.random",
    "RandomDatasetV2": "Dataset.random",
    "ExperimentalRandomDataset": "Dataset.random",
    "MapDataset": "Dataset.map",
    "ParallelMapDataset": "Dataset.map",
    "ParallelMapDatasetV2": "Dataset.map",
    "MapAndBatchDataset": "tf.data.experimental.map_and_batch",
    "FilterDataset": "Dataset.filter",
    "ParallelFilterDataset": "Dataset.filter",
    "FlatMapDataset": "Dataset.flat_map",
    "InterleaveDataset": "Dataset.interleave",
    "ParallelInterleaveDatasetV2": "Dataset.interleave",
    "ParallelInterleaveDatasetV3": "Dataset.interleave",
    "ParallelInterleaveDatasetV4": "Dataset.interleave",
    "LegacyParallelInterleaveDatasetV2": (
        "tf.data.experimental.parallel_interleave"
    ),
    "ParallelBatchDataset": "Dataset.batch",
    "ScanDataset": "Dataset.scan",
    "MapFn": "kh.data.shard(..., map_fn=...)",  # not an op: `map_fn_stages`
}
# Prefixes tf.data puts before a dataset function's own name.
_FUNCTION_PREFIX = re.compile(
    r"^(?:__inference_)?(?:Dataset_(?:flat_map|interleave|filter|map|scan|"
    r"group_by_window|reduce)_|tf_data_experimental_\w+?_)?"
)

_SHARD_SHUFFLE = (
    "shuffle with `kh.data.shard(examples, ..., shuffle=..., seed=...)` "
    "instead (each epoch gets its own order, the same on every worker and "
    "after a restart)"
)


@dataclasses.dataclass(frozen=True)
class Stage:
    """One input stage whose order or values a restart cannot reproduce.

    Attributes:
        stage: What the user wrote, e.g. "`Dataset.shuffle`".
        op: The tf.data / TensorFlow op it became.
        function: The dataset function it runs in (the name the user gave
            it, e.g. `augment`), or None for a stage of the pipeline itself.
        problem: What goes wrong.
        fix: What to do instead.
        across_workers: The ORDER of the examples may differ between the
            workers of one job too (not only after a restart), so a
            multi-worker `kh.data.shard` would lose and repeat examples.
    """

    stage: str
    op: str
    function: str | None
    problem: str
    fix: str
    across_workers: bool

    def describe(self):
        where = "" if self.function is None else f" in `{self.function}`"
        return (
            f"{self.stage} (op {self.op}){where}: {self.problem}. Fix: "
            f"{self.fix}."
        )


def unreproducible_stages(examples):
    """The stages of `examples` whose order or values a restart (or another
    worker) cannot reproduce, each once, in pipeline order.

    Raises:
        ValueError: If the pipeline cannot be serialized for inspection
            (e.g. it captures more than 2 GB of constants).
    """
    return inspect(examples)[0]


# tf.data sources that read files (their op names).
_FILE_READERS = {
    "TFRecordDataset": "TFRecordDataset",
    "TFRecordDatasetV2": "TFRecordDataset",
    "FixedLengthRecordDataset": "FixedLengthRecordDataset",
    "FixedLengthRecordDatasetV2": "FixedLengthRecordDataset",
    "TextLineDataset": "TextLineDataset",
}


def inspect(examples):
    """`(unreproducible_stages, file readers)` of `examples`, from one
    serialization of its pipeline: the stages as `unreproducible_stages`
    returns them, and the file-reading tf.data sources (their class names,
    each once).

    Raises:
        ValueError: If the pipeline cannot be serialized for inspection.
    """
    try:
        graph = _compat.dataset_graph(examples)
    except Exception as error:  # any TF error: we cannot inspect it
        raise ValueError(
            "Could not inspect the examples' tf.data pipeline for stages "
            f"that break exact resume ({type(error).__name__}: {error})."
        ) from error
    stages = _walk(graph, None)
    if examples.options().deterministic is False:
        stages.append(
            Stage(
                "`tf.data.Options(deterministic=False)`",
                "OptionsDataset",
                None,
                "parallel stages may then yield examples in another order "
                "on each worker and in each run",
                "leave `deterministic` unset (or True) on the examples",
                across_workers=True,
            )
        )
    readers = []
    for nodes in [graph.node, *(f.node_def for f in graph.library.function)]:
        for node in nodes:
            name = _FILE_READERS.get(node.op)
            if name is not None and name not in readers:
                readers.append(name)
    return stages, readers


def map_fn_stages(examples, map_fn):
    """The stages of `kh.data.shard`'s `map_fn` that a resumed pass cannot
    reproduce: any stateful random op, seeded or not, and any variable
    update (`tf.random.Generator`, Keras random layers).

    `map_fn` runs after the split, on each replica's slice of the global
    batches that are left: a resumed pass starts its random stream afresh
    at the resume point, where the uninterrupted pass had drawn on, and
    slices change with the shares. So unlike in the examples' own `map`,
    a seed does not make it reproducible.

    Raises:
        ValueError: If `map_fn` cannot be traced for inspection.
    """
    spec = examples.batch(2).element_spec
    args = spec if isinstance(spec, tuple) else (spec,)
    try:
        traced = tf.function(lambda *a: map_fn(*a)).get_concrete_function(*args)
    except Exception as error:  # any error: we cannot inspect it
        raise ValueError(
            "Could not inspect `map_fn` for random ops that break exact "
            f"resume ({type(error).__name__}: {error})."
        ) from error
    name = getattr(map_fn, "__name__", "map_fn")
    return _walk(traced.graph.as_graph_def(), ("MapFn", name), True)


def _walk(graph, context, after_split=False):
    """The Stages of a GraphDef's nodes and of the functions they call."""
    functions = {f.signature.name: f for f in graph.library.function}
    stages = []
    visited = set()

    def visit(nodes, context):
        nodes = list(nodes)
        constants = {n.name: n for n in nodes if n.op == "Const"}
        cached = _cached(nodes)
        for node in nodes:
            stage = _check(
                node, constants, context, node.name in cached, after_split
            )
            if stage is not None and stage not in stages:
                stages.append(stage)
            for name in _functions_of(node):
                inner = (node.op, name) if node.op in _METHODS else context
                if name in functions and (name, inner) not in visited:
                    visited.add((name, inner))
                    visit(functions[name].node_def, inner)

    visit(graph.node, context)
    return stages


def _check(node, constants, context, cached=False, after_split=False):
    """The Stage for `node`, or None. `context`: `(dataset op, function)`
    whose body holds `node`, or None at the top of the pipeline. `cached`:
    a `cache()` after `node` keeps its first pass for every later one.
    `after_split`: `node` is in `kh.data.shard`'s `map_fn`, where a seed
    does not make a stateful random op reproducible (`map_fn_stages`)."""
    op = node.op
    function = None if context is None else _user_name(context[1])
    if op in _SHUFFLES or op in _RANDOM_DATASETS:
        return _check_random_dataset(node, constants, function, cached)
    deterministic = node.attr.get("deterministic")
    if deterministic is not None and deterministic.s == b"false":
        return Stage(
            f"`{_METHODS.get(op, op)}(..., deterministic=False)`",
            op,
            function,
            "it may yield examples in another order on each worker and in "
            "each run",
            "drop `deterministic=False` (the default keeps the order, still "
            "in parallel)",
            across_workers=True,
        )
    if context is None:
        return None
    in_filter = context[0] in _FILTERS
    method = f"`{_METHODS.get(context[0], context[0])}`"
    if op in _STATEFUL_RANDOM and after_split:
        return Stage(
            "`kh.data.shard(..., map_fn=...)`",
            op,
            function,
            f"the random op {op} runs after the split, on the replicas' "
            "slices of the batches left, so a resumed epoch restarts its "
            "numbers at the resume point (a seed does not help here)",
            "draw the random numbers in the examples' own `map` (before "
            "`kh.data.shard`) with a seeded op or a stateless op keyed by "
            "the example, or in the model (a random layer)",
            across_workers=False,
        )
    if op in _STATEFUL_RANDOM and _attr_int(node, "seed") == 0:
        if _attr_int(node, "seed2") == 0:
            return Stage(
                method,
                op,
                function,
                f"the random op {op} has no seed, so it draws other numbers "
                "on every worker, in every epoch and after a restart"
                + (" (here: which examples are kept)" if in_filter else ""),
                "use a stateless op (`tf.random.stateless_uniform(shape, "
                "seed=...)`) with a per-example seed, or give the op a "
                "`seed=` (or call `tf.random.set_seed` before building the "
                "pipeline)",
                across_workers=in_filter,
            )
    if op in _STATE_UPDATES:
        return Stage(
            method,
            op,
            function,
            f"it updates a variable ({op}): random state of a "
            "`tf.random.Generator` or a Keras random layer's seed generator "
            "that advances with every example, which a restarted process "
            "starts again from its initial value"
            + (" (here: which examples are kept)" if in_filter else ""),
            "derive the randomness from the example (stateless ops with a "
            "per-example seed, e.g. after `.enumerate()`), or apply random "
            "layers in the model instead of the input pipeline",
            across_workers=False,
        )
    return None


def _check_random_dataset(node, constants, function, cached):
    """The Stage for a shuffle or random dataset `node`, or None (seeded,
    and the same every epoch or cached)."""
    op = node.op
    seeds = (_SHUFFLES.get(op) or _RANDOM_DATASETS[op])[:2]
    values = [_constant(node, i, constants) for i in seeds]
    unseeded = values == [0, 0]
    again = _attr_bool(node, "reshuffle_each_iteration") or _attr_bool(
        node, "rerandomize_each_iteration"
    )
    name = f"`{_METHODS[op]}`"
    if op in _RANDOM_DATASETS:
        name += " (or `Dataset.sample_from_datasets`, which uses it)"
    if unseeded and op in _SHUFFLES:
        return Stage(
            name,
            op,
            function,
            "it has no seed, so its order differs between workers and "
            "after a restart",
            _SHARD_SHUFFLE,
            across_workers=True,
        )
    if unseeded:
        return Stage(
            name,
            op,
            function,
            "it has no seed, so its numbers (and the examples they pick) "
            "differ between workers and after a restart",
            "give it a `seed=` (or call `tf.random.set_seed` before "
            "building the pipeline)",
            across_workers=True,
        )
    if again and cached:
        # Seeded: its first pass, which the cache keeps, is the same
        # in every process.
        return None
    if again and op in _SHUFFLES:
        return Stage(
            name,
            op,
            function,
            "it reshuffles every epoch (`reshuffle_each_iteration=True`, "
            "tf.data's default, also in `Dataset.list_files`), so a "
            "restarted process replays its FIRST epoch's order and the "
            "resumed epoch skips the wrong examples",
            _SHARD_SHUFFLE
            + ", or pass `reshuffle_each_iteration=False` (the same "
            "seeded order every epoch)",
            across_workers=False,
        )
    if again:
        return Stage(
            name,
            op,
            function,
            "it draws new numbers every epoch "
            "(`rerandomize_each_iteration=True`), so a restarted process "
            "replays its FIRST epoch's numbers",
            "pass `rerandomize_each_iteration=False`",
            across_workers=False,
        )
    return None


def _cached(nodes):
    """Names of the nodes whose output a `cache()` stores."""
    by_name = {node.name: node for node in nodes}
    upstream, pending = (
        set(),
        [
            node
            for node in nodes
            if node.op in ("CacheDataset", "CacheDatasetV2")
        ],
    )
    while pending:
        for source in pending.pop().input:
            name = source.lstrip("^").split(":")[0]
            if name in by_name and name not in upstream:
                upstream.add(name)
                pending.append(by_name[name])
    return upstream


def _functions_of(node):
    for value in node.attr.values():
        if value.HasField("func"):
            yield value.func.name
        elif value.HasField("list"):
            for func in value.list.func:
                yield func.name


def _constant(node, index, constants):
    """Input `index` of `node` as an int if it is a constant, else None."""
    if index >= len(node.input):
        return None
    # "name", "name:0" (graph) or "name:output:0" (function body).
    source = constants.get(node.input[index].lstrip("^").split(":")[0])
    if source is None:
        return None
    value = tf.make_ndarray(source.attr["value"].tensor)
    return int(value) if value.size == 1 else None


def _attr_int(node, name):
    value = node.attr.get(name)
    return None if value is None else value.i


def _attr_bool(node, name):
    value = node.attr.get(name)
    return value is not None and value.b


def _user_name(function_name):
    """`augment` for tf.data's `__inference_Dataset_map_augment_123`."""
    name = _FUNCTION_PREFIX.sub("", function_name)
    return re.sub(r"_\d+$", "", name) or function_name


def describe(stages):
    """The stages as lines for an error or warning message."""
    return "\n".join(f"- {stage.describe()}" for stage in stages)
