import os.path

import pytest

from weir.plugins import import_path, resolve

REG = {"exact_match": len, "numeric": abs}


def test_callable_passes_through():
    def f():
        return 1

    assert resolve(f, REG, "reward") is f


def test_registry_name():
    assert resolve("numeric", REG, "reward") is abs


def test_dotted_paths_colon_and_dot():
    assert resolve("os.path:join", REG, "reward") is os.path.join
    assert resolve("os.path.join", REG, "reward") is os.path.join
    # attribute path after the colon
    assert resolve("weir.data.sources:PromptSource.next_batch", REG, "x").__name__ == "next_batch"


def test_unknown_name_lists_valid_and_nearest():
    with pytest.raises(ValueError) as e:
        resolve("exact_mtch", REG, "reward function")
    msg = str(e.value)
    assert "reward function" in msg and "'exact_mtch'" in msg
    assert "['exact_match', 'numeric']" in msg
    assert "did you mean 'exact_match'" in msg


def test_import_failure_names_module_and_error():
    with pytest.raises(ValueError) as e:
        resolve("no_such_pkg_xyz.mod:fn", REG, "reward")
    assert "no_such_pkg_xyz.mod" in str(e.value) and "ModuleNotFoundError" in str(e.value)
    with pytest.raises(ValueError) as e:
        resolve("no_such_pkg_xyz.fn", REG, "reward")
    assert "no_such_pkg_xyz" in str(e.value)


def test_module_raising_on_import(tmp_path, monkeypatch):
    (tmp_path / "weir_broken_mod.py").write_text("raise RuntimeError('boom at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError) as e:
        resolve("weir_broken_mod:fn", REG, "reward")
    assert "weir_broken_mod" in str(e.value) and "boom at import" in str(e.value)
    with pytest.raises(ValueError) as e:
        resolve("weir_broken_mod.fn", REG, "reward")
    assert "boom at import" in str(e.value)


def test_missing_attribute():
    with pytest.raises(ValueError) as e:
        resolve("os.path:joinn", REG, "reward")
    assert "no attribute 'joinn'" in str(e.value) and "did you mean 'join'" in str(e.value)
    with pytest.raises(ValueError, match="no attribute"):
        resolve("os.path.joinn", REG, "reward")


def test_not_callable_and_bad_types():
    with pytest.raises(ValueError, match="not callable"):
        resolve("os.path:sep", REG, "reward")
    assert resolve("os.path:sep", REG, "data source", require_callable=False) == os.path.sep
    with pytest.raises(ValueError, match="reward"):
        resolve(42, REG, "reward")  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        import_path("a..b")
