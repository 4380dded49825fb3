"""mmrl/page_cache.py: the CUDA libraries a GPU run reads into the page cache while it builds."""

import os

import torch  # noqa: F401 - maps torch's libraries, which the listing reads

from mmrl.page_cache import evict, library_files, read_ahead, read_files, resident_fraction


def test_the_listing_holds_the_libraries_this_process_maps_largest_first():
    paths = library_files()
    if not os.path.exists("/proc/self/maps"):
        assert paths == []
        return
    names = [p.name for p in paths]
    assert any(name.startswith("libtorch_cpu") for name in names), names
    sizes = [p.stat().st_size for p in paths]
    assert sizes == sorted(sizes, reverse=True) and min(sizes) >= 8 << 20
    assert len(set(paths)) == len(paths)
    assert library_files(min_bytes=1 << 40) == []


def test_files_are_read_through_into_the_page_cache(tmp_path, monkeypatch):
    files = []
    for i, size in enumerate((3 << 20, (1 << 20) + 123)):
        path = tmp_path / f"lib{i}.so"
        path.write_bytes(os.urandom(size))
        files.append(path)
    evict(files)  # cold where the file system keeps a page cache of its own (not tmpfs)
    assert read_files(files + [tmp_path / "missing.so"], chunk=1 << 20) == sum(p.stat().st_size for p in files)
    fraction = resident_fraction(files[0])
    assert fraction is None or fraction == 1.0
    thread = read_ahead(files)
    assert thread is not None and thread.daemon
    thread.join(timeout=60)
    assert not thread.is_alive()
    monkeypatch.setenv("MMRL_READ_AHEAD", "0")  # the bench's A/B side
    assert read_ahead(files) is None
    monkeypatch.delenv("MMRL_READ_AHEAD")
    assert read_ahead([]) is None
