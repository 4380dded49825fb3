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

from mmrl.prewarm import NICENESS, PARENT_ENV, merged, shrunk_layers


def _watch_parent(parent: int) -> None:
    """Exit this process once the run that started it is gone."""
    while True:
        if os.getppid() != parent:
            os._exit(3)
        time.sleep(1.0)


def run_helper(payload: Path) -> None:
    """The run's recipe (the payload `mmrl.prewarm.start` wrote) with random weights and
    shrunk layers, one step. The model's config is read as the build reads it
    (`recipe_config`): built from the family's tiny config apart from the recipe's own
    settings, the layer graph got another cache key than the run's and the run compiled anew.
    Its log (the cache folder's mmrl-prewarm/KEY.log, which the run waits on) gives each
    phase's end in seconds since the run started it."""
    data = json.loads(payload.read_text())
    started = data.get("started", time.time())

    def said(what: str) -> None:
        print(f"compile helper: {what} at {time.time() - started:.1f} s", flush=True)

    said("python up")
    from mmrl.build import recipe_config
    from mmrl.config import validate_recipe
    from mmrl.trainer import Trainer

    said("imports done")
    recipe = validate_recipe(data["recipe"], where="compile helper", folder=data["folder"])
    _, config = recipe_config(recipe.model, processor=False)  # as the build makes it, without the weights
    shrink = shrunk_layers(config)
    if not shrink:
        raise SystemExit("compile helper: the text config has no num_hidden_layers to shrink")
    model = recipe.model.model_copy(update={"random_init": True,
                                            "config_overrides": merged(recipe.model.config_overrides, shrink)})
    trainer = Trainer(recipe.model_copy(update={"model": model}))
    said("model built")
    trainer.train_step()
    layers = trainer.built.model.config.get_text_config().num_hidden_layers
    said(f"one step done, {layers} decoder layer{'s' if layers != 1 else ''}; rollout "
         f"{trainer.timings.get('rollout', 0.0):.1f} s, update {trainer.timings.get('update', 0.0):.1f} s, done")


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
