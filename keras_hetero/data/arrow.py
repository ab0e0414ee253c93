"""`kh.data.from_arrow`: Parquet / Arrow IPC files and tables as examples.

Record batches are read lazily, converted column by column to numpy (no
per-row Python), handed to tf.data whole and unbatched there. pyarrow is an
optional dependency, imported only when `from_arrow` is called.
"""

import dataclasses
import glob
import math
import os

import numpy as np
import tensorflow as tf

from keras_hetero._checks import check_int

# What the `arrow` extra installs: true however keras-hetero was installed
# (from a checkout or a wheel; it is not on a package registry yet).
_INSTALL = 'pip install "pyarrow>=15"'
_MIN_PYARROW = 15
# Read buffer per Parquet column. Without it (pyarrow's default pre-buffering)
# a whole file's column chunks are read ahead into memory.
_PARQUET_BUFFER_BYTES = 1 << 20
_GLOB_CHARACTERS = "*?["


def file_version(path):
    """`(size, modification time in ns)` of the file at `path`."""
    stat = os.stat(path)
    return stat.st_size, stat.st_mtime_ns


def check_unchanged(path, version):
    """Raises if the file at `path` is no longer at `version`
    (`file_version` when the job listed it).

    Raises:
        ValueError: Naming the file, both sizes and both times.
    """
    now = file_version(path)
    if now != version:
        raise ValueError(
            f"{path!r} changed while the job reads it: {version[0]} bytes "
            f"modified at {version[1]} ns when it was listed, now "
            f"{now[0]} bytes modified at {now[1]} ns. An epoch would mix "
            "rows of both versions (and the row counts and offsets read "
            "at the start no longer hold). Expected files that stay as "
            "they are while training: write new data to new files and "
            "restart the job on them."
        )


def _pyarrow():
    """Imports pyarrow, or says how to install it."""
    try:
        import pyarrow
        import pyarrow.compute  # noqa: F401
        import pyarrow.parquet  # noqa: F401
    except ImportError as error:
        raise ImportError(
            "`kh.data.from_arrow` needs pyarrow (>= 15), which could not be "
            f"imported ({error}). Install it with: {_INSTALL}"
        ) from error
    major = int(pyarrow.__version__.split(".")[0])
    if major < _MIN_PYARROW:
        raise ImportError(
            "`kh.data.from_arrow` needs pyarrow >= 15. Received: pyarrow "
            f"{pyarrow.__version__}. Upgrade with: {_INSTALL}"
        )
    return pyarrow


@dataclasses.dataclass(frozen=True)
class _Column:
    """How one Arrow column becomes one tensor per example."""

    name: str
    shape: tuple  # per example; () for scalars
    dtype: tf.DType
    fill: object  # value for nulls, or None: nulls are an error

    @property
    def size(self):
        return math.prod(self.shape)

    @property
    def spec(self):
        return tf.TensorSpec((None, *self.shape), self.dtype)


def _leaf_dtype(pa, leaf_type):
    """The tf.DType for an Arrow leaf type, or None if unsupported."""
    types = pa.types
    if types.is_dictionary(leaf_type):
        return _leaf_dtype(pa, leaf_type.value_type)
    if types.is_boolean(leaf_type):
        return tf.bool
    if types.is_integer(leaf_type) or types.is_floating(leaf_type):
        return tf.as_dtype(leaf_type.to_pandas_dtype())
    if (
        types.is_string(leaf_type)
        or types.is_large_string(leaf_type)
        or types.is_binary(leaf_type)
        or types.is_large_binary(leaf_type)
    ):
        return tf.string
    return None


def _is_list(pa, arrow_type):
    return (
        pa.types.is_list(arrow_type)
        or pa.types.is_large_list(arrow_type)
        or pa.types.is_fixed_size_list(arrow_type)
    )


def _plan_column(pa, name, arrow_type, shape, fill):
    """Checks that column `name` can become a tensor; returns its `_Column`.

    Raises:
        TypeError: If the type is unsupported, or a variable-length list
            has no `shape`.
        ValueError: If `shape` does not match the type's fixed sizes or
            `fill` does not fit the type.
    """
    dims, leaf_type = [], arrow_type
    while _is_list(pa, leaf_type):
        fixed = pa.types.is_fixed_size_list(leaf_type)
        dims.append(leaf_type.list_size if fixed else None)
        leaf_type = leaf_type.value_type
    dtype = _leaf_dtype(pa, leaf_type)
    if dtype is None:
        raise TypeError(
            f"Column {name!r} has type {arrow_type}, which `from_arrow` "
            "cannot turn into a tensor. Supported: integers, floats, "
            "booleans, strings and binary, and (nested) lists of them. "
            "Cast it first (e.g. timestamps to int64, decimals to float64)."
        )
    if shape is None:
        if None in dims:
            raise TypeError(
                f"Column {name!r} has type {arrow_type}: a variable-length "
                "list, which has no fixed shape per example. Pass its shape, "
                f"e.g. `shapes={{{name!r}: (length,)}}` (every row is then "
                "checked to hold exactly that many values), or store it as "
                "a fixed_size_list."
            )
        shape = tuple(dims)
    elif None not in dims and math.prod(dims) != math.prod(shape):
        raise ValueError(
            f"Invalid value for argument `shapes`. Received: "
            f"shapes[{name!r}]={shape}. Column {name!r} has type "
            f"{arrow_type}: {math.prod(dims)} values per row, so the shape "
            f"must hold {math.prod(dims)} values, not {math.prod(shape)}."
        )
    if fill is not None:
        if pa.types.is_dictionary(leaf_type):
            leaf_type = leaf_type.value_type
        try:
            pa.scalar(fill, type=leaf_type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError):
            raise ValueError(
                f"Invalid value for argument `fill_null`. Received: "
                f"{fill!r} for column {name!r} of type {arrow_type}. "
                f"Expected a value of type {leaf_type}."
            ) from None
    return _Column(name, tuple(shape), dtype, fill)


def _offsets(pa, array):
    """Start of each element's values in `array.values`, plus the end."""
    if pa.types.is_fixed_size_list(array.type):
        size = array.type.list_size
        return (np.arange(len(array) + 1) + array.offset) * size
    return array.offsets.to_numpy().astype(np.int64)


def _rows_with_nulls(array, starts, ends):
    """Which rows' ranges `[starts, ends)` of `array` hold a null."""
    nulls = array.is_null().to_numpy(zero_copy_only=False)
    before = np.concatenate([[0], np.cumsum(nulls)])
    return before[ends] > before[starts]


def _column_values(pa, array, column, first_row):
    """One record batch's column as a numpy array `(rows, *column.shape)`.

    Vectorised over rows: lists are resolved level by level through their
    offsets, so every row's values are the range `[starts, ends)` of the
    leaf array.
    """
    rows = len(array)
    starts, ends = np.arange(rows), np.arange(1, rows + 1)
    null_rows = np.zeros(rows, bool)
    current = array
    while _is_list(pa, current.type):
        if current.null_count:
            null_rows |= _rows_with_nulls(current, starts, ends)
        offsets = _offsets(pa, current)
        starts, ends = offsets[starts], offsets[ends]
        current = current.values
    where = f"rows {first_row}..{first_row + rows - 1} of the stream"
    if null_rows.any() and column.fill is None:
        raise ValueError(
            f"Column {column.name!r} has {int(null_rows.sum())} null "
            f"row(s) in {where}. Pass a value for them, e.g. "
            f"`fill_null={{{column.name!r}: 0}}`, or drop them first."
        )
    counts = ends - starts
    wrong = (counts != column.size) & ~null_rows
    if wrong.any():
        row = int(np.argmax(wrong))
        raise ValueError(
            f"Column {column.name!r}: row {first_row + row} holds "
            f"{int(counts[row])} values, but its shape {column.shape} "
            f"needs {column.size}. Pad or trim the lists to one length."
        )
    low, high = (int(starts[0]), int(ends[-1])) if rows else (0, 0)
    leaves = current.slice(low, high - low)
    if pa.types.is_dictionary(leaves.type):
        leaves = leaves.dictionary_decode()
    if leaves.null_count:
        if column.fill is None:
            raise ValueError(
                f"Column {column.name!r} has {leaves.null_count} null "
                f"value(s) in {where}. Pass a value for them, e.g. "
                f"`fill_null={{{column.name!r}: 0}}`, or drop them first."
            )
        leaves = pa.compute.fill_null(leaves, column.fill)
    values = leaves.to_numpy(zero_copy_only=False)
    if not null_rows.any():
        return values.reshape((rows, *column.shape))
    dtype = object if column.dtype == tf.string else values.dtype
    dense = np.full((rows, column.size), column.fill, dtype=dtype)
    good = ~null_rows
    index = (starts[good] - low)[:, None] + np.arange(column.size)
    dense[good] = values[index]
    return dense.reshape((rows, *column.shape))


def _in_pieces(batches, batch_rows):
    """Record batches of at most `batch_rows` rows (zero-copy slices)."""
    for batch in batches:
        for start in range(0, batch.num_rows, batch_rows):
            yield batch.slice(start, batch_rows)


def _skipped(batches, rows):
    """`batches` without their first `rows` rows."""
    for batch in batches:
        if rows >= batch.num_rows:
            rows -= batch.num_rows
            continue
        yield batch.slice(rows)
        rows = 0


class _TableSource:
    def __init__(self, table):
        self.table = table
        self.schema = table.schema
        self.num_rows = table.num_rows
        self.description = "the pyarrow.Table"

    def null_counts(self, names):
        return {name: self.table.column(name).null_count for name in names}

    def batches(self, skip, names, batch_rows):
        table = self.table.select(names).slice(skip)
        return table.to_batches(max_chunksize=batch_rows)

    def blocks(self, batch_rows):
        # A table is in memory: its blocks are slices of `batch_rows` rows.
        return [
            (start, min(batch_rows, self.num_rows - start))
            for start in range(0, self.num_rows, batch_rows)
        ]

    def read_block(self, block, names):
        start, rows = block
        table = self.table.select(names).slice(start, rows)
        return table.combine_chunks().to_batches()[0], table.nbytes


class _ReaderSource:
    def __init__(self, reader):
        self.reader = reader
        self.schema = reader.schema
        self.num_rows = None
        self.description = "the pyarrow.RecordBatchReader"
        self._used = False

    def null_counts(self, names):
        return {}

    def blocks(self, batch_rows):
        raise ValueError(
            "A pyarrow.RecordBatchReader has no random access, which "
            '`reads="own"` needs to read only some of its blocks. Pass the '
            "files or a pyarrow.Table to `from_arrow` instead."
        )

    def batches(self, skip, names, batch_rows):
        if self._used:
            raise ValueError(
                "A pyarrow.RecordBatchReader can be read only once, and "
                "this dataset was iterated before (a second epoch?). Pass "
                "the files or a pyarrow.Table to `from_arrow` instead."
            )
        self._used = True
        batches = (batch.select(names) for batch in self.reader)
        return _skipped(batches, skip)


class _ParquetFile:
    def __init__(self, pa, path):
        self.pa = pa
        self.path = path
        self.version = file_version(path)
        with pa.parquet.ParquetFile(path) as parquet_file:
            self.metadata = parquet_file.metadata
            self.schema = parquet_file.schema_arrow
        self.num_rows = self.metadata.num_rows

    def null_counts(self, names):
        """Nulls per scalar column from the footer's statistics, if any."""
        counts = {}
        metadata = self.metadata
        for index in range(metadata.num_columns):
            # Only top-level scalars: a nested column's leaf statistics
            # count empty lists as nulls too.
            name = metadata.schema.column(index).path
            if name not in names:
                continue
            stats = [
                metadata.row_group(group).column(index).statistics
                for group in range(metadata.num_row_groups)
            ]
            if all(s is not None and s.has_null_count for s in stats):
                counts[name] = sum(s.null_count for s in stats)
        return counts

    def blocks(self):
        """`(row group, rows)` of each row group."""
        metadata = self.metadata
        return [
            (group, metadata.row_group(group).num_rows)
            for group in range(metadata.num_row_groups)
        ]

    def read_block(self, group, names):
        """Row group `group`'s columns `names`, and the bytes read (the
        column chunks' compressed sizes, from the footer)."""
        metadata = self.metadata.row_group(group)
        read = sum(
            metadata.column(index).total_compressed_size
            for index in range(metadata.num_columns)
            if metadata.column(index).path_in_schema.split(".")[0] in names
        )
        check_unchanged(self.path, self.version)
        parquet_file = self.pa.parquet.ParquetFile(
            self.path, metadata=self.metadata, pre_buffer=False
        )
        with parquet_file:
            table = parquet_file.read_row_group(group, columns=names)
        return table.combine_chunks().to_batches()[0], read

    def batches(self, skip, names, batch_rows):
        # Whole row groups before `skip` are never read: their row counts
        # are in the footer.
        groups = [
            self.metadata.row_group(i).num_rows
            for i in range(self.metadata.num_row_groups)
        ]
        first = 0
        while first < len(groups) and skip >= groups[first]:
            skip -= groups[first]
            first += 1
        check_unchanged(self.path, self.version)
        parquet_file = self.pa.parquet.ParquetFile(
            self.path,
            metadata=self.metadata,
            pre_buffer=False,
            buffer_size=_PARQUET_BUFFER_BYTES,
        )
        with parquet_file:
            yield from _skipped(
                parquet_file.iter_batches(
                    batch_size=batch_rows,
                    row_groups=range(first, len(groups)),
                    columns=names,
                ),
                skip,
            )


def _ipc_rows(reader):
    """Rows in an Arrow IPC file, from its record batches' metadata."""
    if hasattr(reader, "count_rows"):  # newer pyarrow: metadata only
        return reader.count_rows()
    # Older pyarrow: maps each batch (decompresses it if compressed).
    return sum(
        reader.get_batch(index).num_rows
        for index in range(reader.num_record_batches)
    )


class _IpcFile:
    def __init__(self, pa, path):
        self.pa = pa
        self.path = path
        self.version = file_version(path)
        with pa.memory_map(path) as mapped:
            reader = pa.ipc.open_file(mapped)
            self.schema = reader.schema
            self.num_rows = _ipc_rows(reader)

    def null_counts(self, names):
        return {}

    def blocks(self):
        """`(record batch, rows)` of each record batch."""
        with self.pa.memory_map(self.path) as mapped:
            reader = self.pa.ipc.open_file(mapped)
            return [
                (index, reader.get_batch(index).num_rows)
                for index in range(reader.num_record_batches)
            ]

    def read_block(self, index, names):
        """Record batch `index`'s columns `names`, and their bytes."""
        check_unchanged(self.path, self.version)
        with self.pa.memory_map(self.path) as mapped:
            batch = self.pa.ipc.open_file(mapped).get_batch(index)
            batch = batch.select(names)
            return batch, batch.nbytes

    def batches(self, skip, names, batch_rows):
        # Memory-mapped: a skipped record batch is mapped, never converted.
        check_unchanged(self.path, self.version)
        with self.pa.memory_map(self.path) as mapped:
            reader = self.pa.ipc.open_file(mapped)
            for index in range(reader.num_record_batches):
                batch = reader.get_batch(index)
                if skip >= batch.num_rows:
                    skip -= batch.num_rows
                    continue
                yield batch.slice(skip).select(names)
                skip = 0


def _file_kind(path):
    with open(path, "rb") as file:
        magic = file.read(6)
    if magic.startswith(b"PAR1"):
        return _ParquetFile
    if magic == b"ARROW1":
        return _IpcFile
    return None


def _expand(path):
    """Data files at `path`: a file, a directory (recursive) or a glob."""
    path = os.fspath(path)
    if os.path.isdir(path):
        files = []
        for root, directories, names in os.walk(path):
            # Spark / Hive markers and checksums: _SUCCESS, .part-0.crc, ...
            directories[:] = sorted(
                d for d in directories if not d.startswith(("_", "."))
            )
            files.extend(
                os.path.join(root, name)
                for name in sorted(names)
                if not name.startswith(("_", "."))
            )
        return files
    if os.path.exists(path):
        return [path]
    if any(character in path for character in _GLOB_CHARACTERS):
        return [
            file
            for match in sorted(glob.glob(path, recursive=True))
            for file in _expand(match)
        ]
    raise FileNotFoundError(
        f"Invalid value for argument `source`. Received: {path!r}, which "
        "is not a file, directory or glob pattern matching any file."
    )


class _FileSource:
    def __init__(self, pa, paths, description):
        self.files = []
        for path in paths:
            kind = _file_kind(path)
            if kind is None:
                raise ValueError(
                    f"Invalid value for argument `source`. {path!r} is "
                    "neither a Parquet file nor an Arrow IPC (Feather v2) "
                    "file. Expected only such files (names starting with "
                    "'_' or '.' are skipped in directories)."
                )
            self.files.append(kind(pa, path))
        self.schema = self.files[0].schema
        self.num_rows = sum(file.num_rows for file in self.files)
        self.description = description

    def check_consistent(self, names):
        first = self.files[0]
        for file in self.files[1:]:
            for name in names:
                index = file.schema.get_field_index(name)
                if index < 0:
                    raise ValueError(
                        f"Column {name!r} is in {first.path!r} but not in "
                        f"{file.path!r}, which has columns "
                        f"{file.schema.names}. Every file must have the "
                        "selected columns."
                    )
                expected = first.schema.field(name).type
                received = file.schema.field(index).type
                if received != expected:
                    raise ValueError(
                        f"Column {name!r} has type {received} in "
                        f"{file.path!r} but {expected} in {first.path!r}. "
                        "Every file must store a column with one type."
                    )

    def null_counts(self, names):
        totals = {}
        for file in self.files:
            for name, count in file.null_counts(names).items():
                totals[name] = totals.get(name, 0) + count
        return totals

    def blocks(self, batch_rows):
        return [
            (number, unit, rows)
            for number, file in enumerate(self.files)
            for unit, rows in file.blocks()
        ]

    def read_block(self, block, names):
        number, unit, _ = block
        return self.files[number].read_block(unit, names)

    def batches(self, skip, names, batch_rows):
        for file in self.files:
            if skip >= file.num_rows:
                skip -= file.num_rows
                continue
            yield from file.batches(skip, names, batch_rows)
            skip = 0


def _source(pa, source):
    if isinstance(source, pa.Table):
        return _TableSource(source)
    if isinstance(source, pa.RecordBatchReader):
        return _ReaderSource(source)
    if isinstance(source, (str, os.PathLike)):
        paths = _expand(source)
        description = f"{len(paths)} file(s) at {os.fspath(source)!r}"
    elif isinstance(source, (list, tuple)) and source:
        if not all(isinstance(p, (str, os.PathLike)) for p in source):
            raise TypeError(
                "Invalid value for argument `source`. Received a list with "
                f"{[type(p).__name__ for p in source]}. Expected paths."
            )
        paths = [file for path in source for file in _expand(path)]
        description = f"the {len(paths)} file(s) of the given paths"
    else:
        raise TypeError(
            f"Invalid value for argument `source`. Received: {source!r} of "
            f"type {type(source).__name__}. Expected a Parquet or Arrow IPC "
            "file path, a directory or glob of them, a list of paths, a "
            "pyarrow.Table or a pyarrow.RecordBatchReader."
        )
    if not paths:
        raise ValueError(
            f"Invalid value for argument `source`. Received: {source!r}. "
            "It holds no Parquet or Arrow IPC files."
        )
    return _FileSource(pa, paths, description)


def _names(argument, value):
    """`value` as (structure, [column names]): a name or a list of names."""
    if value is None:
        return None, []
    if isinstance(value, str):
        return value, [value]
    if (
        isinstance(value, (list, tuple))
        and value
        and all(isinstance(name, str) for name in value)
    ):
        return list(value), list(value)
    raise TypeError(
        f"Invalid value for argument `{argument}`. Received: {value!r}. "
        "Expected a column name or a non-empty list of column names."
    )


def _per_column(argument, value, names, one_for_all=False):
    """A per-column argument as a dict (`one_for_all`: or one value)."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        if one_for_all:
            return {name: value for name in names}
        raise TypeError(
            f"Invalid value for argument `{argument}`. Received: {value!r}. "
            "Expected a dict by column name."
        )
    unknown = sorted(set(value) - set(names))
    if unknown:
        raise ValueError(
            f"Invalid value for argument `{argument}`. Received keys "
            f"{unknown}, which are not among the selected columns {names}."
        )
    return value


def _shape(name, shape):
    if isinstance(shape, (int, np.integer)):
        shape = (shape,)
    if (
        not isinstance(shape, (list, tuple))
        or not shape
        or not all(
            isinstance(d, (int, np.integer)) and not isinstance(d, bool)
            for d in shape
        )
        or min(shape) < 1
    ):
        raise ValueError(
            f"Invalid value for argument `shapes`. Received: "
            f"shapes[{name!r}]={shape!r}. Expected a tuple of positive "
            "integers, the shape of one example's value."
        )
    return tuple(int(d) for d in shape)


def _structure(source, columns, label, sample_weight):
    """`[x, y, weight]` (a name, a list of names or None) and all names."""
    features, feature_names = _names("columns", columns)
    labels, label_names = _names("label", label)
    weights, weight_names = _names("sample_weight", sample_weight)
    if weights is not None and not isinstance(weights, str):
        raise TypeError(
            "Invalid value for argument `sample_weight`. Received: "
            f"{sample_weight!r}. Expected one column name."
        )
    if weights is not None and labels is None:
        raise ValueError(
            "Invalid value for argument `sample_weight`. Received: "
            f"sample_weight={sample_weight!r} without a `label`. Keras takes "
            "sample weights only as the third element of (x, y, weight)."
        )
    available = source.schema.names
    if features is None:
        used = label_names + weight_names
        features = feature_names = [n for n in available if n not in used]
        if not feature_names:
            raise ValueError(
                f"No feature columns are left in {available} after `label` "
                "and `sample_weight`. Expected at least one."
            )
    names = feature_names + label_names + weight_names
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(
            f"Column(s) {repeated} are used more than once among `columns`, "
            "`label` and `sample_weight`. Expected each in one place."
        )
    missing = [n for n in names if n not in available]
    if missing:
        raise ValueError(
            f"Column(s) {missing} not found in {source.description}. "
            f"Available columns: {available}."
        )
    return [features, labels, weights], names


def _plan(pa, source, names, shapes, fill_null):
    """`{name: _Column}`, after checking types, shapes and known nulls."""
    if isinstance(source, _FileSource):
        source.check_consistent(names)
    shapes = _per_column("shapes", shapes, names)
    fills = _per_column("fill_null", fill_null, names, one_for_all=True)
    plan = {
        name: _plan_column(
            pa,
            name,
            source.schema.field(name).type,
            None if shapes.get(name) is None else _shape(name, shapes[name]),
            fills.get(name),
        )
        for name in names
    }
    for name, count in source.null_counts(names).items():
        if count and plan[name].fill is None:
            raise ValueError(
                f"Column {name!r} has {count} null value(s) in "
                f"{source.description}. Pass a value for them, e.g. "
                f"`fill_null={{{name!r}: 0}}`, or drop them first."
            )
    return plan


class _Stream:
    """A source, the columns to read and how they map to `(x, y, w)`."""

    def __init__(self, source, structure, columns, batch_rows):
        self.source = source
        self.structure = structure  # [x, y, w]: a name, a list, or None
        self.columns = columns  # {name: _Column}
        self.batch_rows = int(batch_rows)

    def _nest(self, values):
        parts = []
        for part in self.structure:
            if part is None:
                break
            if isinstance(part, str):
                parts.append(values[part])
            else:
                parts.append({name: values[name] for name in part})
        return parts[0] if len(parts) == 1 else tuple(parts)

    def _converted(self, skip):
        """`{name: values}` of each record batch from row `skip` on."""
        pa = _pyarrow()
        first_row = skip
        names = list(self.columns)
        batches = self.source.batches(skip, names, self.batch_rows)
        for batch in _in_pieces(batches, self.batch_rows):
            yield {
                name: _column_values(pa, batch.column(name), column, first_row)
                for name, column in self.columns.items()
            }
            first_row += batch.num_rows

    def blocks(self):
        """The stream's blocks (see `kh.data.shard(reads="own")`), each a
        tuple whose last item is its rows."""
        return self.source.blocks(self.batch_rows)

    def read_block(self, block, first_row):
        """`({name: values}, bytes read)` of one of `blocks()`, which
        starts at row `first_row` of the stream (for error messages)."""
        pa = _pyarrow()
        batch, read = self.source.read_block(block, list(self.columns))
        values = {
            name: _column_values(pa, batch.column(name), column, first_row)
            for name, column in self.columns.items()
        }
        return values, read

    def empty(self):
        """`{name: values}` of no rows."""
        return {
            name: np.zeros(
                (0, *column.shape),
                object
                if column.dtype == tf.string
                else column.dtype.as_numpy_dtype,
            )
            for name, column in self.columns.items()
        }

    def spec(self):
        """The element spec of the stream's examples, batched."""
        return self._nest(
            {name: column.spec for name, column in self.columns.items()}
        )

    def nest(self, values):
        """`{name: values}` as the elements' `x`, `(x, y)` or `(x, y, w)`."""
        return self._nest(values)

    def _generate(self, skip, seed):
        skip, seed = int(skip), int(seed)
        if skip < 0:  # tf.data: skip(-1) skips everything
            return
        if seed < 0:  # in order
            for values in self._converted(skip):
                yield self._nest(values)
            return
        # The whole pass, converted once, then taken in a permutation of
        # `seed`: the skipped examples are only indices, and tf.data's
        # per-example work covers the rest of the pass alone.
        parts = list(self._converted(0))
        values = {
            name: np.concatenate([part[name] for part in parts])
            for name in self.columns
        }
        del parts
        for part in permuted(values, seed, skip, self.batch_rows):
            yield self._nest(part)

    def dataset(self, skip, seed=-1):
        skip = tf.cast(skip, tf.int64)
        seed = tf.cast(seed, tf.int64)
        signature = self._nest(
            {name: column.spec for name, column in self.columns.items()}
        )
        batches = tf.data.Dataset.from_generator(
            self._generate, output_signature=signature, args=(skip, seed)
        )
        # One converted record batch waits while the previous one unbatches.
        examples = batches.prefetch(1).unbatch()
        if self.source.num_rows is not None:
            remaining = tf.where(
                skip < 0,
                tf.constant(0, tf.int64),
                tf.maximum(self.source.num_rows - skip, 0),
            )
            examples = examples.apply(
                tf.data.experimental.assert_cardinality(remaining)
            )
        return examples


def permuted(values, seed, skip, batch_rows):
    """`{name: values}` of a whole pass, in the permutation of `seed`, from
    its position `skip` on, `batch_rows` rows at a time."""
    rows = len(next(iter(values.values())))
    order = np.random.default_rng(seed).permutation(rows)[skip:]
    for start in range(0, len(order), batch_rows):
        taken = order[start : start + batch_rows]
        yield {name: value[taken] for name, value in values.items()}


def _add_skips(first, second):
    """Two `skip` counts after each other (negative means "everything")."""
    if not tf.is_tensor(first) and not tf.is_tensor(second):
        return -1 if first < 0 or second < 0 else int(first) + int(second)
    first, second = tf.cast(first, tf.int64), tf.cast(second, tf.int64)
    return tf.where(
        (first < 0) | (second < 0), tf.constant(-1, tf.int64), first + second
    )


class BlockDataset(tf.data.Dataset):
    """The examples of a stream read in blocks (Arrow record batches or row
    groups, `kh.data.from_tfrecords`' blocks of records); `skip` does not
    decode what it skips.

    `kh.data.HeteroDataset.resume_after` skips through `skip`, so resuming
    mid-epoch from files passes over whole files and Parquet row groups by
    their footers' row counts without reading them.
    """

    def __init__(self, stream, skip=0, seed=-1):
        self._stream = stream
        self._skip = skip
        self._seed = seed
        self._examples = stream.dataset(skip, seed)
        super().__init__(tf.data.experimental.to_variant(self._examples))

    def _inputs(self):
        return [self._examples]

    @property
    def stream(self):
        """What `kh.data.shard(reads="own")` reads blocks of."""
        return self._stream

    @property
    def whole(self):
        """Whether this is the whole stream, in order (not skipped or
        shuffled): only then can its blocks be read on their own."""
        return _is_constant(self._skip, 0) and _is_constant(self._seed, -1)

    @property
    def element_spec(self):
        return self._examples.element_spec

    def skip(self, count, name=None):
        """Skips `count` examples (all of them if negative), cheaply.

        Args:
            count: How many examples to skip; a negative value skips all.
            name: Unused; accepted for `tf.data.Dataset.skip` compatibility.
                Defaults to `None`.

        Returns:
            A dataset of the same examples without the first `count`.
        """
        return BlockDataset(
            self._stream, _add_skips(self._skip, count), self._seed
        )

    def shuffled_pass(self, seed):
        """The examples in a permutation of the pass that `seed` (an int or
        int64 tensor >= 0) picks; `kh.data.shard(shuffle=True)` takes it.

        The pass is read and converted whole (as a buffer of the pass
        would hold it) when iteration starts, then handed on in the
        permutation; `skip` after it costs no more than the read, since
        the skipped examples are only indices.
        """
        if not (_is_constant(self._skip, 0) and _is_constant(self._seed, -1)):
            # Skipped or shuffled already: shuffle what is left as tf.data
            # would.
            return self.shuffle(
                self.cardinality(), seed=seed, reshuffle_each_iteration=False
            )
        return BlockDataset(self._stream, 0, seed)


def _is_constant(value, constant):
    return not tf.is_tensor(value) and value == constant


def from_arrow(
    source,
    columns=None,
    *,
    label=None,
    sample_weight=None,
    shapes=None,
    fill_null=None,
    batch_rows=4096,
):
    """Unbatched examples from Parquet or Arrow IPC files or tables.

    Reads `source` lazily, `batch_rows` rows at a time, in a fixed order:
    files in the order given (a directory's files sorted by path, recursively,
    skipping names that start with `_` or `.` such as Spark's `_SUCCESS`;
    a glob's matches sorted), each file's rows in order. Each record batch
    becomes numpy arrays column by column (no per-row Python) and is unbatched
    by tf.data. The result is ready for `kh.data.shard`:

        examples = kh.data.from_arrow("train/", "x", label="y")
        data = kh.data.shard(examples, 256, strategy=strategy)

    Elements are `x` (no `label`), `(x, y)`, or `(x, y, sample_weight)`. `x`
    is one tensor if `columns` is a name, else a dict of tensors by column
    name (all columns not used as label or weight if `columns` is `None`);
    `y` likewise from `label`.

    Column types: integers, floats, booleans, strings and binary (as
    `tf.string`); fixed-size lists, also nested (an image stored as
    `fixed_size_list<fixed_size_list<uint8>[W]>[H]` gives an `(H, W)`
    tensor per example); dictionary-encoded columns are decoded.
    Variable-length lists (Spark's `ArrayType`) need their shape in `shapes`;
    every row is then checked to hold exactly that many values.

    Memory is bounded by `batch_rows`, not by the data: about four record
    batches of `batch_rows` rows are alive at a time (one being read, one
    converted, one waiting, one being unbatched), plus a 1 MiB read buffer
    per Parquet column. Arrow IPC files are memory-mapped. Under
    `kh.data.shard(..., shuffle=True)` each pass is read and converted
    whole into numpy arrays (what a shuffle buffer of the pass would hold),
    then handed on in a permutation of the pass's seed, so a resumed pass
    skips indices, not examples (docs/checkpoints.md).

    The row count is known from Parquet footers, IPC files and tables, and
    is the dataset's `cardinality()` (so `kh.data.shard` knows the number of
    batches per epoch); for a `RecordBatchReader` it is unknown.

    Multi-worker jobs: `kh.data.shard` hands the rows of each global batch
    to replicas by shares that move during training, so which rows a worker
    trains on is not known ahead, and every worker reads the whole stream
    (it needs the same files). The order is deterministic, the same on every
    worker and in every epoch, which keeps every example exactly once per
    epoch. Resuming mid-epoch (`HeteroDataset.resume_after`, as
    `kh.callbacks.ElasticCheckpoint` does) goes through the returned
    dataset's `skip`, which passes over whole files and Parquet row groups
    by their footers' row counts without reading them, and over whole IPC
    record batches without converting them. Transformations applied before
    `kh.data.shard` (`.map`, ...) return a plain `tf.data.Dataset`, whose
    `skip` decodes the skipped rows; put per-batch work in `shard`'s
    `map_fn` instead.

    Args:
        source: A Parquet or Arrow IPC (Feather v2) file path, a directory
            or glob pattern of them, a list of such paths, a
            `pyarrow.Table` or a `pyarrow.RecordBatchReader` (read once:
            one epoch).
        columns: The feature column name (`x` is then one tensor) or a list
            of names (`x` is a dict by name). Defaults to `None`: all
            columns except `label` and `sample_weight`, as a dict.
        label: The label column name (`y` one tensor) or a list of names
            (`y` a dict by name). Defaults to `None`: elements are `x` only.
        sample_weight: The sample-weight column name; needs `label`.
            Defaults to `None`.
        shapes: `{column: shape}`: the shape of one example's value, for
            variable-length list columns (required) or to reshape a column
            holding as many values (e.g. `784` values as `(28, 28)`).
            Defaults to `None`: shapes from the column types.
        fill_null: The value for nulls, one for all columns or
            `{column: value}`; a null list fills the whole example. Defaults
            to `None`: a null is an error.
        batch_rows: Rows per record batch read and converted at a time; it
            bounds memory. Defaults to `4096`.

    Returns:
        An unbatched `tf.data.Dataset` (see above for its elements).

    Raises:
        ImportError: If pyarrow (>= 15) is not installed.
        FileNotFoundError: If a path matches no file.
        TypeError: If `source` or a column argument has the wrong type, a
            column's type is unsupported, or a variable-length list column
            has no entry in `shapes`.
        ValueError: If a column is missing (the error lists the available
            ones), files disagree on a column's type, a file is neither
            Parquet nor Arrow IPC, a `shapes` or `fill_null` entry does not
            fit its column, `batch_rows` is not a positive integer, or the
            footers or table report nulls in a column without a fill value.
            Nulls found only while reading (no statistics) and lists of the
            wrong length fail the iteration with a message naming the column
            and rows.

    Example:

    >>> import pyarrow as pa
    >>> table = pa.table({"x": [1.0, 2.0, 3.0], "y": [0, 1, 0]})
    >>> examples = from_arrow(table, "x", label="y")
    >>> [(float(x), int(y)) for x, y in examples]
    [(1.0, 0), (2.0, 1), (3.0, 0)]
    """
    pa = _pyarrow()
    batch_rows = check_int("batch_rows", batch_rows, 1, "a positive integer")
    stream_source = _source(pa, source)
    structure, names = _structure(stream_source, columns, label, sample_weight)
    plan = _plan(pa, stream_source, names, shapes, fill_null)
    return BlockDataset(_Stream(stream_source, structure, plan, batch_rows))
