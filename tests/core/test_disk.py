"""core.disk: one cache folder for what the package keeps, and write_atomically: the whole file
or nothing, never a partial one left behind."""

from pathlib import Path

from oiq_mlx.core.disk import cache_dir, write_atomically
from oiq_mlx.kernels import selftest
from oiq_mlx.mlx_lm import models


def test_cache_dir_follows_oiq_mlx_cache_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("OIQ_MLX_CACHE", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert cache_dir() == tmp_path / "home" / ".cache" / "oiq_mlx"
    monkeypatch.setenv("XDG_CACHE_HOME", "")  # empty is unset, as the XDG spec says
    assert cache_dir() == tmp_path / "home" / ".cache" / "oiq_mlx"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "oiq_mlx"
    monkeypatch.setenv("OIQ_MLX_CACHE", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"


def test_models_tokenizers_and_verdicts_share_the_folder(monkeypatch, tmp_path):
    monkeypatch.setenv("OIQ_MLX_CACHE", str(tmp_path / "mine"))
    monkeypatch.delenv(selftest.DIR_VARIABLE, raising=False)
    assert models.cache_dir() == Path(tmp_path / "mine")
    assert selftest.cache_path().parent == tmp_path / "mine"
    monkeypatch.setenv(selftest.DIR_VARIABLE, str(tmp_path / "verdicts"))  # its own folder still wins
    assert selftest.cache_path().parent == tmp_path / "verdicts"


def test_writes_and_replaces_whole(tmp_path):
    path = tmp_path / "sub" / "f.json"
    assert write_atomically(path, b"first")
    assert write_atomically(path, b"second")
    assert path.read_bytes() == b"second"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.json"]


def test_a_folder_that_cannot_be_made_writes_nothing(tmp_path):
    (tmp_path / "a_file").write_text("")
    assert not write_atomically(tmp_path / "a_file" / "f.json", b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]


def test_a_failed_write_leaves_no_partial_file(tmp_path):
    path = tmp_path / "f.json"
    path.mkdir()  # os.replace cannot put a file where a folder is
    assert not write_atomically(path, b"data")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"] and path.is_dir()
