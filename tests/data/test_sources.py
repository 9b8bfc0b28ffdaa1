import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from weir.data.sources import (
    PromptSource,
    SourceExhausted,
    load_rows,
    map_fields,
    write_jsonl,
    write_parquet,
)

ROWS = [{"prompt": f"p{i}", "answer": str(i), "meta": {"k": [i, i + 1]}} for i in range(10)]


def rows_provider():
    """Used by the dotted-path test."""
    return [{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": "2"}]


def rows_for_split(split="train"):
    return [{"prompt": split, "answer": "0"}]


ROWS_CONSTANT = [{"prompt": "c", "answer": "3"}]


# ------------------------------------------------------------------------------------ load_rows


def test_jsonl_round_trip(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", ROWS + [{"prompt": "ünïcode ✓", "answer": "x"}])
    assert load_rows(path) == ROWS + [{"prompt": "ünïcode ✓", "answer": "x"}]
    assert load_rows(str(path)) == load_rows(path)


def test_parquet_round_trip(tmp_path):
    path = write_parquet(tmp_path / "d.parquet", ROWS)
    assert load_rows(path) == ROWS


def test_json_list_and_blank_lines(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps(ROWS[:3]))
    assert load_rows(tmp_path / "a.json") == ROWS[:3]
    (tmp_path / "b.jsonl").write_text('\ufeff{"prompt": "x"}\n\n   \n{"prompt": "y"}\n')
    assert load_rows(tmp_path / "b.jsonl") == [{"prompt": "x"}, {"prompt": "y"}]


def test_jsonl_errors_name_file_and_line(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"prompt": "ok2"}\n{"prompt": oops}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:3: malformed JSON"):
        load_rows(bad)
    bad.write_text('{"prompt": "ok"}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: expected a JSON object.*list"):
        load_rows(bad)
    bad.write_bytes(b'{"prompt": "ok"}\n{"prompt": "\xff\xfe"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:2: not valid UTF-8"):
        load_rows(bad)


def test_empty_and_missing_sources(tmp_path):
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(ValueError, match="empty"):
        load_rows(tmp_path / "empty.jsonl")
    with pytest.raises(ValueError, match="empty"):
        load_rows([])
    with pytest.raises(FileNotFoundError):
        load_rows(tmp_path / "nope.jsonl")
    with pytest.raises(FileNotFoundError):
        load_rows("nope.jsonl")
    (tmp_path / "x.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match="unknown file type"):
        load_rows(tmp_path / "x.csv")
    with pytest.raises(ValueError, match="row 1 is a int"):
        load_rows([{"a": 1}, 5])


def test_iterables_callables_and_dotted_paths():
    assert load_rows(iter(ROWS)) == ROWS
    assert load_rows(lambda: (r for r in ROWS[:2])) == ROWS[:2]
    mod = __name__
    assert load_rows(f"{mod}:rows_provider") == rows_provider()
    assert load_rows(f"{mod}.rows_provider") == rows_provider()
    assert load_rows(f"{mod}:ROWS_CONSTANT") == ROWS_CONSTANT
    assert load_rows(f"{mod}:rows_for_split", split="test") == [{"prompt": "test", "answer": "0"}]
    with pytest.raises(ValueError, match="no attribute"):
        load_rows(f"{mod}:no_such_rows")


def test_split_directory(tmp_path):
    write_jsonl(tmp_path / "train.jsonl", ROWS[:4])
    write_parquet(tmp_path / "test.parquet", ROWS[4:6])
    assert load_rows(tmp_path, split="train") == ROWS[:4]
    assert load_rows(tmp_path, split="test") == ROWS[4:6]
    with pytest.raises(ValueError, match="split="):
        load_rows(tmp_path)
    with pytest.raises(FileNotFoundError, match="validation"):
        load_rows(tmp_path, split="validation")


def test_hf_datasets_directory(tmp_path):
    try:
        import datasets
    except ImportError:
        (tmp_path / "dataset_info.json").write_text("{}")
        with pytest.raises(ImportError, match=r"pip install 'weir\[datasets\]'"):
            load_rows(tmp_path)
        return
    datasets.Dataset.from_list(ROWS[:3]).save_to_disk(str(tmp_path / "ds"))
    assert load_rows(tmp_path / "ds") == ROWS[:3]
    dd = datasets.DatasetDict(
        train=datasets.Dataset.from_list(ROWS[:3]), test=datasets.Dataset.from_list(ROWS[3:5])
    )
    dd.save_to_disk(str(tmp_path / "dd"))
    assert load_rows(tmp_path / "dd", split="test") == ROWS[3:5]
    with pytest.raises(ValueError, match="split"):
        load_rows(tmp_path / "dd")


# --------------------------------------------------------------------------------- PromptSource


def prompts(batches):
    return [r["prompt"] for b in batches for r in b]


def test_index_and_copies():
    src = PromptSource([{"prompt": "a"}, {"prompt": "b", "_index": 99}], seed=0, shuffle=False)
    batch = src.next_batch(2)
    assert [r["_index"] for r in batch] == [0, 99]
    batch[0]["prompt"] = "mutated"
    assert src.next_batch(1)[0]["prompt"] == "a"


def test_deterministic_shuffle():
    a = PromptSource(ROWS, seed=3)
    b = PromptSource(ROWS, seed=3)
    c = PromptSource(ROWS, seed=4)
    ba, bb, bc = a.next_batch(10), b.next_batch(10), c.next_batch(10)
    assert ba == bb
    assert [r["_index"] for r in ba] != [r["_index"] for r in bc]
    assert sorted(r["_index"] for r in ba) == list(range(10))
    # epoch 1 uses seed + 1, so a second epoch has a different order
    assert [r["_index"] for r in a.next_batch(10)] == a.order(1) != a.order(0)
    unshuffled = PromptSource(ROWS, seed=3, shuffle=False)
    assert [r["_index"] for r in unshuffled.next_batch(10)] == list(range(10))


def test_epoch_crossing_and_exhaustion():
    src = PromptSource(ROWS, seed=0, epochs=2)
    assert src.epoch == 0
    first = src.next_batch(7)
    second = src.next_batch(7)  # 3 rows of epoch 0, then 4 of epoch 1
    assert src.epoch == 1 and src.position == 4
    assert [r["_index"] for r in first + second[:3]] == src.order(0)
    assert [r["_index"] for r in second[3:]] == src.order(1)[:4]
    rest = src.next_batch(7)
    assert len(rest) == 6  # the last batch is short
    assert src.exhausted and src.epoch == 2
    with pytest.raises(SourceExhausted, match="2 epoch"):
        src.next_batch(1)
    with pytest.raises(StopIteration):
        src.next_batch(1)
    assert len(list(PromptSource(ROWS, seed=0, epochs=3))) == 30
    with pytest.raises(ValueError):
        src.next_batch(0)
    with pytest.raises(ValueError, match="no rows"):
        PromptSource([], seed=0)


def test_state_dict_resume():
    ref = PromptSource(ROWS, seed=11)
    ref.next_batch(4)
    ref.next_batch(9)
    state = ref.state_dict()
    assert state["epoch"] == 1 and state["position"] == 3
    expected = [ref.next_batch(6) for _ in range(5)]

    resumed = PromptSource(ROWS, seed=11)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives JSON (checkpoint)
    assert [resumed.next_batch(6) for _ in range(5)] == expected
    assert resumed.state_dict() == ref.state_dict()

    with pytest.raises(ValueError, match="seed"):
        PromptSource(ROWS, seed=12).load_state_dict(state)
    with pytest.raises(ValueError, match="num_rows"):
        PromptSource(ROWS[:5], seed=11).load_state_dict(state)


@settings(max_examples=60, deadline=None)
@given(
    n=st.integers(1, 40),
    seed=st.integers(0, 2**31),
    sizes=st.lists(st.integers(1, 50), min_size=1, max_size=20),
)
def test_property_every_row_once_per_epoch(n, seed, sizes):
    """Whatever the batch sizes (crossing epoch boundaries or not), the stream of rows splits
    into consecutive blocks of n that each visit every row exactly once."""
    src = PromptSource([{"prompt": str(i)} for i in range(n)], seed=seed)
    stream = []
    i = 0
    while len(stream) < 3 * n:
        stream += [r["_index"] for r in src.next_batch(sizes[i % len(sizes)])]
        i += 1
    for e in range(3):
        assert sorted(stream[e * n : (e + 1) * n]) == list(range(n))
        assert stream[e * n : (e + 1) * n] == src.order(e)


# ------------------------------------------------------------------------------------ map_fields


def test_map_fields():
    row = {"question": "q", "target": "7", "_index": 3, "extra": 1}
    out = map_fields(row, prompt_key="question", answer_key="target")
    assert out["prompt"] == "q" and out["answer"] == "7" and out["extra"] == 1
    assert map_fields({"prompt": "p"}, answer_key=None) == {"prompt": "p"}
    chat = [{"role": "user", "content": "hi"}]
    assert map_fields({"conv": chat, "answer": "x"}, messages_key="conv")["messages"] == chat
    with pytest.raises(ValueError) as e:
        map_fields(row, prompt_key="prompt", answer_key="target")
    msg = str(e.value)
    assert (
        "'prompt'" in msg and "row 3" in msg and "['_index', 'extra', 'question', 'target']" in msg
    )
    with pytest.raises(ValueError, match="answer field 'answer'"):
        map_fields(row, prompt_key="question")
