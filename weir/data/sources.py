"""Prompt data: load rows from files, datasets or user code, and iterate them resumably.

`load_rows` turns a source into a list of dict rows; `PromptSource` hands them out in batches in a
seeded, per-epoch shuffled order whose position is saved with checkpoints, so a resumed run sees
exactly the rows it would have seen; `map_fields` renames dataset columns to weir's
``prompt`` / ``answer`` / ``messages``.
"""

from __future__ import annotations

import inspect
import json
import random
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

__all__ = [
    "load_rows",
    "PromptSource",
    "SourceExhausted",
    "map_fields",
]

JSONL_SUFFIXES = {".jsonl", ".ndjson"}
JSON_SUFFIXES = {".json"}
PARQUET_SUFFIXES = {".parquet", ".pq"}
DATA_SUFFIXES = JSONL_SUFFIXES | JSON_SUFFIXES | PARQUET_SUFFIXES


# --------------------------------------------------------------------------------------- loading


def load_rows(
    source: str | Path | Iterable[Mapping[str, Any]] | Callable[..., Iterable[Mapping[str, Any]]],
    *,
    split: str | None = None,
) -> list[dict[str, Any]]:
    """Load prompt rows (dicts) from `source`.

    `source` may be
      - a ``.jsonl`` / ``.ndjson`` file (one JSON object per line; blank lines skipped),
      - a ``.json`` file holding a list of objects (or JSON lines),
      - a ``.parquet`` file (read with pyarrow),
      - a directory written by HF ``datasets`` ``save_to_disk`` (needs ``pip install weir[datasets]``;
        a ``DatasetDict`` needs `split` unless it has a single split),
      - a directory holding ``{split}.jsonl`` / ``{split}.parquet`` (`split` required),
      - ``"hf:<name>"``: ``datasets.load_dataset(name, split=split)`` (hub or cache),
      - a dotted path ``pkg.mod:attr`` to an iterable of dicts or to a function returning one,
      - an iterable of dicts, or a function returning one (called with ``split=`` if it accepts it).

    For a single file `split` is ignored. Raises ValueError for an empty source, a row that is not
    a dict, or a malformed file (naming the file and line), FileNotFoundError for a missing path.
    """
    label = _label(source)
    rows = _load(source, split)
    out: list[dict[str, Any]] = []
    for i, row in enumerate(rows):
        if not isinstance(row, Mapping):
            raise ValueError(f"{label}: row {i} is a {type(row).__name__}, expected a dict")
        out.append(dict(row))
    if not out:
        raise ValueError(f"{label}: the source is empty (no rows)")
    return out


def _label(source: Any) -> str:
    if isinstance(source, (str, Path)):
        return f"data source {str(source)!r}"
    return f"data source {getattr(source, '__name__', type(source).__name__)}"


def _load(source: Any, split: str | None) -> Iterable[Any]:
    if isinstance(source, Path):
        return _load_path(source, split)
    if isinstance(source, str):
        if source.startswith("hf:"):
            return _load_hf_hub(source[3:], split)
        path = Path(source).expanduser()
        if path.exists():
            return _load_path(path, split)
        looks_like_path = "/" in source or "\\" in source or path.suffix.lower() in DATA_SUFFIXES
        if looks_like_path or ("." not in source and ":" not in source):
            raise FileNotFoundError(f"data source {source!r}: no such file or directory")
        from weir.plugins import resolve

        obj = resolve(source, {}, "data source", require_callable=False)
        return _load(obj, split)
    if isinstance(source, Mapping):
        raise ValueError("data source is a single dict; give a list of dict rows")
    if callable(source):
        kwargs = {}
        if split is not None:
            try:
                params = inspect.signature(source).parameters
                if "split" in params or any(p.kind is p.VAR_KEYWORD for p in params.values()):
                    kwargs["split"] = split
            except (TypeError, ValueError):
                pass
        result = source(**kwargs)
        if callable(result) or isinstance(result, (str, Path)):
            raise ValueError(
                f"data source function {getattr(source, '__name__', source)!r} returned "
                f"{type(result).__name__}; it must return an iterable of dicts"
            )
        return _load(result, split)
    if isinstance(source, Iterable):
        return source
    raise ValueError(
        f"data source must be a path, a dotted path, an iterable of dicts or a function; "
        f"got {type(source).__name__}"
    )


def _load_path(path: Path, split: str | None) -> Iterable[Any]:
    if path.is_dir():
        if (
            (path / "dataset_info.json").exists()
            or (path / "dataset_dict.json").exists()
            or (path / "state.json").exists()
        ):
            return _load_hf_disk(path, split)
        if split is None:
            found = sorted(p.name for p in path.iterdir() if p.suffix.lower() in DATA_SUFFIXES)
            raise ValueError(
                f"data source {str(path)!r} is a directory; give split= to pick one of {found} "
                "(or point at a file)"
            )
        for suffix in (".jsonl", ".ndjson", ".parquet", ".json"):
            candidate = path / f"{split}{suffix}"
            if candidate.exists():
                return _load_path(candidate, None)
        raise FileNotFoundError(
            f"data source {str(path)!r}: no {split}.jsonl / {split}.parquet / {split}.json in it"
        )
    if not path.exists():
        raise FileNotFoundError(f"data source {str(path)!r}: no such file or directory")
    suffix = path.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        return read_jsonl(path)
    if suffix in PARQUET_SUFFIXES:
        return read_parquet(path)
    if suffix in JSON_SUFFIXES:
        return _read_json(path)
    raise ValueError(
        f"data source {str(path)!r}: unknown file type {suffix!r}; "
        f"use one of {sorted(DATA_SUFFIXES)} or a datasets directory"
    )


def read_jsonl(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSON-lines file; every error names the file and the 1-based line number."""
    path = Path(path)
    rows: list[dict[str, Any]] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: not valid UTF-8 ({e.reason} at byte {e.start})"
                ) from e
            if lineno == 1:
                line = line.lstrip("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(
                    f"{path}:{lineno}: malformed JSON: {e.msg} (column {e.colno})"
                ) from e
            if not isinstance(obj, dict):
                raise ValueError(
                    f"{path}:{lineno}: expected a JSON object per line, got {type(obj).__name__}"
                )
            rows.append(obj)
    return rows


def _read_json(path: Path) -> list[Any]:
    try:
        text = path.read_text(encoding="utf-8-sig")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not valid UTF-8 ({e.reason} at byte {e.start})") from e
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return read_jsonl(path)  # JSON lines under a .json name; errors name the line
    if isinstance(obj, dict):
        obj = [obj]
    if not isinstance(obj, list):
        raise ValueError(f"{path}: expected a JSON list of objects, got {type(obj).__name__}")
    return obj


def read_parquet(path: str | Path) -> list[dict[str, Any]]:
    """Read a Parquet file into a list of dict rows (pyarrow)."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:
        raise ValueError(f"{path}: cannot read Parquet: {type(e).__name__}: {e}") from e
    return table.to_pylist()


def write_jsonl(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write rows as JSON lines (UTF-8, non-ASCII kept). Returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(dict(row), ensure_ascii=False) + "\n")
    return path


def write_parquet(path: str | Path, rows: Iterable[Mapping[str, Any]]) -> Path:
    """Write rows as a Parquet file (pyarrow infers the schema). Returns the path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist([dict(r) for r in rows]), path)
    return path


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError as e:
        raise ImportError(
            "loading a Hugging Face datasets source needs the `datasets` package: "
            "pip install 'weir[datasets]'"
        ) from e
    return datasets


def _load_hf_disk(path: Path, split: str | None) -> Iterable[Any]:
    datasets = _import_datasets()
    ds = datasets.load_from_disk(str(path))
    return list(_select_split(ds, split, str(path)))


def _load_hf_hub(name: str, split: str | None) -> Iterable[Any]:
    datasets = _import_datasets()
    ds = datasets.load_dataset(name, split=split)
    return list(_select_split(ds, split, name))


def _select_split(ds: Any, split: str | None, where: str) -> Any:
    if not isinstance(ds, Mapping):
        return ds  # a single Dataset (a DatasetDict is a dict of splits)
    splits = sorted(ds.keys())
    if split is None:
        if len(splits) == 1:
            return ds[splits[0]]
        raise ValueError(f"data source {where!r} has splits {splits}; give split= to pick one")
    if split not in ds:
        raise ValueError(f"data source {where!r} has no split {split!r}; it has {splits}")
    return ds[split]


# ------------------------------------------------------------------------------------- iteration


class SourceExhausted(StopIteration):
    """Raised by `PromptSource.next_batch` once all `epochs` have been handed out.

    It subclasses StopIteration so a plain ``while True: ... except StopIteration`` loop ends; note
    that (PEP 479) raising it inside a generator turns it into RuntimeError.
    """


class PromptSource:
    """Seeded, resumable iteration over prompt rows.

    Epoch ``e`` visits every row exactly once, in the order of a ``random.Random(seed + e)``
    shuffle (or the original order with ``shuffle=False``). `next_batch(k)` returns the next `k`
    rows and crosses epoch boundaries freely. With ``epochs=None`` iteration never ends; with
    ``epochs=E`` the last batch may be shorter than `k` (it stops at the end of epoch ``E-1``) and
    the call after that raises `SourceExhausted`.

    Every row gets ``_index`` (its position in `rows`) unless it already has one; rows are returned
    as shallow copies, so callers may add keys freely. `state_dict()` / `load_state_dict()` save and
    restore (epoch, position): a source restored from a state continues with exactly the rows the
    original would have returned.
    """

    def __init__(
        self,
        rows: Iterable[Mapping[str, Any]],
        *,
        seed: int,
        shuffle: bool = True,
        epochs: int | None = None,
    ) -> None:
        self._rows: list[dict[str, Any]] = []
        for i, row in enumerate(rows):
            if not isinstance(row, Mapping):
                raise ValueError(
                    f"PromptSource: row {i} is a {type(row).__name__}, expected a dict"
                )
            self._rows.append(dict(row) if "_index" in row else {**row, "_index": i})
        if not self._rows:
            raise ValueError("PromptSource: no rows (the data source is empty)")
        if epochs is not None and epochs < 1:
            raise ValueError(f"PromptSource: epochs must be >= 1 or None, got {epochs}")
        self.seed = int(seed)
        self.shuffle = bool(shuffle)
        self.epochs = epochs
        self._epoch = 0
        self._position = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def __len__(self) -> int:
        return len(self._rows)

    @property
    def epoch(self) -> int:
        """The epoch the next row comes from (0-based); equals `epochs` once exhausted."""
        return self._epoch

    @property
    def position(self) -> int:
        """How many rows of the current epoch have been handed out."""
        return self._position

    @property
    def exhausted(self) -> bool:
        return self.epochs is not None and self._epoch >= self.epochs

    def order(self, epoch: int) -> list[int]:
        """The row indices of `epoch` in the order they are handed out."""
        order = list(range(len(self._rows)))
        if self.shuffle:
            random.Random(self.seed + epoch).shuffle(order)
        return order

    def _current_order(self) -> list[int]:
        if self._order_epoch != self._epoch:
            self._order = self.order(self._epoch)
            self._order_epoch = self._epoch
        return self._order

    def next_batch(self, k: int) -> list[dict[str, Any]]:
        """The next `k` rows (fewer only at the very end of the last epoch).

        Raises SourceExhausted when no row is left.
        """
        if k < 1:
            raise ValueError(f"PromptSource.next_batch: k must be >= 1, got {k}")
        if self.exhausted:
            raise SourceExhausted(
                f"PromptSource: all {self.epochs} epoch(s) of {len(self._rows)} rows are used up"
            )
        out: list[dict[str, Any]] = []
        n = len(self._rows)
        while len(out) < k and not self.exhausted:
            order = self._current_order()
            take = min(k - len(out), n - self._position)
            out.extend(dict(self._rows[i]) for i in order[self._position : self._position + take])
            self._position += take
            if self._position == n:
                self._epoch += 1
                self._position = 0
        return out

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yield rows one at a time until exhausted (forever with ``epochs=None``)."""
        while not self.exhausted:
            yield self.next_batch(1)[0]

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_rows": len(self._rows),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore (epoch, position). The seed, shuffle flag and row count must match the saved ones,
        or the continuation would silently differ; a mismatch raises ValueError."""
        for key, mine in (
            ("num_rows", len(self._rows)),
            ("seed", self.seed),
            ("shuffle", self.shuffle),
        ):
            if key in state and state[key] != mine:
                raise ValueError(
                    f"PromptSource.load_state_dict: saved {key}={state[key]!r} but this source has "
                    f"{key}={mine!r}; resuming would give a different data order"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < len(self._rows):
            raise ValueError(
                f"PromptSource.load_state_dict: invalid epoch={epoch} position={position} "
                f"for {len(self._rows)} rows"
            )
        self._epoch, self._position = epoch, position


# --------------------------------------------------------------------------------- field mapping


def map_fields(
    row: Mapping[str, Any],
    prompt_key: str = "prompt",
    answer_key: str | None = "answer",
    messages_key: str | None = None,
) -> dict[str, Any]:
    """Return a copy of `row` with its prompt under ``"prompt"`` (or its chat under ``"messages"``
    when `messages_key` is given) and its ground truth under ``"answer"``; other keys are kept.

    ``answer_key=None`` skips the answer (e.g. data scored by a reward model). A missing field
    raises ValueError naming the field, the row's ``_index`` and the keys the row has.
    """

    def get(key: str, role: str) -> Any:
        if key not in row:
            where = f"row {row['_index']}" if "_index" in row else "row"
            raise ValueError(
                f"{where} has no {role} field {key!r}; its keys are {sorted(row)} "
                f"(set the {role} key in the data config)"
            )
        return row[key]

    out = dict(row)
    if messages_key is not None:
        out["messages"] = get(messages_key, "messages")
    else:
        out["prompt"] = get(prompt_key, "prompt")
    if answer_key is not None:
        out["answer"] = get(answer_key, "answer")
    return out
