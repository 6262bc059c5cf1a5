"""Learning histories through .npz and HDF5: exact round trips, the same validation as the native
format, clear errors for missing or corrupt fields, and the icrl-data export/import commands."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from icrl_models.data import (
    DatasetError,
    GenerateConfig,
    LearningHistories,
    export_histories,
    generate_histories,
    import_histories,
    load_histories,
    save_histories,
)
from icrl_models.data.cli import main

FORMATS = ["npz", pytest.param("hdf5", marks=pytest.mark.skipif("h5py" not in sys.modules and
                                                                 __import__("importlib").util.find_spec("h5py") is None,
                                                                 reason="h5py is not installed"))]  # fmt: skip
SUFFIX = {"npz": ".npz", "hdf5": ".h5"}


@pytest.fixture(scope="module", params=["dark_room", "contextual_bandit"])
def histories(request) -> LearningHistories:
    # Dark Room: int states; contextual bandits: float observation vectors and task arrays of rank > 1.
    episodes = 3 if request.param == "dark_room" else 1
    return generate_histories(GenerateConfig(env=request.param, num_histories=3, num_episodes=episodes, seed=1),
                              progress=False)  # fmt: skip


def _assert_same(a: LearningHistories, b: LearningHistories) -> None:
    assert a.metadata == b.metadata
    assert set(a.arrays()) == set(b.arrays())
    for name, value in a.arrays().items():
        other = b.arrays()[name]
        assert other.dtype == value.dtype and other.shape == value.shape, name
        np.testing.assert_array_equal(other, value, err_msg=name)


@pytest.mark.parametrize("format", FORMATS)
def test_round_trip_is_exact(histories, format, tmp_path):
    path = export_histories(histories, tmp_path / f"h{SUFFIX[format]}")
    back = import_histories(path)
    _assert_same(histories, back)
    back.validate()
    # ... and the imported data saves as a native file that loads back the same.
    _assert_same(histories, load_histories(save_histories(back, tmp_path / "h.icrl")))
    assert import_histories(path, expect={"split": histories.metadata["split"]}) is not None
    with pytest.raises(DatasetError, match="metadata 'split'"):
        import_histories(path, expect={"split": "nope"})


def _rewrite_npz(path, drop=(), **replace):
    with np.load(path) as file:
        contents = {name: file[name] for name in file.files if name not in drop}
    contents.update(replace)
    np.savez(path, **contents)


@pytest.mark.parametrize("field", ["actions", "dones", "action_sets", "metadata"])
def test_missing_field_is_named(histories, field, tmp_path):
    path = export_histories(histories, tmp_path / "h.npz")
    _rewrite_npz(path, drop=(field,))
    with pytest.raises(DatasetError, match=f"lacks the field '{field}'"):
        import_histories(path)


def test_corrupt_fields_fail_validation_naming_them(histories, tmp_path):
    path = export_histories(histories, tmp_path / "h.npz")
    _rewrite_npz(path, actions=np.asarray(histories.actions)[:, :-1])
    with pytest.raises(DatasetError, match="h.npz: .*shape"):
        import_histories(path)
    path = export_histories(histories, tmp_path / "h.npz")
    bad = np.asarray(histories.rewards).copy()
    bad[0, 0] = np.nan
    _rewrite_npz(path, rewards=bad)
    with pytest.raises(DatasetError, match="rewards hold NaN"):
        import_histories(path)
    path = export_histories(histories, tmp_path / "h.npz")
    _rewrite_npz(path, metadata=np.array("{not json"))
    with pytest.raises(DatasetError, match="field 'metadata' is not a JSON string"):
        import_histories(path)
    _rewrite_npz(path, metadata=np.array(json.dumps({**histories.metadata, "num_episodes": "3"})))
    with pytest.raises(DatasetError, match="num_episodes"):
        import_histories(path)
    _rewrite_npz(path, format=np.array("something-else"))
    with pytest.raises(DatasetError, match="field 'format'"):
        import_histories(path)
    (tmp_path / "garbage.npz").write_bytes(b"garbage")
    with pytest.raises(DatasetError, match="not a readable .npz"):
        import_histories(tmp_path / "garbage.npz")
    with pytest.raises(FileNotFoundError):
        import_histories(tmp_path / "missing.npz")


def test_bad_arguments(histories, tmp_path):
    with pytest.raises(ValueError, match="path must end in one of"):
        export_histories(histories, tmp_path / "h.csv")
    with pytest.raises(ValueError, match="format must be one of"):
        export_histories(histories, tmp_path / "h.npz", format="parquet")
    with pytest.raises(TypeError, match="histories must be LearningHistories"):
        export_histories({"actions": 1}, tmp_path / "h.npz")
    export_histories(histories, tmp_path / "h.data", format="npz")  # an explicit format beats the suffix
    _assert_same(histories, import_histories(tmp_path / "h.data", format="npz"))


def test_hdf5_without_h5py_is_one_clear_line(histories, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "h5py", None)
    with pytest.raises(ImportError, match=r"pip install 'icrl-kernels\[hdf5\]'"):
        export_histories(histories, tmp_path / "h.h5")
    assert not list(tmp_path.iterdir())  # nothing half-written
    save_histories(histories, tmp_path / "h.icrl")
    assert main(["export", str(tmp_path / "h.icrl"), str(tmp_path / "h.h5")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("icrl-data: error: HDF5 files need the h5py package")


def test_cli_export_and_import(histories, tmp_path, capsys):
    native = save_histories(histories, tmp_path / "h.icrl")
    assert main(["export", str(native), str(tmp_path / "h.npz")]) == 0
    assert main(["import", str(tmp_path / "h.npz"), str(tmp_path / "back.icrl")]) == 0
    _assert_same(histories, load_histories(tmp_path / "back.icrl"))
    capsys.readouterr()
    _rewrite_npz(tmp_path / "h.npz", drop=("lengths",))
    assert main(["import", str(tmp_path / "h.npz"), str(tmp_path / "bad.icrl")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "lacks the field 'lengths'" in err
    assert not (tmp_path / "bad.icrl").exists()
