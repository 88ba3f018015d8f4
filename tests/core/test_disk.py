"""core.disk.write_atomically: the whole file or nothing, never a partial one left behind."""

from oiq_mlx.core.disk import write_atomically


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
