"""The garbage collector's share of a step (`mmrl.gc_watch`, `time/gc`)."""

import gc

from mmrl.gc_watch import GcWatch, watch_gc


def test_the_watch_counts_full_collections_and_their_seconds():
    watch = GcWatch()
    watch.install()
    try:
        assert watch.take() == (0.0, 0)
        gc.collect(0)
        seconds, full = watch.take()
        assert seconds > 0 and full == 0  # a young collection counts its time, not as full
        gc.collect()
        gc.collect()
        seconds, full = watch.take()
        assert seconds > 0 and full == 2
        assert watch.take() == (0.0, 0)  # taken: nothing since
    finally:
        gc.callbacks.remove(watch._callback)


def test_the_process_has_one_watch_installed_once():
    first = watch_gc()
    watch_gc()
    assert watch_gc() is first
    assert gc.callbacks.count(first._callback) == 1
