"""The compile helper's process (`mmrl.prewarm` starts it: `python -m mmrl.compile_helper
PAYLOAD`): the run's recipe with random weights and one decoder layer per layer type, for
one step, so that what it compiles lands in the run's compile cache. Its own module, apart
from `mmrl.prewarm`, because it runs a `Trainer`, which starts it."""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

from mmrl.prewarm import NICENESS, PARENT_ENV, PROFILE_ENV, helper_recipe


def _watch_parent(parent: int) -> None:
    """Exit this process once the run that started it is gone."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def run_helper(payload: Path) -> None:
    """The run's recipe (the payload `mmrl.prewarm.start` wrote) with random weights and
    shrunk layers (`mmrl.prewarm.helper_recipe`), one step. Its log (the cache folder's
    mmrl-prewarm/KEY.log, which the run waits on) gives each phase's end in seconds since
    the run started it."""
    data = json.loads(payload.read_text())
    started = data.get("started", time.time())

    def said(what: str) -> None:
        print(f"compile helper: {what} at {time.time() - started:.1f} s", flush=True)

    said("python up")
    from mmrl.trainer import Trainer

    said("imports done")
    recipe = helper_recipe(data["recipe"], data["folder"])
    if os.environ.get(PROFILE_ENV) == "1":  # where the helper's start goes (bench/decode_ab.sh's prewarm mode)
        trainer = _profiled(Trainer, recipe)
    else:
        trainer = Trainer(recipe)
    said("model built")
    trainer.train_step()
    layers = trainer.built.model.config.get_text_config().num_hidden_layers
    said(f"one step done, {layers} decoder layer{'s' if layers != 1 else ''}; rollout "
         f"{trainer.timings.get('rollout', 0.0):.1f} s, update {trainer.timings.get('update', 0.0):.1f} s, done")


def _profiled(make, *args, top: int = 40):
    """`make(*args)` under cProfile, its functions with the most cumulative time printed to
    the log (the helper's stdout) before it returns."""
    import cProfile
    import io
    import pstats

    profile = cProfile.Profile()
    made = profile.runcall(make, *args)
    text = io.StringIO()
    pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(top)
    print("compile helper: the trainer's build under cProfile\n" + text.getvalue(), flush=True)
    return made


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parent = os.environ.get(PARENT_ENV)
    if parent:
        threading.Thread(target=_watch_parent, args=(int(parent),), daemon=True).start()
    try:
        os.nice(NICENESS)
    except OSError:
        pass
    run_helper(Path(argv[0]))
    sys.stdout.flush()
    os._exit(0)  # no teardown of CUDA and compile workers: the run waits on this exit


if __name__ == "__main__":
    main()
