import os
import subprocess
import sys
from pathlib import Path

import pytest

from quantkit.runtime import environment as runtime
@pytest.mark.parametrize("value, enabled", [("1", True), ("true", True), ("YES", True), ("0", False), ("", False),
                                            ("false", False), ("no", False)])
def test_debug_is_on_only_for_1_true_yes(monkeypatch, value, enabled):
    monkeypatch.setenv("QUANTKIT_DEBUG", value)
    assert runtime.debug_enabled() is enabled


def test_debug_is_off_when_unset(monkeypatch):
    monkeypatch.delenv("QUANTKIT_DEBUG", raising=False)
    assert not runtime.debug_enabled()


def test_rank_and_launcher_from_the_environment(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "TORCHELASTIC_RUN_ID", runtime.THREADS_VARIABLE):
        monkeypatch.delenv(name, raising=False)
    assert runtime.is_main_process() and not runtime.under_torchrun() and runtime.launched_threads() is None
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv(runtime.THREADS_VARIABLE, "3")
    assert not runtime.is_main_process() and runtime.under_torchrun() and runtime.launched_threads() == 3


def test_set_threads_sets_torch_threads():
    import torch

    before = torch.get_num_threads()
    try:
        assert runtime.set_threads(1) == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("configure, variable, default, theirs", [
    (runtime.advise_huge_pages, runtime.HUGE_PAGES_VARIABLE, "1", "0"),
    (runtime.configure_cuda_allocator, runtime.CUDA_ALLOCATOR_VARIABLE, "expandable_segments:True", "max_split_size_mb:128"),
])
def test_torch_settings_are_made_unless_the_environment_says_otherwise(monkeypatch, configure, variable, default, theirs):
    """Transparent huge pages for large CPU tensors; CUDA segments that grow instead of fragmenting."""
    monkeypatch.delenv(variable, raising=False)
    configure()
    assert os.environ[variable] == default
    monkeypatch.setenv(variable, theirs)
    configure()
    assert os.environ[variable] == theirs


def _thp_mode() -> str | None:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return None
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else None


@pytest.mark.skipif(_thp_mode() != "madvise", reason="needs transparent huge pages in madvise mode (this kernel's)")
@pytest.mark.parametrize("setting, huge", [(None, True), ("0", False)])
def test_the_command_line_gets_huge_pages_for_large_tensors_before_torch_reads_the_setting(setting, huge):
    """The real entry point, with its imports, in a fresh process: a 64 MiB tensor it allocates is backed by
    huge pages (torch read THP_MEM_ALLOC_ENABLE=1 at its first CPU allocation), unless the user set it to 0."""
    script = (
        "import quantkit.cli.main as m, torch\n"
        "def app(**_):\n"
        "    t = torch.ones(16 << 20)\n"
        "    rollup = open('/proc/self/smaps_rollup').read().splitlines()\n"
        "    print(next(int(l.split()[1]) for l in rollup if l.startswith('AnonHugePages:')))\n"
        "    return 0\n"
        "m.app = app\n"
        "m.main()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != runtime.HUGE_PAGES_VARIABLE}
    if setting is not None:
        env[runtime.HUGE_PAGES_VARIABLE] = setting
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True).stdout
    huge_kib = int(out.split()[-1])
    assert (huge_kib >= 32 << 10) is huge, huge_kib
