"""Stopping a trainer the way a crash would, for the tests that resume it afterwards.

    stopped = interrupted_before(_trainer(run, "trainer.save_every=2"), 3)   # steps 1-2 done
    resumed = _trainer(run, "trainer.resume=true")
"""

import pytest


class Interrupted(RuntimeError):
    """What stops the trainer: raised where its next step would begin."""


def interrupted_before(trainer, step: int):
    """Run `trainer.fit()` until it is about to take `step`, then stop it with an exception
    out of `fit` (what it saved and wrote before is kept, as after a crash); the trainer."""
    take_step = trainer.train_step

    def stop_at_step():
        if trainer.step == step - 1:
            raise Interrupted(f"stopped before step {step}")
        return take_step()

    trainer.train_step = stop_at_step
    with pytest.raises(Interrupted):
        trainer.fit()
    return trainer
