"""`kh.data.index_tfrecords` and `kh.data.from_tfrecords`: TFRecord files
read by record offsets, so that `kh.data.shard(reads="own")` reads each
worker's records only.

A TFRecord file is a sequence of records, each framed as an 8-byte
little-endian length, a 4-byte CRC of it, the data and a 4-byte CRC of the
data (tensorflow/core/lib/io/record_writer.cc, `RecordWriter::WriteRecord`).
Nothing in the file says where record k starts, so reading some records
means reading all before them. An index, written once, holds each record's
offset and size (one `offset size` line per record, the format of NVIDIA
DALI's `tfrecord2idx`), and reading then seeks.
"""

import os
import struct

import numpy as np
import tensorflow as tf

from keras_hetero._checks import check_int
from keras_hetero.data import arrow

_HEADER = 12  # length (8) + its CRC (4)
_FOOTER = 4  # the data's CRC
_INDEX_SUFFIX = ".idx"


def _record_files(source):
    """The TFRecord files of `source`: a path, a directory (its files but
    `.idx` ones and names starting with `_` or `.`), a glob, or a list."""
    if isinstance(source, (str, os.PathLike)):
        sources = [source]
    elif isinstance(source, (list, tuple)) and source:
        sources = list(source)
    else:
        raise TypeError(
            f"Invalid value for argument `paths`. Received: {source!r} of "
            f"type {type(source).__name__}. Expected a TFRecord file path, "
            "a directory or glob of them, or a list of paths."
        )
    files = []
    for path in sources:
        path = os.fspath(path)
        if os.path.isdir(path):
            names = sorted(os.listdir(path))
            files.extend(
                os.path.join(path, name)
                for name in names
                if not name.startswith(("_", "."))
                and not name.endswith(_INDEX_SUFFIX)
                and os.path.isfile(os.path.join(path, name))
            )
        elif os.path.isfile(path):
            files.append(path)
        else:
            matches = sorted(tf.io.gfile.glob(path))
            if not matches:
                raise FileNotFoundError(
                    f"Invalid value for argument `paths`. Received: {path!r}"
                    ", which is not a file, directory or glob pattern "
                    "matching any file."
                )
            files.extend(m for m in matches if not m.endswith(_INDEX_SUFFIX))
    if not files:
        raise ValueError(
            f"Invalid value for argument `paths`. Received: {source!r}. It "
            "holds no TFRecord files."
        )
    return files


def _scan(path):
    """`(offsets, sizes)` of the records of an uncompressed TFRecord file."""
    offsets, sizes = [], []
    size = os.path.getsize(path)
    with open(path, "rb") as file:
        offset = 0
        while offset < size:
            header = file.read(_HEADER)
            if len(header) < _HEADER:
                raise ValueError(
                    f"{path!r} is not an uncompressed TFRecord file: it ends "
                    f"inside a record's header at byte {offset}. (GZIP or "
                    "ZLIB files have no record offsets: write them "
                    "uncompressed to index them.)"
                )
            (length,) = struct.unpack("<Q", header[:8])
            record = _HEADER + length + _FOOTER
            if offset + record > size:
                raise ValueError(
                    f"{path!r} is not an uncompressed TFRecord file: the "
                    f"record at byte {offset} says it holds {length} bytes, "
                    f"more than the {size - offset} left. (GZIP or ZLIB "
                    "files have no record offsets: write them uncompressed "
                    "to index them.)"
                )
            offsets.append(offset)
            sizes.append(record)
            offset += record
            file.seek(offset)
    return offsets, sizes


def index_tfrecords(paths):
    """Writes an index of record offsets next to each TFRecord file.

    For each file `f`, `f.idx` holds one `offset size` line per record (the
    format of NVIDIA DALI's `tfrecord2idx`). `kh.data.from_tfrecords` reads
    it to seek to the records it needs. Run it once after writing the files
    (it reads each file's record headers, not its data).

    Args:
        paths: A TFRecord file path, a directory or glob of them, or a
            list of paths. Files must be uncompressed.

    Returns:
        The paths of the index files written, one per TFRecord file.

    Raises:
        FileNotFoundError: If a path matches no file.
        ValueError: If a file is not an uncompressed TFRecord file.

    Example:

    >>> index_tfrecords("train/")  # doctest: +SKIP
    ['train/part-0.tfrecord.idx', 'train/part-1.tfrecord.idx']
    """
    written = []
    for path in _record_files(paths):
        offsets, sizes = _scan(path)
        index = path + _INDEX_SUFFIX
        with open(index + ".tmp", "w") as file:
            file.writelines(f"{o} {s}\n" for o, s in zip(offsets, sizes))
        os.replace(index + ".tmp", index)
        written.append(index)
    return written


def _read_index(path):
    """`(offsets, sizes)` from `path`'s index, checked against the file."""
    index = path + _INDEX_SUFFIX
    if not os.path.exists(index):
        raise FileNotFoundError(
            f"{path!r} has no index {index!r}. Write it once with "
            f"`kh.data.index_tfrecords({path!r})`."
        )
    values = np.loadtxt(index, dtype=np.int64, ndmin=2)
    if values.size == 0:
        values = values.reshape(0, 2)
    if values.shape[1] != 2:
        raise ValueError(
            f"Index {index!r} does not match {path!r}: expected one "
            f"`offset size` line per record, found {values.shape[1]} "
            f"value(s) per line. Rewrite it with "
            f"`kh.data.index_tfrecords({path!r})`."
        )
    offsets, sizes = values[:, 0], values[:, 1]
    expected = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    file_size = os.path.getsize(path)
    end = int(sizes.sum())
    if not np.array_equal(offsets, expected) or end != file_size:
        raise ValueError(
            f"Index {index!r} does not match {path!r}: its {len(sizes)} "
            f"record(s) cover {end} bytes, the file has {file_size} (or "
            "the records are not back to back). The file changed after it "
            "was indexed: rewrite the index with "
            f"`kh.data.index_tfrecords({path!r})`."
        )
    return offsets, sizes


class RecordStream:
    """The records of indexed TFRecord files, in blocks of records.

    The stream `kh.data.from_tfrecords` reads: in order (whole) or, under
    `kh.data.shard(reads="own")`, block by block.
    """

    def __init__(self, files, records_per_block):
        self.files = files
        self.batch_rows = records_per_block
        self._versions = [arrow.file_version(path) for path in files]
        self._index = [_read_index(path) for path in files]
        self.num_rows = int(sum(len(sizes) for _, sizes in self._index))
        self.description = f"{len(files)} TFRecord file(s)"
        # One column: the serialized record (as `TFRecordDataset` yields).
        self.columns = {"record": ((), tf.string)}

    def blocks(self):
        """`(file, first record, records)` per block of records."""
        return [
            (number, start, min(self.batch_rows, len(sizes) - start))
            for number, (_, sizes) in enumerate(self._index)
            for start in range(0, len(sizes), self.batch_rows)
        ]

    def read_block(self, block, first_row):
        """`({"record": serialized records}, bytes read)` of a block; the
        block starts at record `first_row` of the stream."""
        number, start, count = block
        offsets, sizes = self._index[number]
        path = self.files[number]
        arrow.check_unchanged(path, self._versions[number])
        low = int(offsets[start])
        high = int(offsets[start + count - 1] + sizes[start + count - 1])
        with open(path, "rb") as file:
            file.seek(low)
            data = file.read(high - low)
        records = np.empty(count, dtype=object)
        for k in range(count):
            at = int(offsets[start + k]) - low
            (length,) = struct.unpack("<Q", data[at : at + 8])
            if _HEADER + length + _FOOTER != sizes[start + k]:
                raise ValueError(
                    f"Index {path + _INDEX_SUFFIX!r} does not match "
                    f"{path!r}: record {start + k} (record {first_row + k} "
                    f"of the stream) holds {length} bytes at byte "
                    f"{offsets[start + k]}, the index says "
                    f"{sizes[start + k] - _HEADER - _FOOTER}. Rewrite it "
                    f"with `kh.data.index_tfrecords({path!r})`."
                )
            records[k] = data[at + _HEADER : at + _HEADER + length]
        return {"record": records}, high - low

    def spec(self):
        """The element spec of a batch of records."""
        return tf.TensorSpec((None,), tf.string)

    def nest(self, values):
        """`{"record": values}` as the elements (the records)."""
        return values["record"]

    def empty(self):
        """No records, as `{"record": ...}`."""
        return {"record": np.empty(0, dtype=object)}

    def _generate(self, skip, seed):
        skip, seed = int(skip), int(seed)
        if skip < 0:
            return
        blocks = self.blocks()
        first = np.cumsum([0] + [b[-1] for b in blocks]).tolist()
        if seed < 0:
            for block, start in zip(blocks, first):
                if start + block[-1] <= skip:
                    continue
                values, _ = self.read_block(block, start)
                yield values["record"][max(skip - start, 0) :]
            return
        records = np.concatenate(
            [self.read_block(b, s)[0]["record"] for b, s in zip(blocks, first)]
            or [np.empty(0, dtype=object)]
        )
        values = {"record": records}
        for part in arrow.permuted(values, seed, skip, self.batch_rows):
            yield part["record"]

    def dataset(self, skip, seed=-1):
        """The records from `skip` on, in order or in a permutation of
        `seed` (>= 0); `skip` < 0 skips all."""
        skip = tf.cast(skip, tf.int64)
        seed = tf.cast(seed, tf.int64)
        batches = tf.data.Dataset.from_generator(
            self._generate, output_signature=self.spec(), args=(skip, seed)
        )
        remaining = tf.where(
            skip < 0,
            tf.constant(0, tf.int64),
            tf.maximum(self.num_rows - skip, 0),
        )
        return (
            batches.prefetch(1)
            .unbatch()
            .apply(tf.data.experimental.assert_cardinality(remaining))
        )


def from_tfrecords(paths, *, records_per_block=1024):
    """The serialized records of indexed TFRecord files, for `kh.data.shard`.

    Like `tf.data.TFRecordDataset(files)`: unbatched serialized records, in
    file order (a directory's files sorted by name, skipping `.idx` files
    and names starting with `_` or `.`). Each file needs the index
    `kh.data.index_tfrecords` writes once. With it,
    `kh.data.shard(records, B, reads="own", map_fn=parse)` has each worker
    of a multi-worker job read only the blocks of `records_per_block`
    records its replicas train on, and parse only those (in `map_fn`, after
    the split), instead of every worker reading every file. Resuming
    mid-epoch seeks instead of reading the skipped records.

        records = kh.data.from_tfrecords("train/")
        data = kh.data.shard(records, 256, reads="own", map_fn=parse_batch)

    Args:
        paths: A TFRecord file path, a directory or glob of them, or a
            list of paths; uncompressed, each indexed.
        records_per_block: Records read (and, with `shuffle=True`,
            shuffled) together: the unit a worker is dealt. Defaults to
            `1024`.

    Returns:
        An unbatched `tf.data.Dataset` of `tf.string` records.

    Raises:
        FileNotFoundError: If a path matches no file, or a file has no
            index (the message gives the call that writes it).
        ValueError: If an index does not match its file (the file changed
            after it was indexed), or `records_per_block` is not a
            positive integer.

    Example:

    >>> index_tfrecords("train/")  # doctest: +SKIP
    >>> records = from_tfrecords("train/")  # doctest: +SKIP
    """
    records_per_block = check_int(
        "records_per_block", records_per_block, 1, "a positive integer"
    )
    return arrow.BlockDataset(
        RecordStream(_record_files(paths), records_per_block)
    )
