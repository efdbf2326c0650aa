import pytest

from quantkit.errors import DestinationExistsError
from quantkit.export.atomic import atomic_directory


def test_success_renames_into_place(tmp_path):
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("x")
        assert not (tmp_path / "out").exists()
    assert (tmp_path / "out" / "a.txt").read_text() == "x"
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("error", [RuntimeError, KeyboardInterrupt])
def test_failure_or_ctrl_c_leaves_nothing(tmp_path, error):
    with pytest.raises(error):
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "half.bin").write_bytes(b"\0")
            raise error()
    assert list(tmp_path.iterdir()) == []


def test_existing_destination_is_refused(tmp_path):
    (tmp_path / "out").mkdir()
    with pytest.raises(DestinationExistsError, match="--overwrite"):
        with atomic_directory(tmp_path / "out"):
            pass


def test_overwrite_replaces_and_failed_overwrite_keeps_the_old(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "old.txt").write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_directory(out, overwrite=True):
            raise RuntimeError
    assert (out / "old.txt").exists()
    with atomic_directory(out, overwrite=True) as tmp:
        (tmp / "new.txt").write_text("new")
    assert [p.name for p in out.iterdir()] == ["new.txt"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_destination_under_a_file_is_refused_before_any_work(tmp_path):
    from quantkit.export.atomic import check_destination

    (tmp_path / "afile").write_text("x")
    with pytest.raises(DestinationExistsError, match="afile is a file; choose another path"):
        check_destination(tmp_path / "afile" / "deeper" / "out", overwrite=False)


def test_a_destination_in_a_folder_it_cannot_write_is_refused(tmp_path, monkeypatch):
    from quantkit.export import atomic

    monkeypatch.setattr(atomic.os, "access", lambda path, mode: False)  # as a non-root user on a read-only folder
    with pytest.raises(DestinationExistsError, match="is not writable"):
        atomic.check_destination(tmp_path / "out", overwrite=False)


def test_an_abandoned_temporary_output_is_removed_by_the_next_write(tmp_path):
    import os
    import socket
    import subprocess
    import sys

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    host = socket.gethostname()
    abandoned = tmp_path / f".out.tmp-{host}-{gone.stdout.strip()}-abc"  # its process exited without cleaning up
    alive = tmp_path / f".out.tmp-{host}-{os.getpid()}-def"  # another write of DST, still running
    other_host = tmp_path / f".out.tmp-elsewhere-{gone.stdout.strip()}-ghi"  # a process we cannot see
    for folder in (abandoned, alive, other_host):
        folder.mkdir()
        (folder / "model.safetensors").write_bytes(b"\0" * 16)
    with atomic_directory(tmp_path / "out") as tmp:
        (tmp / "a.txt").write_text("x")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["out", alive.name, other_host.name])


@pytest.mark.parametrize("mask, directory, file", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)])
def test_the_artifact_has_the_umasks_modes(tmp_path, mask, directory, file):
    """mkdtemp's directory is owner-only and transformers writes its weights 0600: the artifact ends with what a
    plain mkdir and open() give under the umask, so a server running as another user can read it."""
    import os

    old = os.umask(mask)
    try:
        with atomic_directory(tmp_path / "out") as tmp:
            (tmp / "sub").mkdir(mode=0o700)
            (tmp / "sub" / "weights.bin").write_bytes(b"\0")
            os.chmod(tmp / "sub" / "weights.bin", 0o600)
        with atomic_directory(tmp_path / "one.gguf", single_file="one.gguf") as tmp:
            (tmp / "one.gguf").write_bytes(b"\0")
            os.chmod(tmp / "one.gguf", 0o600)
    finally:
        os.umask(old)
    modes = {p.relative_to(tmp_path).as_posix(): p.stat().st_mode & 0o777 for p in [tmp_path / "out", *(tmp_path / "out").rglob("*")]}
    assert modes == {"out": directory, "out/sub": directory, "out/sub/weights.bin": file}
    assert (tmp_path / "one.gguf").stat().st_mode & 0o777 == file


def test_a_file_is_written_all_at_once_with_the_umasks_mode(tmp_path, monkeypatch):
    """`write_text` (reports): the file replaced whole, 0644 under umask 022 (mkstemp's is 0600), and a failed
    rename leaves the old file and no temporary one."""
    import os

    from quantkit.export.atomic import write_text

    page = tmp_path / "page.html"
    page.write_text("old")
    old = os.umask(0o022)
    try:
        write_text(page, "new é")
    finally:
        os.umask(old)
    assert page.read_text(encoding="utf-8") == "new é" and page.stat().st_mode & 0o777 == 0o644

    def fail(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "replace", fail)
    with pytest.raises(KeyboardInterrupt):
        write_text(page, "half")
    assert page.read_text(encoding="utf-8") == "new é" and os.listdir(tmp_path) == ["page.html"]
